"""What turns a stage's projection rows into attention-ready heads (q/k norms, RoPE), and its adjoint.

Entry points:
- `rope(t, cos, sin, style)` / `rope_adjoint(d, cos, sin, style)`: rotary embedding and its transpose, for both
  pairings (halves: Llama; interleaved: Cohere), partial rotary (cos narrower than the head dim: Phi-3), and fp32.
- `Side`: q, k or v in one call: its projection, norm, whether it rotates, and for a whole-projection norm
  (`ProjectionNorm`, OLMo 2) the per-token inverse RMS over ALL its rows.
- `post(side, pre, rows, cos, sin, D, style)` / `post_backward(...)`: [B, s, n*D] rows -> [B, s, n, D] heads,
  and back.
- `projection_inv_rms(pre_fn, n_rows, chunk_rows, eps, device)`: the inverse RMS of a whole-projection norm, with
  the projection computed `chunk_rows` rows at a time (never all rows at once).

A whole-projection norm couples every head of a token: y = w * u * r, r = rsqrt(mean(u^2) + eps) over all n rows.
Its input gradient is d u = w*g*r - u * (r^3 / n) * sum_all(w*g*u). The first term is local to a stage's rows;
the sum is accumulated per token over the stages (`post_backward` adds to `sigma` [B, s, 1]), and the second term,
linear in u, is applied after the stage loop by the caller (`correction(side, sigma, n_rows)` times the
recomputed rows), so no stage ever holds all rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_upipe.ops.block_weights import HeadNorm, Projection, ProjectionNorm, RopeStyle

__all__ = [
    "Side",
    "correction",
    "post",
    "post_backward",
    "projection_inv_rms",
    "rope",
    "rope_adjoint",
]


def _rotate(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The 90-degree rotation R of RoPE on the last dim (R^T = -R)."""
    if interleaved:  # pairs (2i, 2i+1): (-t[2i+1], t[2i])
        return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _apply(t: torch.Tensor, cos, sin, style: RopeStyle, transpose: bool) -> torch.Tensor:
    """t [B, s, h, D], cos/sin [B|1, s, Dr] with Dr <= D: t*cos + R(t)*sin, or its transpose d*cos - R(d*sin)."""
    Dr = cos.shape[-1]
    part = t[..., :Dr] if Dr < t.shape[-1] else t
    if style.fp32:
        part = part.float()
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    if transpose:
        out = part * c - _rotate(part * s, style.interleaved)
    else:
        out = part * c + _rotate(part, style.interleaved) * s
    out = out.to(t.dtype)  # fp32 RoPE (Cohere), or fp32 tables (OLMo 2 casts back to q's dtype too)
    return torch.cat((out, t[..., Dr:]), dim=-1) if Dr < t.shape[-1] else out


def rope(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle = RopeStyle()
) -> torch.Tensor:
    """Rotary embedding. t [B, s, h, D], cos/sin [B|1, s, Dr] (Dr <= D: the first Dr dims rotate)."""
    return _apply(t, cos, sin, style, transpose=False)


def rope_adjoint(
    d: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle = RopeStyle()
) -> torch.Tensor:
    """Adjoint of `rope` (linear in t): d [B, s, h, D] -> d t."""
    return _apply(d, cos, sin, style, transpose=True)


@dataclass
class Side:
    """q, k or v of one call. inv_rms [B, s, 1] fp32: set for a `ProjectionNorm` (by `projection_inv_rms`)."""

    proj: Projection
    norm: HeadNorm | ProjectionNorm | None = None
    rotate: bool = False
    inv_rms: torch.Tensor | None = None


def projection_inv_rms(pre_fn, n_rows: int, chunk_rows: int, eps: float, device) -> torch.Tensor:
    """rsqrt(mean(u^2) + eps) over all n_rows features of each token, u = pre_fn(rows).float() [B, s, len(rows)]."""
    acc = None
    for rows in torch.arange(n_rows, device=device).split(chunk_rows):
        sq = pre_fn(rows).float().pow(2).sum(-1, keepdim=True)  # [B, s, 1]
        acc = sq if acc is None else acc.add_(sq)
    return torch.rsqrt(acc / n_rows + eps)


def post(
    side: Side, pre: torch.Tensor, rows: torch.Tensor, cos, sin, D: int, style: RopeStyle
) -> torch.Tensor:
    """[B, s, n*D] projection rows `rows` -> [B, s, n, D]: the norm, then RoPE (q/k) or nothing (v)."""
    t = pre
    if isinstance(side.norm, ProjectionNorm):
        t = (side.norm.weight.index_select(0, rows) * (pre.float() * side.inv_rms)).to(pre.dtype)
    t = t.view(*pre.shape[:2], -1, D)  # [B, s, n, D]
    if isinstance(side.norm, HeadNorm):
        t = side.norm.fn(t)
    return rope(t, cos, sin, style) if side.rotate else t


def post_backward(
    side: Side,
    pre_fn,
    rows,
    cos,
    sin,
    D: int,
    style: RopeStyle,
    d_post: torch.Tensor,
    grads,
    sigma: torch.Tensor | None,
) -> torch.Tensor:
    """Backward of `post` given d_post [B, s, n, D]; returns d_pre [B, s, n*D] (for a `ProjectionNorm`, its
    stage-local term; the coupled term is `correction`). `grads.get(t)` is t's gradient buffer or None.

    Only a norm needs activations: `pre_fn()` recomputes the stage's pre-norm rows (cheaper in memory than
    keeping them); a `HeadNorm` is differentiated by autograd, adding its parameter gradients.
    """
    d = rope_adjoint(d_post, cos, sin, style) if side.rotate else d_post
    B, s = d.shape[:2]
    norm = side.norm
    if norm is None:
        return d.reshape(B, s, -1)
    if isinstance(norm, HeadNorm):
        params = [p for p in norm.params if grads.get(p) is not None]
        pre = pre_fn().view(B, s, -1, D).requires_grad_()
        with torch.enable_grad():
            d_pre, *d_norm = torch.autograd.grad(norm.fn(pre), [pre, *params], d)
        for p, g in zip(params, d_norm):
            grads.get(p).add_(g)
        return d_pre.reshape(B, s, -1)
    u, g = pre_fn().float(), d.reshape(B, s, -1).float()  # [B, s, n*D]
    wg = norm.weight.index_select(0, rows).float() * g
    sigma.add_((wg * u).sum(-1, keepdim=True))
    if (gw := grads.get(norm.weight)) is not None:
        gw.index_add_(0, rows, (g * u * side.inv_rms).sum((0, 1)).to(gw.dtype))
    return (wg * side.inv_rms).to(d_post.dtype)


def correction(side: Side, sigma: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The coupled term's per-token factor: d u += factor * u, factor = -r^3 * sigma / n. [B, s, 1] fp32."""
    return -side.inv_rms.pow(3) * sigma / n_rows
