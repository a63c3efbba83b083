"""The fused UPipe block's per-call plan and the projection helpers its forward and backward loops share.

Entry points (used by `hf_upipe.ops.fused_attention` and `hf_upipe.ops.fused_backward`):
- `StagePlan` / `make_plan(layout, group, kernel, scale, D, positions, dropout, save, overlap)`: per-call
  constants, each stage's model heads, the LoRA dropout masks, the backward mode and the overlap schedule.
- `head_rows(heads, D)`: projection rows of heads; `project_rows(x, proj, rows, xas)`: x @ W[rows]^T (+ bias, LoRA).
- `block_sides(x, w, plan, xas, inv_rms)`: q/k/v with their norms and RoPE; `projection_features(plan, name)`.

Legend as in `hf_upipe.ops.fused_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_upipe.ops.block_weights import AttentionWeights, Projection, ProjectionNorm
from hf_upipe.ops.head_layout import HeadLayout
from hf_upipe.ops.head_transforms import Side, projection_inv_rms
from hf_upipe.ops.kernels import AttentionKernel
from hf_upipe.ops.lora_dropout import LoraDropout

__all__ = [
    "StagePlan",
    "block_sides",
    "head_rows",
    "make_plan",
    "project_rows",
    "projection_features",
]


def head_rows(heads: torch.Tensor, D: int) -> torch.Tensor:
    """Row indices [n*D] of the given heads [n]."""
    return (heads[:, None] * D + torch.arange(D, device=heads.device)).flatten()


@dataclass
class StagePlan:
    """Per-call constants shared by forward and backward."""

    layout: HeadLayout
    group: dist.ProcessGroup | None
    kernel: AttentionKernel
    scale: float
    D: int
    dropout: LoraDropout  # the LoRA dropout masks, which forward and backward share
    save: bool = False  # keep each stage's (oh, lse) for the backward instead of recomputing them
    overlap: bool = False  # backward: send the next stage's inputs (and this stage's outputs) during this kernel
    overlap_forward: bool = (
        False  # the same in the forward (on whenever a backward follows: it costs no peak)
    )
    q_heads: list[torch.Tensor] = field(
        default_factory=list
    )  # per stage, model q heads [P*c] (rank-major)
    kv_heads: list[torch.Tensor] = field(default_factory=list)  # per stage, model k/v heads [P*kc]

    @property
    def chunk_rows(self) -> int:
        """Projection rows of one stage's query heads (P*c*D): the unit of a whole-projection norm's passes."""
        return self.layout.sp_size * self.layout.chunk * self.D


def make_plan(
    layout,
    group,
    kernel,
    scale,
    D,
    positions: torch.Tensor | None,
    dropout: bool,
    save: bool = False,
    overlap: bool = False,
    overlap_forward: bool = False,
    device: torch.device | None = None,
) -> StagePlan:
    """The per-call constants of one fused block call, with each stage's model heads (rank-major). `overlap`: the
    backward's all-to-alls one stage ahead (and the forward's); `overlap_forward`: the forward's. `positions` [s]:
    the global token indices of the shard, which the LoRA dropout masks are drawn by (None without dropout: then
    `device` is the block's)."""
    # the masks' seed, drawn from torch's generator: a new one every call, and the same one again when activation
    # checkpointing (which restores the generator's state) recomputes the call
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout else 0
    device = positions.device if positions is not None else device
    plan = StagePlan(
        layout,
        group,
        kernel,
        scale,
        D,
        dropout=LoraDropout(seed, positions),
        save=save,
        overlap=overlap,
        overlap_forward=overlap or overlap_forward,
    )
    P, qpr, kpr = layout.sp_size, layout.q_per_rank, layout.kv_per_rank
    ranks = torch.arange(P, device=device)[:, None]  # [P, 1]
    for i in range(layout.num_stages):
        sl = layout.q_heads(i)  # rank r: model heads r*qpr + sl -> [P*c], rank-major
        plan.q_heads.append(
            (ranks * qpr + torch.arange(sl.start, sl.stop, device=device)).flatten()
        )
        src = layout.kv_source_index(i, device)  # replicated k/v heads (Hk < P)
        if src is None:
            kvs = layout.kv_heads(i)
            src = (ranks * kpr + torch.arange(kvs.start, kvs.stop, device=device)).flatten()
        plan.kv_heads.append(src)
    return plan


def project_rows(
    x: torch.Tensor, proj: Projection, rows: torch.Tensor, xas: list[torch.Tensor]
) -> torch.Tensor:
    """x [B, s, Dm] -> the projection's rows R before norm/RoPE: [B, s, len(R)]."""
    out = torch.nn.functional.linear(
        x,
        proj.weight.index_select(0, rows),
        None if proj.bias is None else proj.bias.index_select(0, rows),
    )
    for a, xa in zip(proj.adapters, xas):
        out.add_(xa @ a.B.index_select(0, rows).t(), alpha=a.scaling)  # [B, s, r] @ [r, R]
    return out


def block_sides(x, w: AttentionWeights, plan: StagePlan, xas, inv_rms=None) -> dict[str, Side]:
    """q/k/v of this call; a whole-projection norm's inverse RMS is computed here (forward) or given (backward)."""
    sides = {
        "q": Side(w.q, w.q_norm, w.rope.rotate),
        "k": Side(w.k, w.k_norm, w.rope.rotate),
        "v": Side(w.v),
    }
    for n, name in enumerate("qk"):
        side = sides[name]
        if isinstance(side.norm, ProjectionNorm):
            side.inv_rms = (
                inv_rms[n]
                if inv_rms is not None
                else projection_inv_rms(
                    lambda rows: project_rows(x, side.proj, rows, xas[name]),
                    projection_features(plan, name),
                    plan.chunk_rows,
                    side.norm.eps,
                    x.device,
                )
            )  # [B, s, 1]
    return sides


def projection_features(plan: StagePlan, name: str) -> int:
    """Rows of the whole q (H*D) or k (Hk*D) projection."""
    return (plan.layout.num_heads if name == "q" else plan.layout.num_kv_heads) * plan.D
