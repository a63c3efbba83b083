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
  one local attention output [B, s, H*D], about what Ulysses keeps of it) and every k/v chunk's kh, vh in the head
  layout [B, S, kc, D] (together the size of the local k and v, [B, s, 2*Hk*D]), so only the q projection is
  recomputed and re-sent; the stages sharing a k/v chunk sum dk/dv in the head layout and send them once.
Then d a_i = dy @ Wo[:, R] (+ LoRA); kernel backward; the gradients go back through RoPE's adjoint and the norm's
(`hf_upipe.ops.head_transforms`), and their products with x are written into dx (`addmm_`) and the weight-row
gradients; a whole-projection norm's coupled term is applied after the loop, a chunk of rows at a time.
Saved: x, cos, sin, the small LoRA products xa/za, a whole-projection norm's inverse RMS [B, s, 1], the
dropout masks' seed (`hf_upipe.ops.lora_dropout`: masks by global token position, the same as one process's), and
in save mode the stages' (oh, lse) and the chunks' (kh, vh). Gradients of frozen tensors are not computed. The
backward loop is `hf_upipe.ops.fused_backward`; the per-call plan and projection helpers
`hf_upipe.ops.fused_stages`.

Overlap. The forward, whenever a backward follows, issues its all-to-alls asynchronously one stage ahead: stage
i+1's q (k/v) are projected and sent before stage i's kernel runs, and stage i's output is sent while stage i+1's
kernel runs (its o_proj follows). The buffers in flight raise the forward's peak (0.25-0.75 u at Llama3-8B shapes,
P = 8, c = 1) but stay under the backward's, so the fwd+bwd peak is unchanged (the memory simulation runs this
code and shows it); a forward without backward stays synchronous, for the least memory. Without `overlap` the
backward issues the all-to-alls each step needs together (save mode: q, d a and the stage's output; then dq; then
dk and dv at a k/v chunk's end), so the ranks meet once per group, at no cost in peak memory. The stage's output
goes back to the local layout only for Wo's gradients: with Wo frozen and no o_proj adapter (PEFT's default LoRA on
Llama targets q_proj and v_proj) it is not sent, one all-to-all per stage fewer. With `overlap=True` the
backward does the same: stage i+1's q (k/v), d a (and in save mode its output) are sent before stage i's kernel
runs, stage i's dq/dk/dv while stage i+1's kernels run; that costs the send and receive buffers in flight, about one
stage's tensors each way (2.25 u at Llama3-8B shapes, P = 8, c = 1, save mode). On NCCL the collectives run on
NCCL's stream while the kernels run on the compute stream (the projections stay on the compute stream: they and
the kernel both want all the SMs); on gloo they run on gloo's worker thread. Results are bitwise those of the
synchronous schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hf_upipe.ops.all_to_all import group_size, start_head_to_seq, start_seq_to_head
from hf_upipe.ops.block_weights import (
    AttentionWeights,
    HeadNorm,
    LoraAdapter,
    Projection,
    ProjectionNorm,
    RopeStyle,
)
from hf_upipe.ops.fused_backward import Grads, fused_backward
from hf_upipe.ops.fused_stages import (
    StagePlan,
    block_sides,
    head_rows,
    make_plan,
    project_rows,
)
from hf_upipe.ops.head_layout import HeadLayout
from hf_upipe.ops.head_transforms import post
from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.lora_dropout import shard_positions

__all__ = [
    "AttentionWeights",
    "HeadNorm",
    "LoraAdapter",
    "Projection",
    "ProjectionNorm",
    "RopeStyle",
    "fused_upipe_attention",
]


def _fused_forward(x, cos, sin, w: AttentionWeights, plan: StagePlan):
    """The stage loop (no autograd). Returns y [B, s, Dm], the small tensors the backward needs, and in save mode
    what the stages' kernel backward needs beyond q: per stage, at a k/v chunk's first stage its (kh, vh), then the
    stage's kernel output and log-sum-exp: [kh_0, vh_0, oh_0, lse_0, oh_1, lse_1, ...] (else []).

    With `plan.overlap`, stage i+1's inputs are projected and sent before stage i's kernel runs, and stage i's
    output is sent while stage i+1's kernel runs (its o_proj after that): one more stage of buffers in flight."""
    layout, D, style, group, ov = plan.layout, plan.D, w.rope, plan.group, plan.overlap_forward
    B, s, Dm = x.shape
    P, n = layout.sp_size, layout.num_stages
    xas = w.lora_inputs(x, plan.dropout)
    sides = block_sides(x, w, plan, xas)
    y = x.new_zeros(B, s, w.o.weight.shape[0])
    za = [x.new_zeros(B, s, a.A.shape[0]) for a in w.o.adapters]
    saved = []

    def send_inputs(
        i,
    ):  # stage i's q (and k/v at a chunk's first stage): projected, normed, rotated, sent
        kv = None
        if layout.starts_kv_group(i):
            rows = head_rows(plan.kv_heads[i], D)
            k5 = post(
                sides["k"], project_rows(x, w.k, rows, xas["k"]), rows, cos, sin, D, style
            )  # [B, s, P*kc, D]
            kp = start_seq_to_head(k5.view(B, s, P, -1, D), group, ov)  # -> [B, S, kc, D]
            v5 = post(sides["v"], project_rows(x, w.v, rows, xas["v"]), rows, cos, sin, D, style)
            kv = (kp, start_seq_to_head(v5.view(B, s, P, -1, D), group, ov))
            del k5, v5
        rows = head_rows(plan.q_heads[i], D)
        q5 = post(
            sides["q"], project_rows(x, w.q, rows, xas["q"]), rows, cos, sin, D, style
        )  # [B, s, P*c, D]
        return start_seq_to_head(q5.view(B, s, P, -1, D), group, ov), kv  # -> [B, S, c, D]

    def o_proj(
        i, pending
    ):  # y += a_i @ Wo[:, R]^T (+ LoRA) once stage i's output is back in the local layout
        rows = head_rows(plan.q_heads[i], D)
        a = pending.wait().reshape(B * s, -1)  # [B*s, P*c*D], model heads q_heads[i]
        y.view(B * s, -1).addmm_(a, w.o.weight.index_select(1, rows).t())
        for j, ad in enumerate(w.o.adapters):
            za[j].view(B * s, -1).addmm_(
                plan.dropout.output(a, ad.dropout, j, rows),
                ad.A.index_select(1, rows).t(),
            )

    kh = vh = None
    inputs, out = (
        (send_inputs(0) if n else None),
        None,
    )  # in flight: the next stage's inputs, the last output
    for i in range(n):
        q_sent, kv_sent = inputs
        if kv_sent is not None:
            kh, vh = kv_sent[0].wait(), kv_sent[1].wait()  # [B, S, kc, D]
            if plan.save:
                saved += [kh, vh]
        qh = q_sent.wait()  # [B, S, c, D]
        inputs = send_inputs(i + 1) if ov and i + 1 < n else None
        oh, lse = plan.kernel.forward(qh, kh, vh, scale=plan.scale, causal=True)
        del qh
        if plan.save:
            saved += [oh, lse]
        if out is not None:
            o_proj(*out)
        out = (i, start_head_to_seq(oh, group, ov))  # -> [B, s, P, c, D]
        del oh
        if not ov:
            o_proj(*out)
            out = None
            if layout.ends_kv_group(i):
                kh = vh = None
            if i + 1 < n:
                inputs = send_inputs(i + 1)
    if out is not None:
        o_proj(*out)
    for ad, z in zip(w.o.adapters, za):
        y.add_(z @ ad.B.t(), alpha=ad.scaling)
    if w.o.bias is not None:
        y.add_(w.o.bias)
    return y, xas, za, (sides["q"].inv_rms, sides["k"].inv_rms), saved


class _FusedFunction(torch.autograd.Function):
    """Autograd wrapper of the fused block; inputs: x, cos, sin, (weights, plan), *weights.tensors()."""

    @staticmethod
    def forward(ctx, x, cos, sin, static, *tensors):
        w, plan = static
        y, xas, za, inv_rms, saved = _fused_forward(x, cos, sin, w, plan)
        flat_xas = [t for name in "qkv" for t in xas[name]]
        ctx.has_rms = [t is not None for t in inv_rms]
        ctx.save_for_backward(
            x, cos, sin, *[t for t in inv_rms if t is not None], *flat_xas, *za, *saved
        )
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
            xas[name], k = rest[k : k + n], k + n
        za, saved = rest[k : k + ctx.counts[3]], rest[k + ctx.counts[3] :]
        grads = Grads(w.tensors(), list(ctx.needs_input_grad[4:]))
        dx = fused_backward(dy.contiguous(), x, cos, sin, w, plan, xas, za, inv_rms, grads, saved)
        return (dx if ctx.needs_input_grad[0] else None, None, None, None, *grads.buf)


def _positions(positions, group, x: torch.Tensor) -> torch.Tensor:
    """The shard's global token indices [s]: given, returned by the given function, or contiguous shards'."""
    if positions is None:
        return shard_positions(group, x.shape[1], x.device)
    return positions() if callable(positions) else positions


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
    overlap: bool = False,
    positions: torch.Tensor | Callable[[], torch.Tensor] | None = None,
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
        overlap: issue the backward's all-to-alls one stage ahead, asynchronously, as the forward's are whenever
            a backward follows, so they run during the neighbouring stage's kernel (module docstring): one more
            stage of buffers in the backward, the same result.
        positions: the global token indices [s] of the shard's tokens, which LoRA dropout draws its masks by
            (`hf_upipe.ops.lora_dropout`), or a function that returns them (called only when LoRA dropout is
            on, so nothing is allocated without it); None: contiguous shards, rank r of `group` holding
            r*s .. r*s+s-1.

    Returns:
        y [B, s, Dm], the o_proj output (bias and LoRA included).
    """
    layout = HeadLayout(num_heads, num_kv_heads, group_size(group), heads_per_chunk)
    kern = get_kernel(kernel, x.device, x.dtype) if isinstance(kernel, str) else kernel
    dropout = any(
        a.dropout > 0 for p in (weights.q, weights.k, weights.v, weights.o) for a in p.adapters
    )
    tensors = weights.tensors()
    backward = torch.is_grad_enabled() and (
        x.requires_grad or any(t.requires_grad for t in tensors)
    )
    plan = make_plan(
        layout,
        group,
        kern,
        head_dim**-0.5 if scale is None else scale,
        head_dim,
        _positions(positions, group, x) if dropout else None,  # allocated only for dropout
        dropout,
        save_attention and backward,
        overlap and backward,  # nothing kept without backward
        overlap_forward=backward,
        device=x.device,
    )
    if backward:
        return _FusedFunction.apply(x, cos, sin, (weights, plan), *tensors)
    return _fused_forward(x, cos, sin, weights, plan)[0]
