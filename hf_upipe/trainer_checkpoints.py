"""Atomic checkpoints and verified resumes for `UPipeTrainer`.

Entry points:
- `save_staged(write, *, run_dir, args, state)`: one checkpoint written into a hidden staging folder, given a
  manifest (size and SHA-256 of every file, `hf_upipe.checkpoint`) and renamed to `checkpoint-N` once every rank
  has written its part, so an interrupted save never leaves a partial `checkpoint-N`.
- `verify_resume(resume_from_checkpoint, output_dir)`: the checkpoint `train(resume_from_checkpoint=...)` resumes
  from, verified against its manifest on every rank.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch.distributed as dist
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    get_last_checkpoint,
    rotate_checkpoints,
)

from hf_upipe.checkpoint import verify_checkpoint, write_manifest

__all__ = ["save_staged", "verify_resume"]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_staged(write: Callable[[str], None], *, run_dir: str, args, state) -> None:
    """Write the Trainer's checkpoint of step `state.global_step` into `<run_dir>/.staging-checkpoint-N/`, give it
    its manifest, rename it to `<run_dir>/checkpoint-N` and rotate the old ones (every rank, in step).

    Args:
        write: `write(staging)` runs the Trainer's own save with its output folder re-pointed to
            `<run_dir>/<staging>` (UPipeTrainer's `_get_output_dir`).
        run_dir: the Trainer's output folder of this run; args, state: its `TrainingArguments` and `TrainerState`
            (`best_model_checkpoint` is moved to the final folder).
    """
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging_root = os.path.join(run_dir, f".staging-{name}")
    if args.should_save and os.path.exists(staging_root):
        shutil.rmtree(staging_root)  # left by an interrupted save
    _barrier()
    write(f".staging-{name}")
    _barrier()  # every rank has written its files (RNG states, sharded optimizer states)
    staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
    best = state.best_model_checkpoint
    if best and best.startswith(staging_root):
        state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(best, staging_root))
        if args.should_save:
            state.save_to_json(os.path.join(staged, "trainer_state.json"))
    _barrier()
    write_manifest(staged)  # every rank hashes a share; returns once the manifest is written
    if args.should_save:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staged, final)
        shutil.rmtree(staging_root)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
    _barrier()


def verify_resume(resume_from_checkpoint, output_dir: str) -> None:
    """Verify the checkpoint `train(resume_from_checkpoint=...)` names (True: the last in `output_dir`) against its
    manifest (`hf_upipe.checkpoint.verify_checkpoint`); nothing to verify without one (the Trainer raises its own
    error when True finds none)."""
    path = resume_from_checkpoint
    if path is True:
        path = get_last_checkpoint(output_dir)
    if isinstance(path, (str, os.PathLike)):
        verify_checkpoint(os.fspath(path))
