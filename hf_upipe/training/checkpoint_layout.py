"""The layout a checkpoint was trained at, recorded in it, and the check that a run may resume from it.

A checkpoint saved at one (SP, ring, DP) layout resumes at another when the global batch (rows per optimizer step)
and the model are the same: the weights and the optimizer state are whole tensors (DDP) or resharded on load (torch
distributed checkpoints), the data position is counted in optimizer steps, and every rank's random generators are
alike between forwards (docs/randomness.md), so rank 0's saved state is every rank's. `docs/checkpoints.md`.

Entry points:
- `TrainingLayout`: the layout of a run (sp_size, ring_size, dp_size, world_size, rows per micro-batch,
  accumulation steps, the model's fingerprint); `global_batch`, `describe()`.
- `model_fingerprint(model)`: the model's class, parameter counts and a digest of its parameter names and shapes.
- `write_layout(folder, layout)`: writes `upipe_layout.json` into a checkpoint folder (call on one rank, before the
  manifest is written, so the manifest covers it).
- `check_resume_layout(folder, layout)`: on every rank, before any step and any collective: raises
  `CheckpointError` naming both layouts and the fix when the global batch or the model differ; returns the saved
  layout (None for a checkpoint without a record).
- `rng_file(folder, name, rank)`: the per-rank random-state file a rank loads: its own, or rank 0's when the
  checkpoint was saved by fewer processes.
- `LAYOUT`: the record's file name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from hf_upipe.training.checkpoint import CheckpointError

__all__ = [
    "LAYOUT",
    "TrainingLayout",
    "check_resume_layout",
    "model_fingerprint",
    "rng_file",
    "write_layout",
]

LAYOUT = "upipe_layout.json"
_WRAPPERS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class TrainingLayout:
    """How a run is laid out: SP groups of `sp_size` ranks (a ring of `ring_size` inside each), `dp_size` of them,
    `world_size` processes; each SP group takes `micro_batch` rows per forward and steps the optimizer every
    `grad_accum` forwards; `model` is `model_fingerprint(model)`."""

    sp_size: int
    ring_size: int
    dp_size: int
    world_size: int
    micro_batch: int
    grad_accum: int
    model: dict

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step: micro_batch x dp_size x grad_accum (the SP ranks of a group share rows)."""
        return self.micro_batch * self.dp_size * self.grad_accum

    def describe(self) -> str:
        ring = f" (ring {self.ring_size})" if self.ring_size > 1 else ""
        return (
            f"SP {self.sp_size}{ring} x DP {self.dp_size} on {self.world_size} processes, global batch "
            f"{self.global_batch} = {self.micro_batch} rows x DP {self.dp_size} x {self.grad_accum} "
            f"accumulation steps, model {self.model['class']} ({self.model['parameters']} parameters, "
            f"{self.model['trainable']} trainable)"
        )


def _unwrapped_name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def model_fingerprint(model) -> dict:
    """{"class", "parameters", "trainable", "digest"} of `model` (DDP, FSDP2 and compile wrappers looked through:
    the names without their prefixes, the global shapes of sharded parameters). The same on every rank."""
    inner = model
    while hasattr(inner, "module") and type(inner).__name__ in (
        "DistributedDataParallel",
        "DataParallel",
    ):
        inner = inner.module
    params = sorted(
        (_unwrapped_name(n), tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()
    )
    digest = hashlib.sha256(repr(params).encode()).hexdigest()
    count = sum(_numel(shape) for _, shape, _ in params)
    trainable = sum(_numel(shape) for _, shape, grad in params if grad)
    # FSDP2's fully_shard makes the class FSDP<name>(FSDPModule, <name>): the model's own class is the first other
    own = next((c for c in type(inner).__mro__ if not c.__name__.startswith("FSDP")), type(inner))
    return {
        "class": own.__name__,
        "parameters": count,
        "trainable": trainable,
        "digest": digest,
    }


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_layout(folder: str, layout: TrainingLayout) -> None:
    """Write `layout` as `<folder>/upipe_layout.json` (one rank; before the manifest, which then covers it)."""
    with open(os.path.join(folder, LAYOUT), "w") as f:
        json.dump({**asdict(layout), "global_batch": layout.global_batch}, f, indent=1)


def _read_layout(folder: str) -> TrainingLayout | None:
    path = os.path.join(folder, LAYOUT)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        saved.pop("global_batch", None)
        return TrainingLayout(**saved)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"Cannot resume from {folder}: {path} is unreadable ({err})."
        ) from err


def check_resume_layout(folder: str, layout: TrainingLayout) -> TrainingLayout | None:
    """Refuse to resume from `folder` at `layout` when its global batch or model differ from the saved ones.

    Reads one small file and compares; no collective, so call it on every rank before any (every rank reads the
    same file and computes the same layout, so every rank raises the same error).

    Returns:
        the saved layout, or None when the checkpoint has no record (written before layouts were recorded).

    Raises:
        CheckpointError: naming the saved and the current layouts and what to change.
    """
    saved = _read_layout(folder)
    if saved is None:
        return None
    both = f"saved at {saved.describe()}; resuming at {layout.describe()}"
    if saved.model["digest"] != layout.model["digest"]:
        raise CheckpointError(
            f"Cannot resume from {folder}: it holds another model ({both}; the parameter names or shapes "
            "differ). Resume with the model and adapter settings the checkpoint was trained with (the same "
            "config, the same LoRA rank and target modules), or start a new run from its weights."
        )
    if saved.global_batch != layout.global_batch:
        raise CheckpointError(
            f"Cannot resume from {folder}: the global batch differs ({both}). The optimizer state, the "
            "schedule and the data position count optimizer steps of "
            f"{saved.global_batch} rows; choose the rows per device and the accumulation steps so that rows x "
            f"DP {layout.dp_size} x accumulation = {saved.global_batch} (for example "
            f"{_suggestion(saved.global_batch, layout.dp_size)}), or start a new run from its weights."
        )
    return saved


def _suggestion(global_batch: int, dp_size: int) -> str:
    if global_batch % dp_size:
        return (
            f"DP {dp_size} does not divide {global_batch}: choose an sp_size that makes DP a divisor of "
            f"{global_batch}"
        )
    per_replica = global_batch // dp_size
    return (
        f"{per_replica} row(s) per device and 1 accumulation step, or 1 row and {per_replica} steps"
    )


def rng_file(folder: str, name: str, rank: int) -> str | None:
    """The random-state file rank `rank` loads from `folder`: `name.format(rank)` if it exists, else rank 0's
    (`name.format(0)`: a checkpoint saved by fewer processes; every rank's generators are alike between forwards,
    docs/randomness.md), else None."""
    for candidate in (name.format(rank), name.format(0)):
        path = os.path.join(folder, candidate)
        if os.path.isfile(path):
            return path
    return None
