"""Fused UPipe attention block: q/k/v projections, QK-norm and RoPE inside the head-chunk loop, o_proj per stage.

Entry points:
- `fused_upipe_attention(x, cos, sin, weights, *, num_heads, num_kv_heads, head_dim, group, ...)`: the block,
  from the normed hidden state x [B, s, Dm] to the o_proj output y [B, s, Dm].
- `AttentionWeights`, `Projection`, `LoraAdapter`, `HeadNorm`: the block's tensors, as plain torch (the
  integration layer builds them from transformers/PEFT modules).

Legend as in `hf_upipe.ops.upipe_attention` (B, s, S, P, H, Hk, c, kc, D), plus Dm the model width and R the
rows of one stage's heads (R = P*c*D for q, P*kc*D for k/v).

The flow, per stage i (rank r handles model heads r*H/P + i*c + j, as in `HeadLayout`):
1. pre = x @ W[R]^T + b[R] + sum_lora xa @ B[R]^T * scaling   [B, s, P*c, D]   (xa = dropout(x) @ A^T, once)
2. q_i = rope(norm(pre)); at a k/v chunk's first stage the same for k, v; all-to-all -> [B, S, c, D]
3. (oh, lse) = kernel(qh, kh, vh); oh back to the local layout -> a_i [B, s, P*c*D]
4. y += a_i @ Wo[:, R]^T (+ LoRA: za += dropout(a_i) @ Ao[:, R]^T); after the loop y += za @ Bo^T * s + bo.
So neither the local q/k/v of all heads, nor the local attention output of all heads, ever exists.

Backward, per stage (the attention forward is recomputed instead of saved: about a third more attention
compute): recompute q_i (and k/v at a chunk's first stage) and oh; d a_i = dy @ Wo[:, R] (+ LoRA); kernel
backward; dq, dk, dv go straight back to the local layout (each stage sends its dk/dv partial, so no
accumulator exists; more all-to-all bytes when stages share a k/v chunk), through RoPE's adjoint (or autograd of
norm + RoPE on a recomputed pre-norm projection), and their products with x are written into dx (`addmm_`) and
the weight-row gradients. Saved: x, cos, sin, the small LoRA products xa/za and the dropout seed. Gradients of
frozen tensors are not computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hf_upipe.ops.all_to_all import group_size, head_to_seq, seq_to_head
from hf_upipe.ops.head_layout import HeadLayout
from hf_upipe.ops.kernels import AttentionKernel, get_kernel

__all__ = ["AttentionWeights", "HeadNorm", "LoraAdapter", "Projection", "fused_upipe_attention"]


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter: delta(x) = dropout(x) @ A^T @ B^T * scaling. A [r, in], B [out, r]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    dropout: float = 0.0


@dataclass(frozen=True)
class Projection:
    """A linear layer with optional bias [out] and LoRA adapters. weight [out, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    adapters: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True)
class HeadNorm:
    """A per-head norm over the last dim D (Qwen3's q_norm/k_norm): fn([..., D]) -> [..., D], reading `params`."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    params: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class AttentionWeights:
    """The attention block's tensors: q/k/v rows are heads in model order (head h = rows [h*D, (h+1)*D))."""

    q: Projection
    k: Projection
    v: Projection
    o: Projection
    q_norm: HeadNorm | None = None
    k_norm: HeadNorm | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the block, in a fixed order (the autograd Function's inputs)."""
        out = []
        for p in (self.q, self.k, self.v, self.o):
            out += [p.weight] + ([p.bias] if p.bias is not None else [])
            for a in p.adapters:
                out += [a.A, a.B]
        for n in (self.q_norm, self.k_norm):
            if n is not None:
                out += list(n.params)
        return out


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (Llama/Qwen/Mistral). t [B, s, h, D], cos/sin [B|1, s, D]."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def _rows(heads: torch.Tensor, D: int) -> torch.Tensor:
    """Row indices [n*D] of the given heads [n]."""
    return (heads[:, None] * D + torch.arange(D, device=heads.device)).flatten()


@dataclass
class _Plan:
    """Per-call constants shared by forward and backward."""

    layout: HeadLayout
    group: dist.ProcessGroup | None
    kernel: AttentionKernel
    scale: float
    D: int
    seed: int
    q_heads: list[torch.Tensor] = field(default_factory=list)  # per stage, model q heads [P*c] (rank-major)
    kv_heads: list[torch.Tensor] = field(default_factory=list)  # per stage, model k/v heads [P*kc]


def _make_plan(layout, group, kernel, scale, D, device, dropout: bool) -> _Plan:
    # dropout masks are regenerated from this seed in backward; drawn from torch's RNG, so activation
    # checkpointing (which restores the RNG state before recomputing) draws the same one
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout else 0
    plan = _Plan(layout, group, kernel, scale, D, seed=seed)
    P, qpr, kpr = layout.sp_size, layout.q_per_rank, layout.kv_per_rank
    ranks = torch.arange(P, device=device)[:, None]  # [P, 1]
    for i in range(layout.num_stages):
        sl = layout.q_heads(i)  # rank r: model heads r*qpr + sl -> [P*c], rank-major
        plan.q_heads.append((ranks * qpr + torch.arange(sl.start, sl.stop, device=device)).flatten())
        src = layout.kv_source_index(i, device)  # replicated k/v heads (Hk < P)
        if src is None:
            kvs = layout.kv_heads(i)
            src = (ranks * kpr + torch.arange(kvs.start, kvs.stop, device=device)).flatten()
        plan.kv_heads.append(src)
    return plan


def _dropout(t: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Deterministic dropout: the same seed gives the same mask in forward and in the backward's recompute."""
    if p == 0.0:
        return t
    gen = torch.Generator(device=t.device).manual_seed(seed)
    keep = torch.rand(t.shape, generator=gen, device=t.device, dtype=torch.float32) >= p
    return t * keep.to(t.dtype) / (1.0 - p)


def _pre(x: torch.Tensor, proj: Projection, rows: torch.Tensor, xas: list[torch.Tensor]) -> torch.Tensor:
    """x [B, s, Dm] -> the projection's rows R before norm/RoPE: [B, s, len(R)]."""
    out = torch.nn.functional.linear(x, proj.weight.index_select(0, rows),
                                     None if proj.bias is None else proj.bias.index_select(0, rows))
    for a, xa in zip(proj.adapters, xas):
        out.add_(xa @ a.B.index_select(0, rows).t(), alpha=a.scaling)  # [B, s, r] @ [r, R]
    return out


def _post(pre: torch.Tensor, norm: HeadNorm | None, cos, sin, D: int, rotate: bool = True) -> torch.Tensor:
    """[B, s, n*D] -> [B, s, n, D]: per-head norm, then RoPE (k/q) or nothing (v)."""
    t = pre.view(*pre.shape[:2], -1, D)
    if norm is not None:
        t = norm.fn(t)
    return rope(t, cos, sin) if rotate else t


def _lora_inputs(x: torch.Tensor, proj: Projection, seed: int) -> list[torch.Tensor]:
    """xa = dropout(x) @ A^T [B, s, r] for each adapter (computed once per call, saved: r << Dm)."""
    return [_dropout(x, a.dropout, seed + j) @ a.A.t() for j, a in enumerate(proj.adapters)]


def _fused_forward(x, cos, sin, w: AttentionWeights, plan: _Plan):
    """The stage loop (no autograd). Returns y [B, s, Dm] and the small tensors the backward needs."""
    layout, D = plan.layout, plan.D
    B, s, Dm = x.shape
    xas = {name: _lora_inputs(x, getattr(w, name), plan.seed + 100 * n) for n, name in enumerate("qkv")}
    y = x.new_zeros(B, s, w.o.weight.shape[0])
    za = [x.new_zeros(B, s, a.A.shape[0]) for a in w.o.adapters]
    kh = vh = None
    for i in range(layout.num_stages):
        if layout.starts_kv_group(i):
            kh = vh = None
            rows = _rows(plan.kv_heads[i], D)
            k5 = _post(_pre(x, w.k, rows, xas["k"]), w.k_norm, cos, sin, D)  # [B, s, P*kc, D]
            kh = seq_to_head(k5.view(B, s, layout.sp_size, -1, D), plan.group)  # [B, S, kc, D]
            v5 = _post(_pre(x, w.v, rows, xas["v"]), None, cos, sin, D, rotate=False)
            vh = seq_to_head(v5.view(B, s, layout.sp_size, -1, D), plan.group)
            del k5, v5
        rows = _rows(plan.q_heads[i], D)
        q5 = _post(_pre(x, w.q, rows, xas["q"]), w.q_norm, cos, sin, D)  # [B, s, P*c, D]
        qh = seq_to_head(q5.view(B, s, layout.sp_size, -1, D), plan.group)  # [B, S, c, D]
        del q5
        oh, _ = plan.kernel.forward(qh, kh, vh, scale=plan.scale, causal=True)
        del qh
        a = head_to_seq(oh, plan.group).reshape(B * s, -1)  # [B*s, P*c*D], model heads q_heads[i]
        del oh
        y.view(B * s, -1).addmm_(a, w.o.weight.index_select(1, rows).t())  # o_proj of this stage's heads
        for j, ad in enumerate(w.o.adapters):
            za[j].view(B * s, -1).addmm_(_dropout(a, ad.dropout, plan.seed + 1000 + 16 * i + j),
                                         ad.A.index_select(1, rows).t())
    for ad, z in zip(w.o.adapters, za):
        y.add_(z @ ad.B.t(), alpha=ad.scaling)
    if w.o.bias is not None:
        y.add_(w.o.bias)
    return y, xas, za


class _Grads:
    """Gradient buffers of the block's tensors that need one (None for frozen ones)."""

    def __init__(self, tensors: list[torch.Tensor], needs: list[bool]):
        self._pos = {id(t): i for i, t in reversed(list(enumerate(tensors)))}
        self.buf: list[torch.Tensor | None] = [torch.zeros_like(t) if n else None for t, n in zip(tensors, needs)]

    def get(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else self.buf[self._pos[id(t)]]


def _linear_backward(x2, proj, rows, d_pre2, xas, ts, grads: _Grads, dx2) -> None:
    """Gradients of `_pre` for rows R given d_pre2 [N, R]: dx2 [N, Dm] += ..., weight/bias rows, LoRA B rows,
    and the LoRA A-side products ts[j] [N, r] (finished once, after the loop)."""
    dx2.addmm_(d_pre2, proj.weight.index_select(0, rows))
    if (g := grads.get(proj.weight)) is not None:
        g.index_add_(0, rows, d_pre2.t() @ x2)
    if (g := grads.get(proj.bias)) is not None:
        g.index_add_(0, rows, d_pre2.sum(0))
    for a, xa, t in zip(proj.adapters, xas, ts):
        if (g := grads.get(a.B)) is not None:
            g.index_add_(0, rows, (d_pre2.t() @ xa.reshape(-1, xa.shape[-1])) * a.scaling)
        t.addmm_(d_pre2, a.B.index_select(0, rows), alpha=a.scaling)


def _rope_backward(d: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjoint of `rope` (a rotation, linear in t): d [B, s, h, D] -> d t."""
    half = d.shape[-1] // 2
    ds = d * sin.unsqueeze(2)
    return d * cos.unsqueeze(2) + torch.cat((ds[..., half:], -ds[..., :half]), dim=-1)


def _post_backward(pre_fn, norm, cos, sin, D, rotate, d_post, grads: _Grads) -> torch.Tensor:
    """Backward of `_post` given d_post [B, s, n, D]; returns d_pre [B, s, n*D].

    Without a norm this is RoPE's adjoint and needs no activations; with a norm, `pre_fn()` recomputes the
    stage's pre-norm projection (cheaper in memory than keeping it) and autograd differentiates norm + RoPE,
    adding the norm's parameter gradients.
    """
    if norm is None:
        d = _rope_backward(d_post, cos, sin) if rotate else d_post
        return d.reshape(*d.shape[:2], -1)
    norm_params = [p for p in norm.params if grads.get(p) is not None]
    pre = pre_fn().requires_grad_()
    with torch.enable_grad():
        post = _post(pre, norm, cos, sin, D, rotate)
        d_pre, *d_norm = torch.autograd.grad(post, [pre, *norm_params], d_post)
    for p, g in zip(norm_params, d_norm):
        grads.get(p).add_(g)
    return d_pre


def _fused_backward(dy, x, cos, sin, w: AttentionWeights, plan: _Plan, xas, za, grads: _Grads) -> torch.Tensor:
    """The backward stage loop; returns dx and fills `grads`."""
    layout, D, group = plan.layout, plan.D, plan.group
    B, s, Dm = x.shape
    P = layout.sp_size
    x2, dy2 = x.reshape(B * s, Dm), dy.reshape(B * s, -1)
    dx = torch.zeros_like(x)
    dx2 = dx.view(B * s, Dm)
    ts = {name: [x.new_zeros(B * s, a.A.shape[0]) for a in getattr(w, name).adapters] for name in "qkv"}
    if (g := grads.get(w.o.bias)) is not None:
        g.add_(dy2.sum(0))
    us = []  # dy @ Bo * s for each o adapter: [N, r]
    for ad, z in zip(w.o.adapters, za):
        if (g := grads.get(ad.B)) is not None:
            g.add_((dy2.t() @ z.reshape(B * s, -1)) * ad.scaling)
        us.append((dy2 @ ad.B) * ad.scaling)
    kh = vh = None
    for i in range(layout.num_stages):
        kv_rows = _rows(plan.kv_heads[i], D)
        if layout.starts_kv_group(i):
            kh = vh = None
            kh = seq_to_head(_post(_pre(x, w.k, kv_rows, xas["k"]), w.k_norm, cos, sin, D).view(B, s, P, -1, D),
                             group)
            vh = seq_to_head(_pre(x, w.v, kv_rows, xas["v"]).view(B, s, P, -1, D), group)
        rows = _rows(plan.q_heads[i], D)
        qh = seq_to_head(_post(_pre(x, w.q, rows, xas["q"]), w.q_norm, cos, sin, D).view(B, s, P, -1, D), group)
        oh, lse = plan.kernel.forward(qh, kh, vh, scale=plan.scale, causal=True)  # recomputed, not saved
        a = head_to_seq(oh, group).reshape(B * s, -1)  # [N, P*c*D]
        # o_proj of this stage: d a = dy @ Wo[:, R] (+ LoRA), and the weight-column gradients
        da = dy2 @ w.o.weight.index_select(1, rows)
        if (g := grads.get(w.o.weight)) is not None:
            g.index_add_(1, rows, dy2.t() @ a)
        for j, (ad, u) in enumerate(zip(w.o.adapters, us)):
            seed = plan.seed + 1000 + 16 * i + j
            da.add_(_dropout(u @ ad.A.index_select(1, rows), ad.dropout, seed))
            if (g := grads.get(ad.A)) is not None:
                g.index_add_(1, rows, u.t() @ _dropout(a, ad.dropout, seed))
        del a
        doh = seq_to_head(da.view(B, s, P, -1, D), group)
        del da
        dqh, dkh, dvh = plan.kernel.backward(doh, qh, kh, vh, oh, lse, scale=plan.scale, causal=True)
        del qh, oh, doh
        if layout.ends_kv_group(i):
            kh = vh = None
        # every gradient goes straight back to the local layout and into dx / the weights: no accumulators (the
        # stages sharing a k/v chunk each send their dk/dv partial; the linear backward sums them)
        dq5 = head_to_seq(dqh, group).reshape(B, s, -1, D)  # [B, s, P*c, D]
        del dqh
        d_pre = _post_backward(lambda: _pre(x, w.q, rows, xas["q"]), w.q_norm, cos, sin, D, True, dq5, grads)
        del dq5
        _linear_backward(x2, w.q, rows, d_pre.reshape(B * s, -1), xas["q"], ts["q"], grads, dx2)
        del d_pre
        dk5 = head_to_seq(dkh, group).reshape(B, s, -1, D)
        del dkh
        d_pre = _post_backward(lambda: _pre(x, w.k, kv_rows, xas["k"]), w.k_norm, cos, sin, D, True, dk5, grads)
        del dk5
        _linear_backward(x2, w.k, kv_rows, d_pre.reshape(B * s, -1), xas["k"], ts["k"], grads, dx2)
        del d_pre
        dv2 = head_to_seq(dvh, group).reshape(B * s, -1)
        del dvh
        _linear_backward(x2, w.v, kv_rows, dv2, xas["v"], ts["v"], grads, dx2)
        del dv2
    # LoRA A sides of q/k/v: one product with x (or dropout(x)) each, after the loop
    for n, name in enumerate("qkv"):
        for j, (a, t) in enumerate(zip(getattr(w, name).adapters, ts[name])):
            seed = plan.seed + 100 * n + j
            if (g := grads.get(a.A)) is not None:
                g.add_(t.t() @ _dropout(x2, a.dropout, seed))
            dx2.add_(_dropout(t @ a.A, a.dropout, seed))
    return dx


class _FusedFunction(torch.autograd.Function):
    """Autograd wrapper of the fused block; inputs: x, cos, sin, (weights, plan), *weights.tensors()."""

    @staticmethod
    def forward(ctx, x, cos, sin, static, *tensors):
        w, plan = static
        y, xas, za = _fused_forward(x, cos, sin, w, plan)
        flat_xas = [t for name in "qkv" for t in xas[name]]
        ctx.save_for_backward(x, cos, sin, *flat_xas, *za)
        ctx.static, ctx.n_tensors = static, len(tensors)
        ctx.counts = [len(xas[name]) for name in "qkv"]
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        w, plan = ctx.static
        x, cos, sin, *rest = ctx.saved_tensors
        xas, k = {}, 0
        for name, n in zip("qkv", ctx.counts):
            xas[name], k = rest[k:k + n], k + n
        za = rest[k:]
        tensors = w.tensors()
        grads = _Grads(tensors, list(ctx.needs_input_grad[4:]))
        dx = _fused_backward(dy.contiguous(), x, cos, sin, w, plan, xas, za, grads)
        return (dx if ctx.needs_input_grad[0] else None, None, None, None, *grads.buf)


def fused_upipe_attention(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: AttentionWeights,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group: dist.ProcessGroup | None = None,
    heads_per_chunk: int | None = 1,
    kernel: str | AttentionKernel = "auto",
    scale: float | None = None,
) -> torch.Tensor:
    """The attention block (projections, QK-norm, RoPE, causal attention, o_proj) on a sequence shard.

    Args:
        x: [B, s, Dm] this rank's normed hidden states (contiguous shard of the sequence).
        cos, sin: [B or 1, s, D] rotary tables at the GLOBAL positions of the shard.
        weights: the block's tensors; gradients flow to every one that requires grad.
        num_heads, num_kv_heads, head_dim: H, Hk, D of the model.
        group, heads_per_chunk, kernel, scale: as for `hf_upipe.ops.upipe_attention`.

    Returns:
        y [B, s, Dm], the o_proj output (bias and LoRA included).
    """
    layout = HeadLayout(num_heads, num_kv_heads, group_size(group), heads_per_chunk)
    kern = get_kernel(kernel, x.device, x.dtype) if isinstance(kernel, str) else kernel
    dropout = any(a.dropout > 0 for p in (weights.q, weights.k, weights.v, weights.o) for a in p.adapters)
    plan = _make_plan(layout, group, kern, head_dim ** -0.5 if scale is None else scale, head_dim, x.device,
                      dropout)
    tensors = weights.tensors()
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors)):
        return _FusedFunction.apply(x, cos, sin, (weights, plan), *tensors)
    return _fused_forward(x, cos, sin, weights, plan)[0]
