"""A checkpoint save that fails on a full disk (or any other write error), explained.

Entry points:
- `explained_save_errors(run_dir, *, should_save=True)`: a context manager around one staged checkpoint save
  (`hf_upipe.training.trainer.save_staged`, the examples' `save_checkpoint`). A write error inside it (an
  `OSError` such as ENOSPC, safetensors' `SafetensorError`, torch.save's `RuntimeError` "... failed writing ...")
  becomes a `CheckpointSaveError` naming the path it failed on, the bytes the checkpoint needs (the size of the
  last complete checkpoint, or at least what was written before the failure) and the free space there, and saying
  which complete checkpoint stays intact to resume from. The staging folders of the failed save are removed
  (`should_save`: on the rank that writes the shared files), so no half checkpoint is left; the other ranks are
  told (`hf_upipe.training.peers`) and exit naming this one. A rank whose save's collective fails because another
  rank went away (that rank's own save failed) raises `peers.named_peer`'s line naming it instead.
- `CheckpointSaveError`: an `OSError` (its `errno` that of the cause, where there is one).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

__all__ = ["CheckpointSaveError", "explained_save_errors"]

_GIB = 2**30


class CheckpointSaveError(OSError):
    """A checkpoint save that failed to write (module docstring)."""


def _is_write_error(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return True
    name = type(err).__name__
    text = str(err).lower()
    return name == "SafetensorError" or (
        isinstance(err, RuntimeError) and ("write" in text or "no space" in text)
    )


def _size(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def _staging(run_dir: str) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return [os.path.join(run_dir, d) for d in os.listdir(run_dir) if d.startswith(".staging-")]


def _free(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _explain(err: BaseException, run_dir: str) -> CheckpointSaveError:
    from hf_upipe.training.peers import last_checkpoint

    path = getattr(err, "filename", None) or (_staging(run_dir) or [run_dir])[0]
    previous = last_checkpoint(run_dir)
    written = sum(_size(s) for s in _staging(run_dir))
    if previous:
        needed = f"about {_size(previous) / _GIB:.3f} GiB ({_size(previous)} bytes, the size of {previous})"
        kept = f"{previous} is intact: resume from it"
    else:
        needed = f"more than the {written} bytes written before the failure"
        kept = "no earlier checkpoint exists"
    free = _free(path)
    free_said = "unknown" if free is None else f"{free / _GIB:.3f} GiB ({free} bytes)"
    cause = re.sub(r"\s+", " ", f"{type(err).__name__}: {err}")[:300]
    number = getattr(err, "errno", None) or 0
    return CheckpointSaveError(
        *([number] if number else []),
        f"Saving a checkpoint failed writing {path} ({cause}). The checkpoint needs {needed}; free on that "
        f"disk: {free_said}. Nothing half-written was kept, {kept}. Free space (a lower save_total_limit "
        "removes old checkpoints) or point output_dir to a larger disk.",
    )


@contextlib.contextmanager
def explained_save_errors(run_dir: str, *, should_save: bool = True):
    """See the module docstring."""
    try:
        yield
    except Exception as err:
        if isinstance(err, CheckpointSaveError):
            raise
        from hf_upipe.training.peers import named_peer

        found = named_peer(err)  # a barrier of the save failed: another rank stopped
        if found is not err:
            raise found from err
        if not _is_write_error(err):
            raise
        explained = _explain(err, run_dir)
        if should_save:
            for folder in _staging(run_dir):
                shutil.rmtree(folder, ignore_errors=True)
        from hf_upipe.training.peers import post_failure

        post_failure(f"CheckpointSaveError: {str(explained)[:200]}")
        raise explained from err
