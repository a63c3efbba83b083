"""Fused UPipe attention block: q/k/v projections, QK-norm and RoPE inside the head-chunk loop, o_proj per stage.

Entry points:
- `fused_upipe_attention(x, cos, sin, weights, *, num_heads, num_kv_heads, head_dim, group, ...)`: the block,
  from the normed hidden state x [B, s, Dm] to the o_proj output y [B, s, Dm].
- `AttentionWeights`, `Projection`, `LoraAdapter`, `HeadNorm`, `ProjectionNorm`, `RopeStyle`: the block's tensors
  (`hf_upipe.ops.block_weights`); the norms and RoPE are `hf_upipe.ops.head_transforms`.

Legend as in `hf_upipe.ops.upipe_attention` (B, s, S, P, H, Hk, c, kc, D), plus Dm the model width and R the
rows of one stage's heads (R = P*c*D for q, P*kc*D for k/v).

The flow, per stage i (rank r handles model heads r*H/P + i*c + j, as in `HeadLayout`):
1. pre = x @ W[R]^T + b[R] + sum_lora xa @ B[R]^T * scaling   [B, s, P*c, D]   (xa = dropout(x) @ A^T, once)
2. q_i = rope(norm(pre)); at a k/v chunk's first stage the same for k, v; all-to-all -> [B, S, c, D] (a norm over
   the whole projection, OLMo 2's, first takes each token's RMS over all rows, computed a chunk of rows at a time)
3. (oh, lse) = kernel(qh, kh, vh); oh back to the local layout -> a_i [B, s, P*c*D]
4. y += a_i @ Wo[:, R]^T (+ LoRA: za += dropout(a_i) @ Ao[:, R]^T); after the loop y += za @ Bo^T * s + bo.
So neither the local q/k/v of all heads, nor the local attention output of all heads, ever exists.

Backward, per stage, in one of two modes (`save_attention`):
- recompute (default): recompute q_i (and k/v at a chunk's first stage) and the attention forward (oh, lse): about
  a third more attention compute; dq, dk, dv go straight back to the local layout (each stage sends its dk/dv
  partial, so no accumulator exists; more all-to-all bytes when stages share a k/v chunk);
- save: the forward keeps every stage's kernel output and log-sum-exp (oh [B, S, c, D], lse: together the size of
  one local attention output [B, s, H*D], about what Ulysses keeps of it), so only the projections are recomputed;
  the stages sharing a k/v chunk sum dk/dv in the head layout [B, S, kc, D] and send them once.
Then d a_i = dy @ Wo[:, R] (+ LoRA); kernel backward; the gradients go back through RoPE's adjoint and the norm's
(`hf_upipe.ops.head_transforms`), and their products with x are written into dx (`addmm_`) and the weight-row
gradients; a whole-projection norm's coupled term is applied after the loop, a chunk of rows at a time.
Saved: x, cos, sin, the small LoRA products xa/za, a whole-projection norm's inverse RMS [B, s, 1], the
dropout seed, and in save mode the stages' (oh, lse). Gradients of frozen tensors are not computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hf_upipe.ops.all_to_all import group_size, head_to_seq, seq_to_head
from hf_upipe.ops.block_weights import (
    AttentionWeights,
    HeadNorm,
    LoraAdapter,
    Projection,
    ProjectionNorm,
    RopeStyle,
)
from hf_upipe.ops.head_layout import HeadLayout
from hf_upipe.ops.head_transforms import Side, correction, post, post_backward, projection_inv_rms
from hf_upipe.ops.kernels import AttentionKernel, get_kernel

__all__ = ["AttentionWeights", "HeadNorm", "LoraAdapter", "Projection", "ProjectionNorm", "RopeStyle",
           "fused_upipe_attention"]


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
    save: bool = False  # keep each stage's (oh, lse) for the backward instead of recomputing them
    q_heads: list[torch.Tensor] = field(default_factory=list)  # per stage, model q heads [P*c] (rank-major)
    kv_heads: list[torch.Tensor] = field(default_factory=list)  # per stage, model k/v heads [P*kc]

    @property
    def chunk_rows(self) -> int:
        """Projection rows of one stage's query heads (P*c*D): the unit of a whole-projection norm's passes."""
        return self.layout.sp_size * self.layout.chunk * self.D


def _make_plan(layout, group, kernel, scale, D, device, dropout: bool, save: bool = False) -> _Plan:
    # dropout masks are regenerated from this seed in backward; drawn from torch's RNG, so activation
    # checkpointing (which restores the RNG state before recomputing) draws the same one
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout else 0
    plan = _Plan(layout, group, kernel, scale, D, seed=seed, save=save)
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


def _sides(x, w: AttentionWeights, plan: _Plan, xas, inv_rms=None) -> dict[str, Side]:
    """q/k/v of this call; a whole-projection norm's inverse RMS is computed here (forward) or given (backward)."""
    sides = {"q": Side(w.q, w.q_norm, w.rope.rotate), "k": Side(w.k, w.k_norm, w.rope.rotate), "v": Side(w.v)}
    for n, name in enumerate("qk"):
        side = sides[name]
        if isinstance(side.norm, ProjectionNorm):
            side.inv_rms = inv_rms[n] if inv_rms is not None else projection_inv_rms(
                lambda rows: _pre(x, side.proj, rows, xas[name]), _features(plan, name), plan.chunk_rows,
                side.norm.eps, x.device)  # [B, s, 1]
    return sides


def _features(plan: _Plan, name: str) -> int:
    """Rows of the whole q (H*D) or k (Hk*D) projection."""
    return (plan.layout.num_heads if name == "q" else plan.layout.num_kv_heads) * plan.D


def _fused_forward(x, cos, sin, w: AttentionWeights, plan: _Plan):
    """The stage loop (no autograd). Returns y [B, s, Dm], the small tensors the backward needs, and in save mode
    the stages' kernel outputs and log-sum-exps [oh_0, lse_0, oh_1, ...] (else [])."""
    layout, D, style = plan.layout, plan.D, w.rope
    B, s, Dm = x.shape
    xas = w.lora_inputs(x, plan.seed, _dropout)
    sides = _sides(x, w, plan, xas)
    y = x.new_zeros(B, s, w.o.weight.shape[0])
    za = [x.new_zeros(B, s, a.A.shape[0]) for a in w.o.adapters]
    kh = vh = None
    saved = []
    for i in range(layout.num_stages):
        if layout.starts_kv_group(i):
            kh = vh = None
            rows = _rows(plan.kv_heads[i], D)
            k5 = post(sides["k"], _pre(x, w.k, rows, xas["k"]), rows, cos, sin, D, style)  # [B, s, P*kc, D]
            kh = seq_to_head(k5.view(B, s, layout.sp_size, -1, D), plan.group)  # [B, S, kc, D]
            v5 = post(sides["v"], _pre(x, w.v, rows, xas["v"]), rows, cos, sin, D, style)
            vh = seq_to_head(v5.view(B, s, layout.sp_size, -1, D), plan.group)
            del k5, v5
        rows = _rows(plan.q_heads[i], D)
        q5 = post(sides["q"], _pre(x, w.q, rows, xas["q"]), rows, cos, sin, D, style)  # [B, s, P*c, D]
        qh = seq_to_head(q5.view(B, s, layout.sp_size, -1, D), plan.group)  # [B, S, c, D]
        del q5
        oh, lse = plan.kernel.forward(qh, kh, vh, scale=plan.scale, causal=True)
        del qh
        if plan.save:
            saved += [oh, lse]
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
    return y, xas, za, (sides["q"].inv_rms, sides["k"].inv_rms), saved


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


def _fused_backward(dy, x, cos, sin, w: AttentionWeights, plan: _Plan, xas, za, inv_rms,
                    grads: _Grads, saved=()) -> torch.Tensor:
    """The backward stage loop; returns dx and fills `grads`. `saved`: the forward's stage outputs (save mode)."""
    layout, D, group, style = plan.layout, plan.D, plan.group, w.rope
    B, s, Dm = x.shape
    P = layout.sp_size
    x2, dy2 = x.reshape(B * s, Dm), dy.reshape(B * s, -1)
    dx = torch.zeros_like(x)
    dx2 = dx.view(B * s, Dm)
    sides = _sides(x, w, plan, xas, inv_rms)
    # per-token sums of a whole-projection norm's coupled term [B, s, 1] (None for other norms)
    sigma = {n: x.new_zeros(B, s, 1, dtype=torch.float32) if isinstance(sides[n].norm, ProjectionNorm) else None
             for n in "qk"}
    ts = {name: [x.new_zeros(B * s, a.A.shape[0]) for a in getattr(w, name).adapters] for name in "qkv"}
    if (g := grads.get(w.o.bias)) is not None:
        g.add_(dy2.sum(0))
    us = []  # dy @ Bo * s for each o adapter: [N, r]
    for ad, z in zip(w.o.adapters, za):
        if (g := grads.get(ad.B)) is not None:
            g.add_((dy2.t() @ z.reshape(B * s, -1)) * ad.scaling)
        us.append((dy2 @ ad.B) * ad.scaling)
    kh = vh = dk_sum = dv_sum = None
    for i in range(layout.num_stages):
        kv_rows = _rows(plan.kv_heads[i], D)
        if layout.starts_kv_group(i):
            kh = vh = None
            k5 = post(sides["k"], _pre(x, w.k, kv_rows, xas["k"]), kv_rows, cos, sin, D, style)  # [B, s, P*kc, D]
            kh = seq_to_head(k5.view(B, s, P, -1, D), group)
            vh = seq_to_head(_pre(x, w.v, kv_rows, xas["v"]).view(B, s, P, -1, D), group)
            del k5
        rows = _rows(plan.q_heads[i], D)
        q5 = post(sides["q"], _pre(x, w.q, rows, xas["q"]), rows, cos, sin, D, style)  # [B, s, P*c, D]
        qh = seq_to_head(q5.view(B, s, P, -1, D), group)
        del q5
        if plan.save:
            oh, lse = saved[2 * i], saved[2 * i + 1]
        else:
            oh, lse = plan.kernel.forward(qh, kh, vh, scale=plan.scale, causal=True)  # recomputed
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
        # recompute mode: every gradient goes straight back to the local layout and into dx / the weights, no
        # accumulators (the stages sharing a k/v chunk each send their dk/dv partial; the linear backward sums
        # them). Save mode: dk/dv are summed over the chunk's stages here [B, S, kc, D] and sent once, at its end.
        if plan.save:
            dk_sum = dkh if dk_sum is None else dk_sum.add_(dkh)
            dv_sum = dvh if dv_sum is None else dv_sum.add_(dvh)
            dkh = dvh = None
            if layout.ends_kv_group(i):
                dkh, dvh, dk_sum, dv_sum = dk_sum, dv_sum, None, None
        for name, dh, r in (("q", dqh, rows), ("k", dkh, kv_rows)):
            if dh is None:
                continue
            d5 = head_to_seq(dh, group).reshape(B, s, -1, D)  # [B, s, P*c (or P*kc), D]
            proj = getattr(w, name)
            d_pre = post_backward(sides[name], lambda: _pre(x, proj, r, xas[name]), r, cos, sin, D, style, d5,
                                  grads, sigma[name])
            del d5
            _linear_backward(x2, proj, r, d_pre.reshape(B * s, -1), xas[name], ts[name], grads, dx2)
            del d_pre
        del dqh, dkh
        if dvh is not None:
            dv2 = head_to_seq(dvh, group).reshape(B * s, -1)
            del dvh
            _linear_backward(x2, w.v, kv_rows, dv2, xas["v"], ts["v"], grads, dx2)
            del dv2
    # a whole-projection norm's coupled term, d pre += factor * pre, over the distinct rows a chunk at a time
    for name in "qk":
        if sigma[name] is not None:
            factor, proj, n = correction(sides[name], sigma[name], _features(plan, name)), getattr(w, name), None
            for r in torch.arange(_features(plan, name), device=x.device).split(plan.chunk_rows):
                n = (factor * _pre(x, proj, r, xas[name]).float()).to(x.dtype)  # [B, s, len(r)]
                _linear_backward(x2, proj, r, n.reshape(B * s, -1), xas[name], ts[name], grads, dx2)
            del n
    # LoRA A sides of q/k/v: one product with x (or dropout(x)) each, after the loop
    seeds = w.lora_seeds(plan.seed)
    for name in "qkv":
        for a, t, seed in zip(getattr(w, name).adapters, ts[name], seeds[name]):
            if (g := grads.get(a.A)) is not None:
                g.add_(t.t() @ _dropout(x2, a.dropout, seed))
            dx2.add_(_dropout(t @ a.A, a.dropout, seed))
    return dx


class _FusedFunction(torch.autograd.Function):
    """Autograd wrapper of the fused block; inputs: x, cos, sin, (weights, plan), *weights.tensors()."""

    @staticmethod
    def forward(ctx, x, cos, sin, static, *tensors):
        w, plan = static
        y, xas, za, inv_rms, saved = _fused_forward(x, cos, sin, w, plan)
        flat_xas = [t for name in "qkv" for t in xas[name]]
        ctx.has_rms = [t is not None for t in inv_rms]
        ctx.save_for_backward(x, cos, sin, *[t for t in inv_rms if t is not None], *flat_xas, *za, *saved)
        ctx.static, ctx.n_tensors = static, len(tensors)
        ctx.counts = [len(xas[name]) for name in "qkv"] + [len(za)]
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        w, plan = ctx.static
        x, cos, sin, *rest = ctx.saved_tensors
        inv_rms = []
        for has in ctx.has_rms:
            inv_rms.append(rest.pop(0) if has else None)
        xas, k = {}, 0
        for name, n in zip("qkv", ctx.counts):
            xas[name], k = rest[k:k + n], k + n
        za, saved = rest[k:k + ctx.counts[3]], rest[k + ctx.counts[3]:]
        grads = _Grads(w.tensors(), list(ctx.needs_input_grad[4:]))
        dx = _fused_backward(dy.contiguous(), x, cos, sin, w, plan, xas, za, inv_rms, grads, saved)
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
    save_attention: bool = False,
) -> torch.Tensor:
    """The attention block (projections, QK-norm, RoPE, causal attention, o_proj) on a sequence shard.

    Args:
        x: [B, s, Dm] this rank's normed hidden states (contiguous shard of the sequence).
        cos, sin: [B or 1, s, Dr] rotary tables at the GLOBAL positions of the shard (Dr <= D; unused when
            `weights.rope.rotate` is False).
        weights: the block's tensors; gradients flow to every one that requires grad.
        num_heads, num_kv_heads, head_dim: H, Hk, D of the model.
        group, heads_per_chunk, kernel, scale: as for `hf_upipe.ops.upipe_attention`.
        save_attention: keep every stage's kernel output and log-sum-exp for the backward (save mode: no attention
            recompute, dk/dv sent once per k/v chunk; more memory) instead of recomputing them (module docstring).

    Returns:
        y [B, s, Dm], the o_proj output (bias and LoRA included).
    """
    layout = HeadLayout(num_heads, num_kv_heads, group_size(group), heads_per_chunk)
    kern = get_kernel(kernel, x.device, x.dtype) if isinstance(kernel, str) else kernel
    dropout = any(a.dropout > 0 for p in (weights.q, weights.k, weights.v, weights.o) for a in p.adapters)
    tensors = weights.tensors()
    backward = torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors))
    plan = _make_plan(layout, group, kern, head_dim ** -0.5 if scale is None else scale, head_dim, x.device,
                      dropout, save_attention and backward)  # nothing kept for a forward without backward
    if backward:
        return _FusedFunction.apply(x, cos, sin, (weights, plan), *tensors)
    return _fused_forward(x, cos, sin, weights, plan)[0]
