"""Tiled lm_head + cross-entropy: the loss of a sequence shard without ever holding its full logits.

Entry points:
- `tiled_cross_entropy(hidden, weight, shift_labels, *, bias, chunk_tokens, ignore_index, logit_softcap,
  token_stats)`: the public op, returning (loss_sum, n_tokens) for this rank's shard; with a `TokenStats`, also
  the summed entropy and the correct next-token predictions of its label tokens, from the same tiles.
- `sp_token_mean(loss_sum, n_tokens, group)`: the token-weighted mean over the ranks of a sequence-parallel group
  (`hf_upipe.ops.reduce`, re-exported here).
- `TiledCrossEntropyFunction`: the autograd Function (ctx handling only).
- `tiled_cross_entropy_forward(...)`: the plain chunk loop. `default_chunk_tokens(vocab_size)`: the default tile.

Legend: B batch, s local tokens, T = B*s, Dm model (hidden) width, V vocabulary, c tokens per chunk.

The flow ("backward inside forward"), per chunk of c consecutive tokens of the flattened shard:
1. logits = hidden_c @ weight.T (+ bias) in the input dtype, then fp32          [c, V] (as the plain HF path)
2. optional soft-capping: logits = cap * tanh(logits / cap)
3. loss_c = sum over label rows of logsumexp(logits) - logits[label]
4. in the same pass, the gradient of loss_c w.r.t. the logits, in place: softmax - one_hot(label), zero rows for
   ignored tokens                                                               [c, V]
5. d hidden_c = grad @ weight and the chunk's d weight partial grad.T @ hidden_c, both GEMMs in the input dtype as
   in the plain path (fp32 accumulation inside the GEMM); d hidden_c is written into a [T, Dm] buffer, the d weight
   partial (rounded once) and grad.sum(0) are summed over chunks in fp32 accumulators.
The chunk's logits die before the next chunk. The autograd backward only multiplies the saved gradients by the
incoming gradient of loss_sum (rounding 16-bit results once, in fp32): nothing is recomputed, no logits are saved.

Memory: peak = d hidden (1 x hidden, input dtype) + d weight (fp32 accumulator: 2 x a bf16 lm_head; with 16-bit
weights plus one 16-bit [V, Dm] buffer for the chunk partial, reused for the result in backward) + one chunk of
fp32 logits, which becomes its softmax in place (plus its 16-bit copy for bf16/fp16 GEMMs; a second fp32 chunk
with soft-capping). The plain path holds T x V logits several times (16-bit, fp32, log-softmax, its gradient).
Cost: the plain path's three GEMMs (logits, d hidden, d weight) over c-token chunks, plus one elementwise pass over
the [V, Dm] accumulator per chunk (16-bit weights): larger chunks amortise it. Frozen inputs skip their GEMM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hf_upipe.ops.fake import chunk_starts
from hf_upipe.ops.reduce import sp_token_mean

__all__ = [
    "TiledCrossEntropyFunction",
    "TokenStats",
    "default_chunk_tokens",
    "sp_token_mean",
    "tiled_cross_entropy",
    "tiled_cross_entropy_forward",
]

_CHUNK_LOGITS_BYTES = 256 * 2**20  # default budget for one chunk of fp32 logits
_BLOCK_BYTES = (
    32 * 2**20
)  # row blocks for mixed-dtype elementwise passes over [V, Dm] / [T, Dm] tensors


def default_chunk_tokens(vocab_size: int, logits_bytes: int = _CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk so that one chunk of fp32 logits [c, V] takes about `logits_bytes` (rounded up, >= 1)."""
    return max(1, math.ceil(logits_bytes / (4 * vocab_size)))


class TokenStats:
    """Side output of the tiled loss: over the label tokens seen, the summed entropy of the next-token distribution
    and the number of labels that are its argmax (first maximum, as `torch.argmax`): what TRL logs as `entropy` and
    `mean_token_accuracy` once divided by the label tokens. Float64 scalars on `device`, added to by every call."""

    def __init__(self, device=None):
        self.entropy_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.float64, device=device)

    def _add(self, logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> None:
        """Count the argmax hits of a chunk's logits [c, V] (before they are overwritten)."""
        hit = (logits.argmax(dim=1) == labels) & valid  # [c]
        self.correct += hit.sum()

    def _add_entropy(self, probs: torch.Tensor, denom: torch.Tensor, valid: torch.Tensor) -> None:
        """Entropy of rows of unnormalised probabilities probs [c, V] = exp(z - max), denom [c, 1]:
        H = log(denom) - sum(probs * log(probs)) / denom, by row blocks of about 32 MiB (no [c, V] temporary)."""
        c, V = probs.shape
        rows = max(1, _BLOCK_BYTES // (V * probs.element_size()))
        plogp = torch.empty(c, dtype=probs.dtype, device=probs.device)  # [c]
        for start in range(0, c, rows):
            block = probs[start : start + rows]  # [r, V] view
            plogp[start : start + rows] = torch.special.xlogy(block, block).sum(dim=1)
        entropy = denom.squeeze(1).log() - plogp / denom.squeeze(1)  # [c]
        self.entropy_sum += torch.where(valid, entropy, 0.0).sum().to(torch.float64)


def _chunk_loss_and_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    want_grad: bool,
    wide: torch.dtype,
    stats: TokenStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed CE of one chunk, x [c, Dm], labels [c]; with `want_grad`, also d loss / d logits [c, V] in `wide`;
    with `stats`, adds the chunk's entropy and argmax hits to it (the loss and gradient are unchanged)."""
    # [c, V] fp32 (no copy for fp32 inputs: fp64 stays fp64)
    logits = F.linear(x, weight, bias).to(wide)
    valid = labels != ignore_index  # [c]
    target = torch.where(valid, labels, 0).long().unsqueeze(1)  # [c, 1], ignored rows: class 0
    tanh = None
    if softcap is not None:
        tanh = logits.div_(softcap).tanh_()  # [c, V], kept for the chain rule
        logits = tanh * softcap  # [c, V]
    if stats is not None:
        stats._add(logits, labels, valid)
    picked = logits.gather(1, target).squeeze(1)  # [c]
    row_max = logits.amax(dim=1, keepdim=True)  # [c, 1]
    probs = logits.sub_(row_max).exp_()  # [c, V], unnormalised, in place
    denom = probs.sum(dim=1, keepdim=True)  # [c, 1]
    lse = (row_max + denom.log()).squeeze(1)  # [c]
    loss = torch.where(valid, lse - picked, 0.0).sum()  # scalar; where, not *, so no inf * 0
    if stats is not None:
        stats._add_entropy(probs, denom, valid)
    if not want_grad:
        return loss, None
    grad = probs.div_(denom)  # [c, V] softmax
    grad.mul_(valid.unsqueeze(1))  # ignored rows contribute nothing
    # - one_hot(label) on label rows
    grad.scatter_add_(1, target, valid.unsqueeze(1).to(grad.dtype).neg())
    if tanh is not None:
        grad.mul_(tanh.square_().neg_().add_(1.0))  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
    return loss, grad


def tiled_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shift_labels: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int,
    logit_softcap: float | None,
    needs_grad: tuple[bool, bool, bool],
    stats: TokenStats | None = None,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """Chunk loop: loss and gradients of the summed CE in one pass (no autograd).

    Args:
        hidden: [B, s, Dm]. weight: [V, Dm]. bias: [V] or None. shift_labels: [B, s] integer.
        chunk_tokens: c >= 1. ignore_index: label value that is skipped. logit_softcap: cap > 0 or None.
        needs_grad: whether to build the gradient of (hidden, weight, bias).
        stats: a `TokenStats` to add the shard's entropy and argmax hits to, or None.

    Returns:
        loss_sum (fp32 scalar), n_tokens (int64 scalar), d hidden [B, s, Dm] (hidden dtype), d weight [V, Dm] and
        d bias [V] (fp32), each None where not needed; and the [V, Dm] 16-bit chunk-partial buffer (None unless the
        weight is 16-bit and trainable), which backward reuses for the scaled weight gradient.
    """
    B, s, Dm = hidden.shape
    x = hidden.reshape(B * s, Dm)  # [T, Dm] (a copy only if hidden is not contiguous)
    labels = shift_labels.reshape(B * s)  # [T]
    need_x, need_w, need_b = needs_grad[0], needs_grad[1], needs_grad[2] and bias is not None
    want_grad = need_x or need_w or need_b
    wide = torch.promote_types(hidden.dtype, torch.float32)  # loss math, accumulators: fp32 (fp64)
    grad_x, grad_w, grad_b, partial = _grad_buffers(x, weight, bias, need_x, need_w, need_b, wide)
    loss_sum = torch.zeros((), dtype=wide, device=hidden.device)
    for start in chunk_starts(B * s, chunk_tokens, x):
        x_c = x[start : start + chunk_tokens]  # [c, Dm] view
        labels_c = labels[start : start + chunk_tokens]  # [c] view
        loss_c, grad = _chunk_loss_and_grad(
            x_c, weight, bias, labels_c, ignore_index, logit_softcap, want_grad, wide, stats
        )
        loss_sum += loss_c
        if grad is None:
            continue
        if grad_b is not None:
            grad_b += grad.sum(dim=0)  # [V]
        # [c, V], 16-bit for bf16/fp16 GEMMs as in the plain path (else no copy)
        grad_in = grad.to(weight.dtype)
        del grad
        _chunk_gemms(grad_in, x_c, weight, start, grad_x, grad_w, partial)
        del grad_in
    if grad_w is not None and B * s == 0:
        grad_w.zero_()  # no chunk ran
    n_tokens = (labels != ignore_index).sum()  # int64 scalar
    grad_x = None if grad_x is None else grad_x.view(B, s, Dm)  # [B, s, Dm]
    return loss_sum, n_tokens, grad_x, grad_w, grad_b, partial


def _grad_buffers(x, weight, bias, need_x: bool, need_w: bool, need_b: bool, wide: torch.dtype):
    """The chunk loop's gradient buffers, each None where not needed: d hidden [T, Dm] (every row written by a
    chunk), d weight [V, Dm] in `wide` (set by chunk 0), d bias [V] in `wide` (zeros), and the [V, Dm] chunk-partial
    buffer in the weight's dtype (only for a trainable weight narrower than `wide`), reused by every chunk."""
    grad_x = torch.empty_like(x) if need_x else None  # [T, Dm]
    grad_w = torch.empty(weight.shape, dtype=wide, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=wide, device=bias.device) if need_b else None  # [V]
    partial = torch.empty_like(weight) if need_w and weight.dtype != wide else None  # [V, Dm]
    return grad_x, grad_w, grad_b, partial


def _chunk_gemms(grad_in, x_c, weight, start: int, grad_x, grad_w, partial) -> None:
    """A chunk's GEMMs from grad_in [c, V] and x_c [c, Dm]: its rows of d hidden, its d weight partial summed."""
    if grad_x is not None:
        torch.mm(grad_in, weight, out=grad_x[start : start + x_c.shape[0]])  # [c, V] @ [V, Dm]
    if partial is None and grad_w is not None:
        # [V, c] @ [c, Dm]; chunk 0 overwrites
        grad_w.addmm_(grad_in.t(), x_c, beta=1 if start else 0)
    elif partial is not None:
        # [V, Dm] chunk partial, rounded once, summed in fp32
        torch.mm(grad_in.t(), x_c, out=partial)
        _blockwise(grad_w, partial, add=True) if start else grad_w.copy_(partial)


def _blockwise(
    dst: torch.Tensor, src: torch.Tensor, *, scale: torch.Tensor | None = None, add: bool = False
) -> None:
    """dst = src * scale, or dst += src, by ~32 MiB row blocks through one buffer in fp32 (or wider).

    Avoids a full-size fp32 temporary (2 x a bf16 weight) and mixed-dtype elementwise kernels (slow on CPU).
    """
    last = dst.shape[-1]
    dst2, src2 = dst.view(-1, last), src.view(-1, last)  # [rows, last]
    wide = torch.promote_types(torch.promote_types(dst.dtype, src.dtype), torch.float32)
    rows = max(1, min(dst2.shape[0], _BLOCK_BYTES // (last * wide.itemsize)))
    buf = torch.empty(rows, last, dtype=wide, device=dst.device)  # [rows, last]
    for start in chunk_starts(dst2.shape[0], rows, dst2):
        n = min(rows, dst2.shape[0] - start)
        block = buf[:n].copy_(src2[start : start + n])  # [n, last]
        if scale is not None:
            block.mul_(scale)
        dst2[start : start + n].add_(block) if add else dst2[start : start + n].copy_(block)


def _scaled(
    saved: torch.Tensor | None,
    scale: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
):
    """saved * scale in `dtype`, multiplied in fp32 (or wider) and rounded once; into `out` if given."""
    if saved is None:
        return None
    if saved.dtype == dtype == torch.promote_types(dtype, torch.float32):
        return saved * scale.to(dtype)
    out = torch.empty(saved.shape, dtype=dtype, device=saved.device) if out is None else out
    _blockwise(out, saved, scale=scale)
    return out


class TiledCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of `tiled_cross_entropy_forward`: saves gradients, not logits; nothing recomputed.

    Saved between forward and backward: d hidden [B, s, Dm] (hidden dtype), d weight [V, Dm] and d bias [V] (fp32),
    and for 16-bit weights the forward's [V, Dm] partial buffer, which receives the scaled weight gradient (no new
    allocation). Backward costs one elementwise pass over them.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        shift_labels,
        chunk_tokens,
        ignore_index,
        logit_softcap,
        needs_grad,
        stats=None,
    ):
        loss_sum, n_tokens, grad_x, grad_w, grad_b, spare = tiled_cross_entropy_forward(
            hidden,
            weight,
            bias,
            shift_labels,
            chunk_tokens,
            ignore_index,
            logit_softcap,
            needs_grad,
            stats,
        )
        ctx.save_for_backward(grad_x, grad_w, grad_b, spare)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(n_tokens)
        return loss_sum, n_tokens

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_n):
        grad_x, grad_w, grad_b, spare = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        return (
            _scaled(grad_x, grad_loss, dx),
            _scaled(grad_w, grad_loss, dw, out=spare),
            _scaled(grad_b, grad_loss, db),
        ) + (None,) * 6  # no gradient for the labels and the options


def _check_inputs(hidden, weight, shift_labels, bias, chunk_tokens, logit_softcap) -> int:
    """Raise ValueError (the numbers and the fix) on inputs `tiled_cross_entropy` does not take; returns the
    tokens per chunk (`default_chunk_tokens(V)` for None)."""
    if hidden.dim() != 3:
        raise ValueError(
            f"hidden must be [B, s, Dm], got shape {tuple(hidden.shape)}; reshape it to 3 dims"
        )
    B, s, Dm = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != Dm:
        raise ValueError(
            f"weight must be [V, Dm={Dm}] (lm_head.weight), got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast hidden to the lm_head dtype"
        )
    if tuple(shift_labels.shape) != (B, s):
        raise ValueError(
            f"shift_labels must be [B, s] = [{B}, {s}] like hidden, got {tuple(shift_labels.shape)}"
        )
    if shift_labels.is_floating_point() or shift_labels.is_complex():
        raise ValueError(
            f"shift_labels must be integer class ids, got {shift_labels.dtype}; use .long()"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be >= 1, got {chunk_tokens}; pass None for the default"
        )
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
    return chunk_tokens


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    logit_softcap: float | None = None,
    token_stats: TokenStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed causal-LM cross-entropy of a shard, lm_head fused in, computed chunk by chunk.

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, 1), shift_labels.flatten(),
    reduction="sum", ignore_index=ignore_index)`` and its gradients, up to fp32 rounding, for any chunking.

    Args:
        hidden: final-norm output of this rank's shard, [B, s, Dm].
        weight: lm_head weight [V, Dm], same dtype as hidden. Frozen (requires_grad False) skips its gradient;
            tied to the input embedding, its gradient simply adds to the embedding's.
        shift_labels: [B, s] integer labels already shifted over the whole sequence.
        bias: optional lm_head bias [V].
        chunk_tokens: tokens per chunk; default `default_chunk_tokens(V)` (about 256 MiB of fp32 logits).
        ignore_index: label value that does not count (default -100).
        logit_softcap: if set, logits = cap * tanh(logits / cap) before the softmax (Gemma-2 style), in fp32.
        token_stats: a `TokenStats` that receives the entropy and argmax hits of the label tokens, computed from
            the same chunks of logits (one argmax and one blockwise x log x pass per chunk; the loss and gradients
            are bit-identical with or without it).

    Returns:
        (loss_sum, n_tokens): fp32 scalar sum of the loss over label tokens (differentiable) and the int64 scalar
        number of label tokens. A shard without label tokens gives 0 and 0, with zero gradients.

    Raises:
        ValueError: on shapes, dtypes or options that do not fit, with the numbers and the fix.
    """
    chunk_tokens = _check_inputs(hidden, weight, shift_labels, bias, chunk_tokens, logit_softcap)
    grad_on = torch.is_grad_enabled()
    needs_grad = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    return TiledCrossEntropyFunction.apply(
        hidden,
        weight,
        bias,
        shift_labels,
        int(chunk_tokens),
        ignore_index,
        logit_softcap,
        needs_grad,
        token_stats,
    )
