"""The attention kernel's backward in square tiles, so that its workspace scales with a tile, not the sequence.

Entry points:
- `backward_block()`: the tile length in tokens, `UPIPE_BACKWARD_BLOCK` (default `DEFAULT_BLOCK`, 262144; 0: never
  tile). Read at every call, so the runtime and the planner (`hf_upipe.planning.reserved`,
  `hf_upipe.planning.step_time`) see the same value.
- `tiles(kernel, q, k, causal, block=None) -> bool`: whether `tiled_backward` tiles this call.
- `tiled_backward(kernel, dout, q, k, v, out, lse, *, scale, causal, block=None, into=None)`: `kernel.backward` of
  one call, tiled when `tiles` says so, else the kernel's own backward unchanged. With `into` (float32 dq, dk, dv
  accumulators of the call's shapes, e.g. views of a ring's), the gradients are added there instead of returned:
  a tiled call then sums its tiles straight into them, with no float32 sum or gradient of the call's own.

Why it is exact. Given the forward's output and log-sum-exp, a flash backward's softmax of query row r over the keys
of a tile is exp(s_rc - lse_r), and its row term is rowsum(dout_r * out_r): both need only the row's own out and lse,
whatever keys the tile holds (ring attention rests on the same identity, `hf_upipe.ops.ring`). So the backward of
the whole call is the sum over tiles (query rows [i0, i1), keys [j0, j1)) of the tile's backward: dq of the rows
sums over key tiles, dk/dv of the keys over query tiles. With causal attention (the top-left alignment of every
kernel here, on a square call) tiles above the diagonal see nothing and are skipped, tiles below it are full
(`causal=False`), and a diagonal tile is itself a square causal call (i0 == j0). Every kernel call is therefore one
of the two kinds the kernels already serve, and no call is longer than one tile.

Loops and memory: one side's gradients are accumulated in float32 (q's dtype when that is float32 or float64) over
the whole call, the other's over one tile. With h query heads and hk k/v heads, when h <= 2 hk (the fused block's
one or two heads per stage) the key tiles are outer: dq [B, S, h, D] is summed over key tiles and cast at the end,
each key tile's dk/dv [B, T, hk, D] over its query tiles and written into dk/dv [B, S, hk, D]. Otherwise (all local
heads of a GQA model in one stage) the query tiles are outer: dk/dv [B, S, hk, D] are summed and cast one after the
other at the end, each query tile's dq over its key tiles. These are ordinary tensors, so the memory tracker and the
planner's simulation see them; the kernel's own workspace (the flash backward's dq accumulator and the like) is
that of a call of T tokens. Loops over fake tensors run the first three and the last two tiles of each loop
(`hf_upipe.ops.fake.chunk_starts`: every tile allocates the same).

Which calls are tiled: those of the plain registered kernels ("sdpa" on CPU and CUDA, "cudnn", "flash_attn", and
their hollow twins), longer than one tile, square when causal. Wrapped kernels (windows, soft-capping, chunked
attention, documents) are called as they are; the ring and `DocumentKernel`'s per-document loop call their inner
kernel through this function, so each ring step and each long document is tiled (flash-attn's varlen call for
packed rows is not). `CudnnKernel` chooses its fallback kernel by the call's
length: a tiled call uses the kernel that the untiled call of the whole length would (`tile_kernel`), so the
log-sum-exp handed back is the one the forward computed with the same kernel.

Cost: (n^2 + n) / 2 kernel calls for n = ceil(S / T) tiles (causal), the same arithmetic as one call, plus the
accumulators' reads and writes (`hf_upipe.planning.step_time` charges them).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from hf_upipe.ops.fake import chunk_starts
from hf_upipe.ops.kernels import AttentionKernel, SdpaCpuKernel

__all__ = ["DEFAULT_BLOCK", "ENV", "backward_block", "tiled_backward", "tiles"]

ENV = "UPIPE_BACKWARD_BLOCK"
DEFAULT_BLOCK = 2**18


def backward_block() -> int:
    """Tokens per tile of the attention backward: `UPIPE_BACKWARD_BLOCK` (an integer >= 0; 0: never tile), default
    262144.

    Raises:
        ValueError: a value that is not a non-negative integer.
    """
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_BLOCK
    try:
        block = int(raw)
    except ValueError:
        block = -1
    if block < 0:
        raise ValueError(
            f"{ENV}={raw!r}: give the attention backward's tile length in tokens (e.g. 262144), or 0 to not tile."
        )
    return block


def _plain(kernel) -> bool:
    """A registered kernel itself (or its hollow twin), not a wrapper around one."""
    from hf_upipe.ops.kernels_aten import CudnnKernel, SdpaCudaKernel
    from hf_upipe.ops.kernels_flash_attn import FlashAttnKernel

    return isinstance(kernel, (SdpaCpuKernel, SdpaCudaKernel, CudnnKernel, FlashAttnKernel))


def tiles(kernel, q: torch.Tensor, k: torch.Tensor, causal: bool, block: int | None = None) -> bool:
    """Whether `tiled_backward` tiles a call with q [B, Sq, h, D], k [B, Sk, hk, D] (module docstring)."""
    block = backward_block() if block is None else block
    if block <= 0 or max(q.shape[1], k.shape[1]) <= block or not _plain(kernel):
        return False
    return not causal or q.shape[1] == k.shape[1]


def tiled_backward(
    kernel: AttentionKernel,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    block: int | None = None,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`kernel.backward(dout, q, k, v, out, lse)` (layouts of `hf_upipe.ops.kernels`), in tiles of `block` tokens
    (default `backward_block()`) when `tiles` says so: dq [B, Sq, h, D], dk/dv [B, Sk, hk, D] in the inputs'
    dtypes; or, with `into` = (dq, dk, dv) accumulators of those shapes in float32 (float64 for float64 inputs),
    added to them in place, and None returned."""
    block = backward_block() if block is None else block
    if not tiles(kernel, q, k, causal, block):
        grads = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        if into is None:
            return grads
        for acc, g in zip(into, grads):
            acc += g
        return None
    call = _Call(getattr(kernel, "tile_kernel", lambda _q: kernel)(q), scale, causal, block)
    if q.shape[2] <= 2 * k.shape[2]:  # the smaller accumulator: dq's, or dk's and dv's
        return _keys_outer(call, dout, q, k, v, out, lse, into)
    return _queries_outer(call, dout, q, k, v, out, lse, into)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What every tile of one tiled call shares: the kernel, its scale, causality and the tile length."""

    kernel: AttentionKernel
    scale: float
    causal: bool
    block: int

    def tile(self, dout, q, k, v, out, lse, rows: tuple[int, int], keys: tuple[int, int]):
        """The kernel's backward of query rows [i0, i1) against keys [j0, j1): causal on the diagonal."""
        (i0, i1), (j0, j1) = rows, keys
        return self.kernel.backward(
            dout[:, i0:i1],
            q[:, i0:i1],
            k[:, j0:j1],
            v[:, j0:j1],
            out[:, i0:i1],
            lse[:, :, i0:i1].contiguous(),
            scale=self.scale,
            causal=self.causal and i0 == j0,
        )


def _keys_outer(call: _Call, dout, q, k, v, out, lse, into=None):
    """Key tiles outer: dq [B, Sq, h, D] accumulated in float32 over them, each key tile's dk/dv [B, T, hk, D] over
    its query tiles (at and below the diagonal when causal) and written once (added once to `into`'s)."""
    sq, sk, T = q.shape[1], k.shape[1], call.block
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, float64 for float64 inputs
    if into is None:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [B, Sq, h, D]
        dk, dv = torch.empty_like(k), torch.empty_like(v)  # [B, Sk, hk, D]
    else:
        dq, dk, dv = into  # float32 [B, Sq, h, D], [B, Sk, hk, D]: summed into
    for j0 in chunk_starts(sk, T, q):
        keys, first = (j0, min(j0 + T, sk)), j0 if call.causal else 0
        dk_j = dv_j = None  # [B, T, hk, D] in `acc`
        for i0 in [first + i for i in chunk_starts(sq - first, T, q)]:
            dq_t, dk_t, dv_t = call.tile(dout, q, k, v, out, lse, (i0, min(i0 + T, sq)), keys)
            dq[:, i0 : i0 + T] += dq_t
            if dk_j is None:
                dk_j, dv_j = dk_t.to(acc), dv_t.to(acc)
            else:
                dk_j += dk_t
                dv_j += dv_t
            del dq_t, dk_t, dv_t
        if into is None:
            dk[:, keys[0] : keys[1]] = dk_j
            dv[:, keys[0] : keys[1]] = dv_j
        else:
            dk[:, keys[0] : keys[1]] += dk_j
            dv[:, keys[0] : keys[1]] += dv_j
        del dk_j, dv_j
    return None if into is not None else (dq.to(q.dtype), dk, dv)


def _queries_outer(call: _Call, dout, q, k, v, out, lse, into=None):
    """Query tiles outer: dk/dv [B, Sk, hk, D] accumulated in float32 over them, each query tile's dq [B, T, h, D]
    over its key tiles (at and left of the diagonal when causal) and written once (added once to `into`'s)."""
    sq, sk, T = q.shape[1], k.shape[1], call.block
    acc = torch.promote_types(q.dtype, torch.float32)
    if into is None:
        dq = torch.empty_like(q)  # [B, Sq, h, D]
        dk, dv = (
            torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v)
        )  # [B, Sk, hk, D]
    else:
        dq, dk, dv = into  # float32 [B, Sq, h, D], [B, Sk, hk, D]: summed into
    for i0 in chunk_starts(sq, T, q):
        rows = (i0, min(i0 + T, sq))
        dq_i = None  # [B, T, h, D] in `acc`
        for j0 in chunk_starts(rows[1] if call.causal else sk, T, q):
            dq_t, dk_t, dv_t = call.tile(dout, q, k, v, out, lse, rows, (j0, min(j0 + T, sk)))
            dk[:, j0 : j0 + T] += dk_t
            dv[:, j0 : j0 + T] += dv_t
            dq_i = dq_t.to(acc) if dq_i is None else dq_i.add_(dq_t)
            del dq_t, dk_t, dv_t
        if into is None:
            dq[:, rows[0] : rows[1]] = dq_i
        else:
            dq[:, rows[0] : rows[1]] += dq_i
        del dq_i
    if into is not None:
        return None
    dk = dk.to(k.dtype)  # one cast at a time: the float32 dk goes before dv's cast
    return dq, dk, dv.to(v.dtype)
