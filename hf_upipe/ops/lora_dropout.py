"""The fused block's LoRA dropout: masks drawn per global token position, so every shard of a sequence draws the
mask one process draws for the same tokens.

Entry points (used by `hf_upipe.ops.fused_stages`, `hf_upipe.ops.fused_attention` and
`hf_upipe.ops.fused_backward`, which must agree on every mask):
- `LoraDropout(seed, positions)`: one call's masks. `inputs(t, p, index)`: dropout of the block's input x
  [B, s, Dm] (or [B*s, Dm]) for the q/k/v adapters with the `index`-th distinct A; `output(t, p, j, cols)`: dropout
  of o_proj adapter j's input, the attention output's columns `cols` [N, len(cols)]. The forward applies a mask, the
  backward applies the same one to the gradient.
- `keep_mask(seed, stream, p, batch, positions, cols)`: the keep mask [B, s, F] itself.
- `shard_positions(group, s, device)`: the global token indices [s] of a contiguous shard of the group's sequence.
- `splitmix64(z)`: a well-mixed 64-bit integer (the masks' keys; `hf_upipe.adapters.hooks`'s seeds).

Why a hash and not `torch.rand`: a generator's stream depends on how many numbers were drawn before, so a shard
cannot draw its part of one process's mask without drawing all of it. Here each element's uniform number is a
function of (seed, stream, batch row b, global position t, feature f) alone: a 32-bit integer hash (Wellons'
`lowbias32` mixer, on int64 tensors whose products never overflow), kept when it is at
least p * 2^32. The mask is therefore the same whatever the sequence-parallel degree, the head chunking and the
order of stages (the o_proj adapter's columns are the model's columns of the stage's heads), on CPU and on CUDA;
two shards holding the same tokens at the same local positions draw different masks. The seed is drawn once per
call from torch's generator (`hf_upipe.ops.fused_stages.make_plan`), so it changes every step, and activation
checkpointing, which restores that generator before recomputing, gets the same masks again. (Inside a model under
SP that generator is the rank's own stream, `hf_upipe.adapters.hooks`; called with one seed on every rank,
the block draws one process's masks bit for bit.) The mask is computed
a block of rows at a time (at most 2^22 int64 elements live at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LoraDropout", "keep_mask", "shard_positions", "splitmix64"]

_M32 = 0xFFFFFFFF
_BLOCK = 1 << 22  # int64 elements hashed at once
_OUTPUT_STREAMS = (
    1 << 16
)  # o_proj adapter j draws stream _OUTPUT_STREAMS + j; q/k/v: the index of their A


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32, in place on int64 x in [0, 2^32): a bijection of [0, 2^32) whose output bits each depend
    on every input bit. Each product is x times the odd constant c or c - 2^32 (the same modulo 2^32), whichever is
    under 2^31 in size, so it stays under 2^63: no int64 product overflows, and `& 2^32-1` keeps its low 32 bits."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x846CA68B - 2**32).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def splitmix64(z: int) -> int:
    """Vigna's splitmix64 finaliser: a well-mixed 64-bit integer from any integer (keys and seeds)."""
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def keep_mask(
    seed: int, stream: int, p: float, batch: int, positions: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """Keep mask [B, s, F] (bool) of rows b < batch, global positions `positions` [s] and features `cols` [F]:
    element (b, t, f) is dropped with probability p, independently of every other (module docstring)."""
    key = splitmix64(splitmix64(seed) ^ stream)
    k_b, k_t, k_f = key & _M32, (key >> 32) & _M32, splitmix64(key) & _M32
    device = positions.device
    rows = _mix(
        _mix(torch.arange(batch, device=device)[:, None] ^ k_b)  # [B, 1]
        ^ _mix((positions.to(torch.int64) & _M32) ^ k_t)[None]  # [1, s]
    ).reshape(-1, 1)  # [B*s, 1]
    feats = _mix(cols.to(device=device, dtype=torch.int64) ^ k_f)  # [F]
    threshold = min(round(p * 2**32), 2**32)
    keep = torch.empty(rows.shape[0], feats.shape[0], dtype=torch.bool, device=device)
    step = max(1, _BLOCK // max(1, feats.shape[0]))
    for a in range(0, rows.shape[0], step):
        torch.ge(_mix(rows[a : a + step] ^ feats), threshold, out=keep[a : a + step])  # [n, F]
    return keep.view(batch, -1, feats.shape[0])


def shard_positions(group: dist.ProcessGroup | None, s: int, device) -> torch.Tensor:
    """Global token indices [s] of this rank's contiguous shard: rank r of the group holds r*s .. r*s+s-1 (all of
    them without a group)."""
    rank = dist.get_rank(group) if group is not None else 0
    return torch.arange(rank * s, (rank + 1) * s, device=device)


class LoraDropout:
    """One fused block call's LoRA dropout masks (module docstring): `seed` drawn for the call, `positions` [s] the
    global token indices of the shard's tokens."""

    def __init__(self, seed: int, positions: torch.Tensor):
        self.seed, self.positions = seed, positions

    def _apply(self, t: torch.Tensor, p: float, stream: int, cols: torch.Tensor) -> torch.Tensor:
        if p == 0.0:
            return t
        s = self.positions.shape[0]
        keep = keep_mask(
            self.seed, stream, p, t.numel() // (s * cols.shape[0]), self.positions, cols
        )
        return t * keep.view(t.shape).to(t.dtype) / (1.0 - p)

    def inputs(self, t: torch.Tensor, p: float, index: int) -> torch.Tensor:
        """Dropout of x [B, s, Dm] (or [B*s, Dm]) for the q/k/v adapters with the `index`-th distinct A (a fused qkv
        projection's three slices share their A, and so one mask, as PEFT applies them)."""
        return self._apply(t, p, index, torch.arange(t.shape[-1], device=t.device))

    def output(self, t: torch.Tensor, p: float, j: int, cols: torch.Tensor) -> torch.Tensor:
        """Dropout of o_proj adapter j's input [N, len(cols)]: the attention output's model columns `cols`."""
        return self._apply(t, p, _OUTPUT_STREAMS + j, cols)
