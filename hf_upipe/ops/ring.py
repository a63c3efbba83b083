"""Ring attention across R ranks, as an attention kernel: UPipe's head chunks over U ranks, a ring over R.

Entry points:
- `RingKernel(inner, group)`: an `AttentionKernel` (`hf_upipe.ops.kernels`) whose forward and backward run `inner`
  on this ring rank's queries against every ring rank's keys, passing key/value blocks around the ring and merging
  the partial outputs by their log-sum-exps. UPipe's stage loops (the registered op and the fused block) call it
  as they call any kernel, so head chunking applies inside each ring step: one chunk's buffers at a time.
- `zigzag_order(seq_len, ring_size)`: the global token indices in ring order; `ring_positions(sp_rank, s, sp_size,
  ring_size)`: those one SP rank holds (what `hf_upipe.data.shard_batch` gives it, what the layout check expects).

The sequence in ring order (causal load balance). The S tokens are cut into 2R chunks of m = S/(2R); ring rank r
holds chunks r and 2R-1-r, in that order: its ring shard, 2m tokens, which the U ranks of its Ulysses group hold
contiguously, s = 2m/U each. After UPipe's all-to-all a rank holds a head chunk of its ring shard: q [B, 2m, h, D],
k, v [B, 2m, hk, D]. At ring step j it holds the k/v of ring rank o = (r - j) mod R, and one kernel call covers
exactly the causal pairs (every rank does the same work, m x 2m keys, at every step after the first):
- j = 0 (o = r): causal attention over the ring shard itself: chunk r < chunk 2R-1-r, so the zigzag order is causal;
- o < r: all 2m queries against o's first chunk (both of r's chunks come after it), no mask;
- o > r: r's second chunk against all 2m keys of o (chunk 2R-1-r comes after both of o's), no mask.
The partial outputs merge in float32: lse = logaddexp(lse, lse_j), out = out e^(lse_old - lse) + out_j e^(lse_j - lse).

Backward: the kernel's backward of each block pair given the merged output and log-sum-exp is that pair's exact
share of dq, dk, dv (its softmax is the global one). dq accumulates here (float32); each k/v block travels with
a float32 accumulator of its dk/dv, which after R steps is one hop from home and makes that hop alone.

Communication per call and rank: R-1 sends of the k/v block (2 [B, 2m, hk, D]) forward; in backward R-1 sends of
the k/v block and R of its dk/dv accumulators (float32). Each k/v send is issued before the step's kernel and waited
after it (isend/irecv: NCCL overlaps them with the kernel; gloo runs them on its thread): one more k/v block in
flight per step. The accumulators travel after the step's kernel, in `PASS_PIECES` pieces one after another
(`_pass_in_place`), so one piece's receive buffer is in flight, not a second copy of both.

Memory of the backward beyond its inputs: the float32 dq and dk/dv accumulators, the next k/v block and one tile's
kernel backward; each step's backward adds into the accumulators itself (`tiled_backward(..., into=...)`), so no
step holds float32 sums or gradients of its own (with tiles shorter than the step: the tile's; untiled, the
kernel's dq, dk, dv of the step, added and freed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_upipe.ops.kernels import AttentionKernel
from hf_upipe.ops.tiled_backward import tiled_backward

__all__ = ["RingKernel", "ring_positions", "zigzag_order"]


def zigzag_order(seq_len: int, ring_size: int) -> torch.Tensor:
    """Global token indices [S] in ring order: ring rank r's shard is chunks r and 2R-1-r of 2R equal chunks.

    Raises ValueError when S is not a multiple of 2R (the message names the nearest lengths that are)."""
    R = ring_size
    if R == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * R):
        low = seq_len // (2 * R) * 2 * R
        raise ValueError(
            f"A ring of {R} ranks cuts the sequence into {2 * R} equal chunks: {seq_len} tokens is not "
            f"a multiple of {2 * R}; pad or trim to {low} or {low + 2 * R} tokens."
        )
    return torch.cat([ring_positions(r, seq_len // R, R, R) for r in range(R)])


def ring_positions(
    sp_rank: int, local_len: int, sp_size: int, ring_size: int, device=None
) -> torch.Tensor:
    """Global token indices [s] that SP rank r holds: part u = r % U of ring shard j = r // U (U = sp_size / R),
    the shard being chunks j and 2R-1-j of m = U*s/2 tokens; without a ring, r*s .. r*s+s-1. Raises ValueError
    when U*s is odd."""
    s, R = local_len, ring_size
    if R == 1:
        return torch.arange(sp_rank * s, (sp_rank + 1) * s, device=device)
    U = sp_size // R
    if (
        U * s % 2
    ):  # every rank alike (equal shards), before any collective: the layout check computes this first
        raise ValueError(
            f"A ring of {R} cuts the sequence into {2 * R} equal chunks, but {sp_size} shards of {s} "
            f"tokens ({sp_size * s}) are not a multiple of {2 * R}: pad the sequence to a multiple of "
            f"2 x sp_size = {2 * sp_size} (hf_upipe.shard_batch does)."
        )
    j, u = divmod(sp_rank, U)
    m = U * s // 2
    o = u * s + torch.arange(s, device=device)  # offsets in the ring shard [s]
    return torch.where(o < m, j * m + o, (2 * R - 1 - j) * m + o - m)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_j: torch.Tensor) -> None:
    """In place: (out [B, n, h, D], lse [B, h, n]) (fp32 or fp64) <- their log-sum-exp merge with (o, lse_j).
    `o` (the kernel's dtype) is scaled and added in one `addcmul_`: no float32 copy or product of it."""
    new = torch.logaddexp(lse, lse_j.to(lse.dtype))
    out.mul_((lse - new).exp().transpose(1, 2).unsqueeze(-1))
    out.addcmul_(o, (lse_j.to(lse.dtype) - new).exp().transpose(1, 2).unsqueeze(-1))
    lse.copy_(new)


class _Pass:
    """One ring hop in flight: send `tensors` to the next ring rank, receive the same shapes from the previous."""

    def __init__(self, tensors, group, rank: int, size: int):
        nxt = dist.get_global_rank(group, (rank + 1) % size)
        prv = dist.get_global_rank(group, (rank - 1) % size)
        self.received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        self._sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in self._sent]
        ops += [dist.P2POp(dist.irecv, t, prv, group) for t in self.received]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._sent = self._works = None
        return self.received


PASS_PIECES = 8
"""The pieces (along the sequence) each travelling dk/dv accumulator is passed in: one piece's receive buffer is in
flight at a time, an eighth of an accumulator, instead of a second copy of both."""


def _pass_in_place(tensors: list, group, rank: int, size: int, pieces: int = PASS_PIECES) -> None:
    """In place: each of `tensors` [B, n, ...] becomes the previous ring rank's, sent to the next rank and received
    piece by piece along dim 1 (at most `pieces` pieces): the same values as `_Pass(tensors, ...).wait()`, with one
    piece's buffers in flight instead of a copy of every tensor."""
    for t in tensors:
        n = t.shape[1]
        step = -(-n // pieces)
        for a in range(0, n, step):
            piece = t[:, a : a + step]
            (got,) = _Pass([piece], group, rank, size).wait()
            piece.copy_(got)
            del got


class RingKernel:
    """`inner` over a ring of the ranks of `group` (module docstring). q, k, v are this ring rank's shard in ring
    order; `causal` must be True (the ring order is what makes the blocks causal)."""

    def __init__(self, inner: AttentionKernel, group: dist.ProcessGroup):
        self.inner, self.group = inner, group
        self.name = f"ring({inner.name})"
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _blocks(self, j: int, m: int):
        """At step j: (query rows, key rows, causal) of the one kernel call, as slices of the ring shard."""
        owner = (self.rank - j) % self.size
        if j == 0:
            return slice(None), slice(None), True
        if owner < self.rank:
            return slice(None), slice(0, m), False
        return slice(m, None), slice(None), False

    def forward(self, q, k, v, *, scale, causal=True):
        """q [B, 2m, h, D], k/v [B, 2m, hk, D] -> out [B, 2m, h, D] (q's dtype), lse [B, h, 2m] (fp32)."""
        if not causal:
            raise NotImplementedError("ring attention here is causal only")
        m = q.shape[1] // 2
        out = lse = None
        kv = [k, v]
        for j in range(self.size):
            hop = _Pass(kv, self.group, self.rank, self.size) if j + 1 < self.size else None
            rows, cols, mask = self._blocks(j, m)
            o, l_j = self.inner.forward(
                q[:, rows], kv[0][:, cols], kv[1][:, cols], scale=scale, causal=mask
            )
            if out is None:  # step 0 covers every row (each query sees its own key)
                acc = torch.promote_types(
                    q.dtype, torch.float32
                )  # float32, float64 for float64 inputs
                out, lse = o.to(acc), l_j.to(acc).contiguous()
            else:
                _merge(out[:, rows], lse[:, :, rows], o, l_j)
            del o, l_j
            if hop is not None:
                kv = hop.wait()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        """Gradients dq [B, 2m, h, D], dk/dv [B, 2m, hk, D] (inputs' dtypes) of this rank's shard.

        Each step's kernel backward adds its gradients straight into the float32 accumulators (`tiled_backward`'s
        `into`); the dk/dv accumulators travel in pieces (`_pass_in_place`); the casts at the end free each float32
        accumulator before the next is cast."""
        m = q.shape[1] // 2
        acc = torch.promote_types(q.dtype, torch.float32)  # float32, float64 for float64 inputs
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v)]
        for j in range(self.size):
            hop = _Pass(kv, self.group, self.rank, self.size) if j + 1 < self.size else None
            rows, cols, mask = self._blocks(j, m)
            tiled_backward(
                self.inner,
                dout[:, rows],
                q[:, rows],
                kv[0][:, cols],
                kv[1][:, cols],
                out[:, rows],
                lse[:, :, rows].contiguous(),
                scale=scale,
                causal=mask,
                into=(dq[:, rows], dkv[0][:, cols], dkv[1][:, cols]),
            )
            # the accumulators of the block just used go on to the next rank (after the last step: home)
            _pass_in_place(dkv, self.group, self.rank, self.size)
            if hop is not None:
                kv = hop.wait()
        del kv
        dq = dq.to(q.dtype)
        dk = dkv.pop(0).to(k.dtype)
        return dq, dk, dkv.pop(0).to(v.dtype)
