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
1. z = hidden_c @ weight.T (+ bias) in the input dtype                                    [c, V] (as the plain HF path)
2. the row max of z, then p = exp(z - max) in fp32 (shift and cast in one kernel for 16-bit z), denom = sum(p);
   loss_c = sum over label rows of max + log(denom) - z[label]. With soft-capping (z -> cap * tanh(z / cap)) the
   logits are cast to fp32 first and capped there.
3. the gradient of loss_c w.r.t. the logits, softmax - one_hot(label), rounded once to the input dtype and written
   into z's storage                                                                                 [c, V]
4. rows of ignored labels are zeroed on the thin side: d hidden_c = (grad @ weight) * keep, and the weight's
   gradient takes grad.T @ (hidden_c * keep) [c, Dm], so no pass over [c, V] does it.
5. d weight: summed over chunks in fp32 INSIDE the GEMM on CUDA (cuBLAS, fp32 output, beta = 1: no [V, Dm]
   partial, no separate accumulator pass); elsewhere by ~32 MiB row blocks (`_accumulate_weight_grad`).
The chunk's logits die before the next chunk. The autograd backward only multiplies the saved gradients by the
incoming gradient of loss_sum (rounding 16-bit results once, in fp32): nothing is recomputed, no logits are saved.

Memory: peak = d hidden (1 x hidden, input dtype) + d weight (fp32 accumulator: 2 x a bf16 lm_head) + one chunk:
its 16-bit logits and their fp32 exponentials (a second fp32 chunk with soft-capping); in backward the result
d weight in the weight's dtype beside the accumulator. The plain path holds T x V logits several times (16-bit,
fp32, log-softmax, its gradient).
Cost (16-bit, CUDA): the plain path's three GEMMs over c-token chunks, plus per element of a chunk's [c, V] about
26 bytes of elementwise traffic (the plain path: about 38 per element of [T, V]), plus the fp32 accumulator's
8 bytes per weight element per chunk inside the dW GEMM, hidden under its math once c >= ~1100 tokens on an H100:
hence the default chunk of 512 MiB of fp32 logits, rounded to 128 tokens (`benchmarks/tiled_loss_roofline.py`).
Frozen inputs skip their GEMM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hf_upipe.ops.fake import chunk_starts, is_fake
from hf_upipe.ops.reduce import sp_token_mean

__all__ = [
    "TiledCrossEntropyFunction",
    "TokenStats",
    "default_chunk_tokens",
    "sp_token_mean",
    "tiled_cross_entropy",
    "tiled_cross_entropy_forward",
]

_CHUNK_LOGITS_BYTES = 512 * 2**20  # default budget for one chunk of fp32 logits
_BLOCK_BYTES = (
    32 * 2**20
)  # row blocks for mixed-dtype elementwise passes over [V, Dm] / [T, Dm] tensors


def default_chunk_tokens(vocab_size: int, logits_bytes: int = _CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk so that one chunk of fp32 logits [c, V] takes about `logits_bytes`: rounded down to a
    multiple of 128 tokens when that is at least 128 (whole GEMM tiles), else rounded up (>= 1)."""
    c = max(1, math.ceil(logits_bytes / (4 * vocab_size)))
    return c // 128 * 128 if c >= 128 else c


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
    """Summed CE of one chunk, x [c, Dm], labels [c]; with `want_grad`, also d loss / d logits [c, V] in the
    weight's dtype (what the GEMMs take), its rows of ignored labels NOT zeroed (the caller masks them on the
    [c, Dm] side); with `stats`, adds the chunk's entropy and argmax hits to it (the loss and gradient are
    unchanged)."""
    z = F.linear(x, weight, bias)  # [c, V] in the weight's dtype
    valid = labels != ignore_index  # [c]
    target = torch.where(valid, labels, 0).long().unsqueeze(1)  # [c, 1], ignored rows: class 0
    if softcap is not None:
        return _softcap_chunk(z, target, valid, softcap, want_grad, wide, labels, stats)
    if stats is not None:
        stats._add(z, labels, valid)  # argmax of 16-bit logits = argmax of their exact fp32 values
    picked = z.gather(1, target).squeeze(1).to(wide)  # [c]
    row_max = z.amax(dim=1, keepdim=True).to(wide)  # [c, 1], exact: the max of the 16-bit values
    # [c, V] in `wide`: shift and cast in one kernel (16-bit z), in place for a wide z
    probs = z.sub_(row_max) if z.dtype == wide else torch.sub(z, row_max)
    probs.exp_()  # unnormalised, in place
    denom = probs.sum(dim=1, keepdim=True)  # [c, 1]
    lse = (row_max + denom.log()).squeeze(1)  # [c]
    loss = torch.where(valid, lse - picked, 0.0).sum()  # scalar; where, not *, so no inf * 0
    if stats is not None:
        stats._add_entropy(probs, denom, valid)
    if not want_grad:
        return loss, None
    # d loss / d logits = softmax - one_hot(label), rounded once to the GEMM dtype
    at_label = probs.gather(1, target).div_(denom).sub_(1.0)  # [c, 1] in `wide`
    grad = probs.div_(denom) if z.dtype == wide else torch.div(probs, denom, out=z)  # [c, V]
    del probs
    grad.scatter_(1, target, at_label.to(grad.dtype))
    return loss, grad


def _softcap_chunk(z, target, valid, softcap: float, want_grad: bool, wide, labels, stats):
    """`_chunk_loss_and_grad` with soft-capping: logits = cap * tanh(z / cap), all in `wide`, then the gradient
    (chain rule through the cap) rounded to z's dtype. One more [c, V] `wide` tensor than without the cap."""
    gemm_dtype = z.dtype
    tanh = z.to(wide).div_(softcap).tanh_()  # [c, V], kept for the chain rule
    del z
    logits = tanh * softcap  # [c, V]
    if stats is not None:
        stats._add(logits, labels, valid)
    picked = logits.gather(1, target).squeeze(1)  # [c]
    row_max = logits.amax(dim=1, keepdim=True)  # [c, 1]
    probs = logits.sub_(row_max).exp_()  # [c, V], unnormalised, in place
    denom = probs.sum(dim=1, keepdim=True)  # [c, 1]
    lse = (row_max + denom.log()).squeeze(1)  # [c]
    loss = torch.where(valid, lse - picked, 0.0).sum()
    if stats is not None:
        stats._add_entropy(probs, denom, valid)
    if not want_grad:
        return loss, None
    grad = probs.div_(denom)  # [c, V] softmax
    grad.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=grad.dtype))
    grad.mul_(tanh.square_().neg_().add_(1.0))  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
    return loss, grad.to(gemm_dtype)


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
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]:
    """Chunk loop: loss and gradients of the summed CE in one pass (no autograd).

    Args:
        hidden: [B, s, Dm]. weight: [V, Dm]. bias: [V] or None. shift_labels: [B, s] integer.
        chunk_tokens: c >= 1. ignore_index: label value that is skipped. logit_softcap: cap > 0 or None.
        needs_grad: whether to build the gradient of (hidden, weight, bias).
        stats: a `TokenStats` to add the shard's entropy and argmax hits to, or None.

    Returns:
        loss_sum (fp32 scalar), n_tokens (int64 scalar), d hidden [B, s, Dm] (hidden dtype), d weight [V, Dm] and
        d bias [V] (fp32), each None where not needed.
    """
    B, s, Dm = hidden.shape
    x = hidden.reshape(B * s, Dm)  # [T, Dm] (a copy only if hidden is not contiguous)
    labels = shift_labels.reshape(B * s)  # [T]
    need_x, need_w, need_b = needs_grad[0], needs_grad[1], needs_grad[2] and bias is not None
    want_grad = need_x or need_w or need_b
    wide = torch.promote_types(hidden.dtype, torch.float32)  # loss math, accumulators: fp32 (fp64)
    grad_x = torch.empty_like(x) if need_x else None  # [T, Dm], every row written by a chunk
    grad_w = (
        torch.empty(weight.shape, dtype=wide, device=weight.device) if need_w else None
    )  # chunk 0 sets it
    grad_b = torch.zeros(bias.shape, dtype=wide, device=bias.device) if need_b else None  # [V]
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
        keep = (labels_c != ignore_index).unsqueeze(
            1
        )  # [c, 1]: rows of ignored labels contribute nothing
        if grad_b is not None:
            grad_b += grad.mul_(keep).sum(dim=0, dtype=wide)  # [V]; zeroes the ignored rows of grad
        if grad_x is not None:
            rows = grad_x[start : start + x_c.shape[0]]  # [c, Dm] view
            torch.mm(grad, weight, out=rows).mul_(keep)  # [c, V] @ [V, Dm]
        if grad_w is not None:
            _accumulate_weight_grad(
                grad_w, grad, x_c * keep, first=start == 0
            )  # x_c * keep: [c, Dm]
        del grad
    if grad_w is not None and B * s == 0:
        grad_w.zero_()  # no chunk ran
    n_tokens = (labels != ignore_index).sum()  # int64 scalar
    grad_x = None if grad_x is None else grad_x.view(B, s, Dm)  # [B, s, Dm]
    return loss_sum, n_tokens, grad_x, grad_w, grad_b


def _accumulate_weight_grad(grad_w, grad, x_kept, first: bool) -> None:
    """grad_w [V, Dm] (fp32, or the weight's dtype when that is already wide) = (first ? 0 : grad_w) + grad.T @
    x_kept, grad [c, V] and x_kept [c, Dm] in the weight's dtype, the sum of the chunks kept in grad_w's dtype.

    16-bit weights on CUDA: one cuBLAS GEMM with an fp32 output and beta = 1 (`torch.addmm(..., out_dtype=fp32)`):
    the accumulator is read and written inside the GEMM, no [V, Dm] partial exists. Where that is not available
    (CPU, or a torch without it): by ~32 MiB row blocks of grad_w, each block's GEMM in the weight's dtype (fp32
    accumulation inside) added into the fp32 block. Fake tensors take the CUDA path (the simulation counts what
    the GPU allocates)."""
    beta = 0 if first else 1
    if grad_w.dtype == grad.dtype:
        grad_w.addmm_(grad.t(), x_kept, beta=beta)  # [V, c] @ [c, Dm]; chunk 0 overwrites
    elif _fused_accumulate(grad_w):
        _addmm_wide(grad_w, grad.t(), x_kept, beta)
    else:
        rows = _block_rows(grad_w.shape[0], grad_w.shape[1] * grad_w.element_size())
        for r in range(0, grad_w.shape[0], rows):
            part = torch.mm(grad[:, r : r + rows].t(), x_kept)  # [rows, Dm] in the weight's dtype
            block = grad_w[r : r + rows]  # [rows, Dm] view
            block.copy_(part) if first else block.add_(part)  # fp32 += 16-bit, one kernel


def _addmm_wide(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: int) -> None:
    """acc = beta * acc + a @ b in one GEMM: acc fp32, a and b 16-bit (cuBLAS; fake tensors)."""
    torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)


_FUSED: dict[torch.device, bool] = {}


def _fused_accumulate(grad_w: torch.Tensor) -> bool:
    """Whether `torch.addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)` runs on grad_w's device: always for fake
    tensors (the simulation of a GPU), never on CPU, on CUDA after one probe on 2 x 2 matrices (cached)."""
    if is_fake(grad_w):
        return True
    if grad_w.device.type != "cuda":
        return False
    if grad_w.device not in _FUSED:
        acc = torch.ones(2, 2, device=grad_w.device)
        a = torch.eye(2, device=grad_w.device, dtype=torch.bfloat16)
        try:
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _FUSED[grad_w.device] = bool(torch.equal(acc, torch.eye(2, device=acc.device) + 1))
        except (RuntimeError, TypeError, NotImplementedError):
            _FUSED[grad_w.device] = False
    return _FUSED[grad_w.device]


def _block_rows(n_rows: int, row_bytes: int) -> int:
    """Rows per block of a blockwise pass: about 32 MiB and at most an eighth of the tensor (so that a buffer
    stays small beside what it walks at any size), >= 1."""
    return max(1, min(_BLOCK_BYTES // row_bytes, math.ceil(n_rows / 8)))


def _blockwise(
    dst: torch.Tensor, src: torch.Tensor, *, scale: torch.Tensor | None = None, add: bool = False
) -> None:
    """dst = src * scale, or dst += src, by ~32 MiB row blocks through one buffer in fp32 (or wider).

    Avoids a full-size fp32 temporary (2 x a bf16 weight) and mixed-dtype elementwise kernels (slow on CPU).
    """
    last = dst.shape[-1]
    dst2, src2 = dst.view(-1, last), src.view(-1, last)  # [rows, last]
    wide = torch.promote_types(torch.promote_types(dst.dtype, src.dtype), torch.float32)
    rows = _block_rows(dst2.shape[0], last * wide.itemsize)
    buf = torch.empty(rows, last, dtype=wide, device=dst.device)  # [rows, last]
    for start in chunk_starts(dst2.shape[0], rows, dst2):
        n = min(rows, dst2.shape[0] - start)
        block = buf[:n].copy_(src2[start : start + n])  # [n, last]
        if scale is not None:
            block.mul_(scale)
        dst2[start : start + n].add_(block) if add else dst2[start : start + n].copy_(block)


def _scaled(saved: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype):
    """saved * scale in `dtype`, multiplied in fp32 (or wider) and rounded once.

    On CUDA one kernel (fp32 in, `dtype` out); elsewhere by ~32 MiB row blocks through an fp32 buffer
    (`_blockwise`: mixed-dtype elementwise kernels are slow on CPU)."""
    if saved is None:
        return None
    if saved.dtype == dtype == torch.promote_types(dtype, torch.float32):
        return saved * scale.to(dtype)
    out = torch.empty(saved.shape, dtype=dtype, device=saved.device)
    if saved.is_cuda or is_fake(saved):  # fake: what the GPU allocates
        return torch.mul(saved, scale.to(saved.dtype), out=out)
    _blockwise(out, saved, scale=scale)
    return out


class TiledCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of `tiled_cross_entropy_forward`: saves gradients, not logits; nothing recomputed.

    Saved between forward and backward: d hidden [B, s, Dm] (hidden dtype), d weight [V, Dm] and d bias [V] (fp32).
    Backward costs one elementwise pass over them (and allocates the results in the inputs' dtypes).
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
        loss_sum, n_tokens, grad_x, grad_w, grad_b = tiled_cross_entropy_forward(
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
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(n_tokens)
        return loss_sum, n_tokens

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_n):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        dx, dw, db = ctx.dtypes
        return (
            _scaled(grad_x, grad_loss, dx),
            _scaled(grad_w, grad_loss, dw),
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
        chunk_tokens: tokens per chunk; default `default_chunk_tokens(V)` (about 512 MiB of fp32 logits).
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
