"""Packed rows (several documents per row): causal attention inside each document, behind the kernel interface.

Entry points:
- `DocumentKernel(inner, cu_seqlens, seq_len, max_seqlen=None)`: an `hf_upipe.ops.kernels.AttentionKernel` that
  runs `inner` once per document, so each query sees only the earlier keys of its own document. UPipe's stage
  loops (`upipe_attention`, `fused_upipe_attention`) take it like any kernel: they hand it the full sequence of a
  head chunk, q [B, S, c, D], which is exactly where the documents are known.
- `document_segments(cu_seqlens, batch, seq_len)`: the documents as (row, start, end) triples, validated.

Documents are given flash-attn's varlen way: `cu_seqlens` int32 [N + 1], cumulative boundaries over the batch
flattened as [B * S]: 0 = cu[0] < cu[1] < ... < cu[N] = B * S, and every row start b * S is a boundary (a document
never crosses rows). `hf_upipe.shard_batch` emits it as `upipe_cu_seqlens` (the padding tail of a row belongs to
its last document).

Two paths, same results:
- native: when `inner` has `forward_varlen` / `backward_varlen` (FlashAttnKernel: flash-attn's varlen kernels),
  one call on the flattened tokens [B * S, h, D], lse [h, B * S];
- loop: otherwise, one `inner.forward` / `inner.backward` call per document on the slices q[b:b+1, a:e] etc.,
  written into preallocated outputs. Rows holding one document are not split (a batch of such rows is one call).
  Cost: one kernel launch per document, no [S, S] mask and no extra memory beyond the outputs. A document longer
  than a tile runs its backward in tiles (`hf_upipe.ops.tiled_backward`, with its float32 accumulator).
"""

from __future__ import annotations

import torch

from hf_upipe.ops.kernels import AttentionKernel
from hf_upipe.ops.tiled_backward import tiled_backward

__all__ = ["DocumentKernel", "cu_seqlens_error", "document_segments", "left_padded_rows"]


def cu_seqlens_error(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> str | None:
    """Why `cu_seqlens` is not a valid description of documents over a flattened [batch * seq_len] batch (1-D,
    strictly increasing from 0 to batch*seq_len, a boundary at every row start), or None when it is valid. The one
    validator of document boundaries: `shard_batch`, the attention's layout check and `DocumentKernel` use it."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        return f"must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}"
    cu = cu_seqlens.long()
    total = batch * seq_len
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] <= cu[:-1]).any()):
        shown = cu.tolist()[:8]
        return (
            f"must increase strictly from 0 to B*S = {batch}*{seq_len} = {total}; got {shown}"
            f"{' ...' if cu.numel() > 8 else ''} (ending at {int(cu[-1])})"
        )
    if not bool(torch.isin(torch.arange(batch, device=cu.device) * seq_len, cu).all()):
        return (
            f"has a document crossing a row boundary (every multiple of S={seq_len} must be a boundary): "
            "documents of a packed batch never span rows"
        )
    return None


def left_padded_rows(mask: torch.Tensor) -> list[int]:
    """Rows of a [B, S] padding mask (1 = real token) that are not ones-then-zeros (left or interior padding): the
    one right-padding validator, used by `shard_batch` and the attention's layout check. Empty when all are."""
    m = mask.long()
    return torch.nonzero((m.cummin(dim=-1).values != m).any(dim=-1)).flatten().tolist()


def document_segments(
    cu_seqlens: torch.Tensor, batch: int, seq_len: int
) -> list[tuple[int, int, int]]:
    """(b, a, e) per document: row b, tokens [a, e) of that row; rows in order, documents in order.

    Raises:
        ValueError: cu_seqlens that is not 1-D, not 0 ... B*S, not strictly increasing, or has a document
            crossing a row boundary (`cu_seqlens_error`).
    """
    error = cu_seqlens_error(cu_seqlens, batch, seq_len)
    if error is not None:
        raise ValueError(f"cu_seqlens {error}.")
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(a // seq_len, a % seq_len, a % seq_len + (e - a)) for a, e in zip(cu, cu[1:])]


class DocumentKernel:
    """Causal attention inside documents: wraps an `AttentionKernel` (see the module docstring).

    Args:
        inner: the kernel doing the attention of one document (or of all of them, natively).
        cu_seqlens: int32 [N + 1] boundaries over the flattened [B * S] batch (any device; moved to q's).
        seq_len: S, the full (padded) sequence length the kernel is called with.
        max_seqlen: longest document, for the native path (computed from cu_seqlens when None).
    """

    def __init__(
        self,
        inner: AttentionKernel,
        cu_seqlens: torch.Tensor,
        seq_len: int,
        max_seqlen: int | None = None,
    ):
        self.inner = inner
        self.name = f"documents({getattr(inner, 'name', type(inner).__name__)})"
        self.cu_seqlens = cu_seqlens
        self.seq_len = int(seq_len)
        self.max_seqlen = None if max_seqlen is None else int(max_seqlen)
        self.native = callable(getattr(inner, "forward_varlen", None)) and callable(
            getattr(inner, "backward_varlen", None)
        )
        self._segments: list[tuple[int, int, int]] | None = None
        self._cu_on: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------------------------------- helpers
    def _check_shape(self, q: torch.Tensor) -> None:
        if q.shape[1] != self.seq_len:
            raise ValueError(
                f"DocumentKernel built for sequences of {self.seq_len} tokens, called with {q.shape[1]}."
            )

    def segments(self, batch: int) -> list[tuple[int, int, int]]:
        """The documents as (b, a, e), computed once (one device sync) and validated."""
        if self._segments is None:
            self._segments = document_segments(self.cu_seqlens, batch, self.seq_len)
        return self._segments

    def _cu(self, device: torch.device) -> torch.Tensor:
        if device not in self._cu_on:
            self._cu_on[device] = self.cu_seqlens.to(
                device=device, dtype=torch.int32, non_blocking=True
            ).contiguous()
        return self._cu_on[device]

    def _max_seqlen(self) -> int:
        if self.max_seqlen is None:
            self.max_seqlen = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return self.max_seqlen

    # ------------------------------------------------------------------------------------------- interface
    def forward(self, q, k, v, *, scale, causal=True):
        """q [B, S, h, D], k/v [B, S, hk, D] -> out [B, S, h, D], lse [B, h, S]; attention inside documents."""
        self._check_shape(q)
        B, S, h, D = q.shape
        if self.native:
            T = B * S
            out, lse = self.inner.forward_varlen(
                q.reshape(T, h, D),
                k.reshape(T, k.shape[2], D),
                v.reshape(T, v.shape[2], v.shape[3]),  # [T, *, D]
                self._cu(q.device),
                self._max_seqlen(),
                scale=scale,
                causal=causal,
            )  # [T, h, D], [h, T]
            return out.view(B, S, h, -1), lse.view(h, B, S).transpose(
                0, 1
            )  # [B, S, h, D], [B, h, S] (a view)
        segs = self.segments(B)
        if len(segs) == B:  # one document per row: plain attention on the whole batch
            return self.inner.forward(q, k, v, scale=scale, causal=causal)
        out = q.new_empty(B, S, h, v.shape[-1])  # [B, S, h, D]
        lse = None
        for b, a, e in segs:
            o, m = self.inner.forward(
                q[b : b + 1, a:e], k[b : b + 1, a:e], v[b : b + 1, a:e], scale=scale, causal=causal
            )  # [1, e-a, h, D], [1, h, e-a]
            if lse is None:
                lse = torch.empty(B, h, S, dtype=m.dtype, device=m.device)  # [B, h, S]
            out[b : b + 1, a:e] = o
            lse[b : b + 1, :, a:e] = m
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        """Gradients dq [B, S, h, D], dk/dv [B, S, hk, D] of `forward` (documents tile the batch: every slot is
        written exactly once)."""
        self._check_shape(q)
        B, S, h, D = q.shape
        if self.native:
            T = B * S
            hk = k.shape[2]
            dq, dk, dv = self.inner.backward_varlen(
                dout.reshape(T, h, -1),
                q.reshape(T, h, D),
                k.reshape(T, hk, D),
                v.reshape(T, hk, v.shape[3]),
                out.reshape(T, h, -1),
                lse.transpose(0, 1).reshape(h, T),  # [T, *, D] ..., lse [h, T]
                self._cu(q.device),
                self._max_seqlen(),
                scale=scale,
                causal=causal,
            )
            return dq.view(B, S, h, D), dk.view(B, S, hk, D), dv.view(B, S, hk, -1)
        segs = self.segments(B)
        if len(segs) == B:
            return tiled_backward(self.inner, dout, q, k, v, out, lse, scale=scale, causal=causal)
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous
        for b, a, e in segs:
            g = tiled_backward(  # a long document's backward in tiles (hf_upipe.ops.tiled_backward)
                self.inner,
                dout[b : b + 1, a:e],
                q[b : b + 1, a:e],
                k[b : b + 1, a:e],
                v[b : b + 1, a:e],
                out[b : b + 1, a:e],
                lse[b : b + 1, :, a:e].contiguous(),
                scale=scale,
                causal=causal,
            )  # [1, e-a, h|hk, D] each
            dq[b : b + 1, a:e], dk[b : b + 1, a:e], dv[b : b + 1, a:e] = g
        return dq, dk, dv
