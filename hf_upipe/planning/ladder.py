"""The settings the planner chooses among: the memory ladder and the fused block's faster variants.

Entry points:
- `ladder(config, sp_size, impl=None)`: the candidate memory settings, cheapest first (see
  `hf_upipe.planning.planner`).
- `candidates(config, sp_size, impl=None)`: the ladder with the fused block's faster variants, each paired with the
  rung whose memory it needs at least.
- `default_impl(config)`: "fused" where `prepare_model` would install the fused block, "upipe" otherwise.
"""

from __future__ import annotations

import dataclasses
import math

from hf_upipe.attention.fused import fused_unavailable
from hf_upipe.models.architectures import model_geometry
from hf_upipe.ops.head_layout import valid_heads_per_chunk
from hf_upipe.planning.train_step import StepSettings

__all__ = ["candidates", "default_impl", "ladder"]


def default_impl(config) -> str:
    """ "fused" where a run would install the fused block (`hf_upipe.attention.fused.fused_unavailable` is
    None), "upipe" (registered) otherwise: the planner plans what `prepare_model` will run."""
    return "fused" if fused_unavailable(config) is None else "upipe"


def ladder(config, sp_size: int, impl: str | None = None) -> list[StepSettings]:
    """The candidate settings for this model and SP degree, cheapest first (`hf_upipe.planning.planner`'s docstring),
    then each checkpoint-offload rung with offload="disk" (no host memory for the checkpoints).

    `impl`: None picks `default_impl(config)` (fused where a run installs the fused block); "ulysses" or "deepspeed"
    keep all heads in one chunk (their ladder has the tiled MLP and offload rungs only).
    """
    g = model_geometry(config)
    impl = impl or default_impl(config)
    rungs = [
        StepSettings(impl, None, tiled_mlp=False, offload="none"),
        StepSettings(impl, None, tiled_mlp=True, offload="none"),
        StepSettings(impl, None, tiled_mlp=True, offload="cpu"),
    ]
    if impl in ("ulysses", "deepspeed"):
        return rungs
    chunks = sorted(
        c
        for c in valid_heads_per_chunk(g["heads"], g["kv_heads"], sp_size)
        if c < g["heads"] // sp_size
    )
    rungs += [StepSettings(impl, c, tiled_mlp=True, offload="cpu") for c in reversed(chunks)]
    smallest = rungs[-1]
    rungs.append(
        dataclasses.replace(
            smallest,
            mlp_chunk_tokens=max(1, g["hidden"] // 4),
            loss_chunk_tokens=max(1, math.ceil(2**24 / g["vocab"])),
        )
    )  # 64 MiB fp32 logits
    # where the host memory binds: the offload rungs' checkpoints to disk, the same device memory as "cpu", judged
    # only after every "cpu" candidate (`fastest_fit`); the last rung is the smallest one's disk twin (`--max`)
    return rungs + [dataclasses.replace(r, offload="disk") for r in rungs if r.offload == "cpu"]


def candidates(
    config, sp_size: int, impl: str | None = None
) -> list[tuple[StepSettings, StepSettings]]:
    """(candidate, its memory rung): the ladder's rungs (their own rung), and for the fused block each rung's faster
    variants, which need at least the rung's memory: the save-mode backward, and where a rung has several stages
    the overlapped all-to-alls, in both backward modes."""
    g = model_geometry(config)
    out = []
    for rung in ladder(config, sp_size, impl):
        out.append((rung, rung))
        if rung.impl != "fused":
            continue
        stages = g["heads"] // sp_size // (rung.heads_per_chunk or g["heads"] // sp_size)
        out.append((dataclasses.replace(rung, fused_backward="save"), rung))
        if stages > 1:
            out += [
                (dataclasses.replace(rung, overlap=True), rung),
                (dataclasses.replace(rung, fused_backward="save", overlap=True), rung),
            ]
    return out
