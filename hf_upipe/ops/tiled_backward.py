"""The attention kernel's backward in square tiles, so that its workspace scales with a tile, not the sequence.

Entry points:
- `backward_block()`: the tile length in tokens, `UPIPE_BACKWARD_BLOCK` (default `DEFAULT_BLOCK`, 262144; 0: never
  tile). Read at every call, so the runtime and the planner (`hf_upipe.planning.reserved`,
  `hf_upipe.planning.step_time`) see the same value.
- `tiles(kernel, q, k, causal, block=None) -> bool`: whether `tiled_backward` tiles this call.
- `tiled_backward(kernel, dout, q, k, v, out, lse, *, scale, causal, block=None)`: `kernel.backward` of one call,
  tiled when `tiles` says so, else the kernel's own backward unchanged.

Why it is exact. Given the forward's output and log-sum-exp, a flash backward's softmax of query row r over the keys
of a tile is exp(s_rc - lse_r), and its row term is rowsum(dout_r * out_r): both need only the row's own out and lse,
whatever keys the tile holds (ring attention rests on the same identity, `hf_upipe.ops.ring`). So the backward of
the whole call is the sum over tiles (query rows [i0, i1), keys [j0, j1)) of the tile's backward: dq of the rows
sums over key tiles, dk/dv of the keys over query tiles. With causal attention (the top-left alignment of every
kernel here, on a square call) tiles above the diagonal see nothing and are skipped, tiles below it are full
(`causal=False`), and a diagonal tile is itself a square causal call (i0 == j0). Every kernel call is therefore one
of the two kinds the kernels already serve, and no call is longer than one tile.

Loop and memory: keys outer, queries inner. dq is accumulated over key tiles in a [B, S, h, D] buffer of float32
(q's dtype when that is float32 or float64), cast to q's dtype at the end; each key tile's dk/dv are accumulated
over its query tiles in [B, T, hk, D] float32 buffers and written into dk/dv [B, S, hk, D] (k's dtype). These are
ordinary tensors, so the memory tracker and the planner's simulation see them; the kernel's own workspace (the
flash backward's dq accumulator and the like) is that of a call of T tokens. Loops over fake tensors run the first
three and the last two tiles of each loop (`hf_upipe.ops.fake.chunk_starts`: every tile allocates the same).

Which calls are tiled: those of the plain registered kernels ("sdpa" on CPU and CUDA, "cudnn", "flash_attn", and
their hollow twins), longer than one tile, square when causal. Wrapped kernels (documents, windows, soft-capping,
chunked attention) are called as they are: their own loops bound their calls differently. The ring calls its inner
kernel through this function, so each ring step is tiled. `CudnnKernel` chooses its fallback kernel by the call's
length: a tiled call uses the kernel that the untiled call of the whole length would (`tile_kernel`), so the
log-sum-exp handed back is the one the forward computed with the same kernel.

Cost: (n^2 + n) / 2 kernel calls for n = ceil(S / T) tiles (causal), the same arithmetic as one call, plus the
accumulators' reads and writes (`hf_upipe.planning.step_time` charges them).
"""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernel.backward(dout, q, k, v, out, lse)` (layouts of `hf_upipe.ops.kernels`), in tiles of `block` tokens
    (default `backward_block()`) when `tiles` says so: dq [B, Sq, h, D], dk/dv [B, Sk, hk, D] in the inputs'
    dtypes."""
    block = backward_block() if block is None else block
    if not tiles(kernel, q, k, causal, block):
        return kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    kernel = getattr(kernel, "tile_kernel", lambda _q: kernel)(q)
    sq, sk = q.shape[1], k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, float64 for float64 inputs
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [B, Sq, h, D]
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # [B, Sk, hk, D]
    for j0 in chunk_starts(sk, block, q):
        j1 = min(j0 + block, sk)
        first = j0 if causal else 0  # causal: the query tiles at and below the diagonal
        dk_j = dv_j = None  # [B, j1 - j0, hk, D] in `acc`
        for i0 in [first + i for i in chunk_starts(sq - first, block, q)]:
            i1 = min(i0 + block, sq)
            dq_t, dk_t, dv_t = kernel.backward(
                dout[:, i0:i1],
                q[:, i0:i1],
                k[:, j0:j1],
                v[:, j0:j1],
                out[:, i0:i1],
                lse[:, :, i0:i1].contiguous(),
                scale=scale,
                causal=causal and i0 == j0,
            )
            dq[:, i0:i1] += dq_t
            if dk_j is None:
                dk_j, dv_j = dk_t.to(acc), dv_t.to(acc)
            else:
                dk_j += dk_t
                dv_j += dv_t
            del dq_t, dk_t, dv_t
        dk[:, j0:j1] = dk_j
        dv[:, j0:j1] = dv_j
        del dk_j, dv_j
    return dq.to(q.dtype), dk, dv
