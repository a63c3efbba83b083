"""UPipe: headwise-chunked sequence-parallel attention (Untied Ulysses, arXiv 2602.21196).

Entry points:
- `upipe_attention(q, k, v, *, group, heads_per_chunk=1, kernel="auto", scale=None, sinks=None)`: the public op.
- `UPipeAttentionFunction`: its autograd Function (ctx handling only).
- `upipe_attention_forward(...)` / `upipe_attention_backward(...)`: the plain stage loops.

Legend: B batch, s local tokens, S = P*s full sequence, P ranks in `group`, H / Hk query / key-value heads of the
model, c = heads_per_chunk query heads per rank per stage, kc key-value heads per rank per stage, D head dim.
Each rank holds its contiguous sequence shard of q [B, s, H, D], k/v [B, s, Hk, D] (RoPE already applied with
global positions). `HeadLayout` says which heads each stage moves.

The flow (forward), per stage i:
1. at the first stage of a key-value chunk: all-to-all that chunk's k/v heads -> kh, vh [B, S, kc, D];
2. all-to-all this stage's q heads -> qh [B, S, c, D] (rank r gets model heads r*H/P + i*c + j);
3. (oh, lse_i) = kernel(qh, kh, vh), causal over the full sequence;
4. all-to-all oh back and copy it into the preallocated local output out [B, s, H, D].
Only one stage's buffers are alive at a time: Ulysses holds all H/P heads' buffers at once.

Attention sinks (GPT-OSS, MiMo-V2-Flash, Flint: one learned logit s_h per head, a key of value 0 every query sees)
come from the log-sum-exp, exactly: with lse' = logaddexp(lse, s_h) the output is oh * exp(lse - lse'), and the
kernel's own backward given (that output, lse') is the gradient of attention with the sink (its softmax is the
sink-inclusive one, its row sums D = rowsum(dO * O) those of the sunk output). The sink's gradient is
-sum_i exp(s_h - lse'_i) * D_i over the full sequence, on the rank that holds head h; the parameter's gradient is
the sum over the SP group, as for every other parameter.

Backward (no attention recompute). Saved: the local q, the local output (which o_proj saves too, so it costs
nothing extra), the per-stage log-sum-exps, and k/v as the head-layout chunks the forward received (the same
bytes as the local k/v when there is no k/v replication; with replication, Hk < P, the local k/v). Per stage it
re-sends q, out and dout (and k/v only when replicated), runs the kernel's backward, and sends dq back as one
[B, s, P, c, D] chunk; the chunks are stacked into dq once, after the loop, so no full-size dq coexists with
stage buffers. dk/dv of the stages sharing a k/v chunk are summed in the first stage's kernel output (input
dtype: no float32 accumulators) and sent back once per chunk. No tensor of all heads over the full sequence
ever exists.

Cost: the backward repeats the forward's all-to-all of q and adds out and dout: about 1.5-2x the all-to-all bytes
of Ulysses' backward (UPipe paper, communication table); no attention recompute. Precision: with 16-bit inputs,
dk/dv partial sums over stages are rounded to the input dtype once per stage, as with k/v replication in any
Ulysses implementation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from hf_upipe.ops.all_to_all import group_size, head_to_seq, seq_to_head
from hf_upipe.ops.head_layout import HeadLayout
from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.tiled_backward import tiled_backward

__all__ = [
    "UPipeAttentionFunction",
    "upipe_attention",
    "upipe_attention_backward",
    "upipe_attention_forward",
]


def _kv_stage(t: torch.Tensor, layout: HeadLayout, stage: int) -> torch.Tensor:
    """The k/v heads every rank needs at `stage`: t [B, s, Hk, D] -> [B, s, P, kc, D] (block p for rank p)."""
    B, s, _, D = t.shape
    index = layout.kv_source_index(stage, t.device)
    if index is None:
        return t.view(B, s, layout.sp_size, layout.kv_per_rank, D)[:, :, :, layout.kv_heads(stage)]
    return t.index_select(2, index).view(
        B, s, layout.sp_size, layout.kv_per_stage, D
    )  # replicated heads


def _q_stage(t: torch.Tensor, layout: HeadLayout, stage: int) -> torch.Tensor:
    """The query-shaped heads of `stage`: t [B, s, H, D] -> [B, s, P, c, D] (a view)."""
    B, s, _, D = t.shape
    return t.view(B, s, layout.sp_size, layout.q_per_rank, D)[:, :, :, layout.q_heads(stage)]


def _stage_heads(layout: HeadLayout, group, stage: int, device) -> torch.Tensor:
    """Model heads this rank computes at `stage` in the head layout: r*H/P + stage*c + j, j < c. [c]"""
    rank = dist.get_rank(group) if group is not None and group_size(group) > 1 else 0
    sl = layout.q_heads(stage)
    return torch.arange(sl.start, sl.stop, device=device) + rank * layout.q_per_rank


def _stage_sinks(sinks: torch.Tensor, layout: HeadLayout, group, stage: int) -> torch.Tensor:
    """The sink logits [c] (fp32) of the heads this rank computes at `stage`."""
    return sinks.float().index_select(0, _stage_heads(layout, group, stage, sinks.device))


def upipe_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: HeadLayout,
    group: dist.ProcessGroup | None,
    kernel: AttentionKernel,
    scale: float,
    keep_kv: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Stage loop of the forward (`sinks` [H]: per-head sink logits, or None).

    Returns:
        out [B, s, H, D] contiguous; one log-sum-exp [B, c, S] (fp32; with sinks, including them) per stage; with
        `keep_kv`, the head-layout k/v of every k/v chunk [kh_0, vh_0, kh_1, ...] (each [B, S, kc, D]), else [].
    """
    B, s, H, D = q.shape
    out = q.new_empty(B, s, H, D)
    lses, kept = [], []
    kh = vh = None
    for i in range(layout.num_stages):
        if layout.starts_kv_group(i):
            kh = vh = None  # free the previous chunk (unless kept) before receiving the next
            kh = seq_to_head(_kv_stage(k, layout, i), group)  # [B, S, kc, D]
            vh = seq_to_head(_kv_stage(v, layout, i), group)
            if keep_kv:
                kept += [kh, vh]
        qh = seq_to_head(_q_stage(q, layout, i), group)  # [B, S, c, D]
        oh, lse = kernel.forward(qh, kh, vh, scale=scale, causal=True)  # [B, S, c, D], [B, c, S]
        del qh
        if sinks is not None:  # lse' = logaddexp(lse, s_h): the sink is one more logit of every row
            sunk = torch.logaddexp(
                lse.float(), _stage_sinks(sinks, layout, group, i)[None, :, None]
            )  # [B, c, S]
            oh = (oh.float() * (lse.float() - sunk).exp().transpose(1, 2).unsqueeze(-1)).to(
                oh.dtype
            )
            lse = sunk.to(lse.dtype)
        _q_stage(out, layout, i).copy_(head_to_seq(oh, group))  # [B, s, P, c, D] into the output
        del oh
        lses.append(lse)
    return out, lses, kept


def _scatter_kv(dst: torch.Tensor, grad5: torch.Tensor, layout: HeadLayout, stage: int) -> None:
    """Write a stage's k/v gradient grad5 [B, s, P, kc, D] into dst [B, s, Hk, D] (summing replicas)."""
    B, s, _, D = dst.shape
    index = layout.kv_source_index(stage, dst.device)
    if index is None:
        dst.view(B, s, layout.sp_size, layout.kv_per_rank, D)[
            :, :, :, layout.kv_heads(stage)
        ].copy_(grad5)
    else:
        dst.index_add_(2, index, grad5.reshape(B, s, -1, D).to(dst.dtype))  # [B, s, P*kc, D]


def upipe_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lses: list[torch.Tensor],
    layout: HeadLayout,
    group: dist.ProcessGroup | None,
    kernel: AttentionKernel,
    scale: float,
    *,
    kv_like: tuple[torch.Size, torch.dtype, torch.device],
    kv_local: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_chunks: list[torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stage loop of the backward: dout [B, s, H, D] -> dq [B, s, H, D], dk/dv [B, s, Hk, D], and with `sinks` [H]
    their gradient [H] (fp32; this rank's heads of the head layout, zero elsewhere).

    k/v come either as `kv_local` (k, v) [B, s, Hk, D], re-sent per k/v chunk, or as `kv_chunks`, the head-layout
    chunks kept by the forward ([kh_0, vh_0, kh_1, ...], each [B, S, kc, D]). `kv_like` is dk/dv's (shape, dtype,
    device).

    Memory: dq is gathered per stage (one [B, s, P, c, D] receive buffer each) and assembled once at the end, so
    no full-size dq exists while stage buffers do; dk/dv partials of the stages sharing a k/v chunk are summed in
    the kernel's output buffer (input dtype), and only replicated k/v heads (Hk < P, the smallest tensors here)
    are summed over replicas in float32.
    """
    B, s, H, D = q.shape
    kv_shape, kv_dtype, device = kv_like
    assert (kv_local is None) != (kv_chunks is None), "pass exactly one of kv_local, kv_chunks"
    if layout.kv_rep > 1:  # one contribution per replica: sum from zero (fp32 for 16-bit inputs)
        acc = torch.float32 if kv_dtype in (torch.float16, torch.bfloat16) else kv_dtype
        dk = torch.zeros(kv_shape, dtype=acc, device=device)
        dv = torch.zeros(kv_shape, dtype=acc, device=device)
    else:  # every slot is written exactly once, at the end of its chunk
        dk = dv = None
    dq_chunks = []
    dsinks = (
        None
        if sinks is None
        else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    )
    kh = vh = dkh = dvh = None
    for i in range(layout.num_stages):
        if layout.starts_kv_group(i):
            kh = vh = None
            if kv_chunks is not None:
                kh, vh = (
                    kv_chunks[2 * layout.kv_group_of(i)],
                    kv_chunks[2 * layout.kv_group_of(i) + 1],
                )
            else:
                kh = seq_to_head(_kv_stage(kv_local[0], layout, i), group)  # [B, S, kc, D]
                vh = seq_to_head(_kv_stage(kv_local[1], layout, i), group)
        qh = seq_to_head(_q_stage(q, layout, i), group)  # [B, S, c, D]
        oh = seq_to_head(_q_stage(out, layout, i), group)
        doh = seq_to_head(_q_stage(dout, layout, i), group)
        dqh, dkh_i, dvh_i = tiled_backward(
            kernel, doh, qh, kh, vh, oh, lses[i], scale=scale, causal=True
        )
        if (
            dsinks is not None
        ):  # d s_h = -sum_i exp(s_h - lse'_i) * rowsum(dO * O)_i  (module docstring)
            rows = (doh.float() * oh.float()).sum(-1).transpose(1, 2)  # [B, c, S]
            p_sink = (_stage_sinks(sinks, layout, group, i)[None, :, None] - lses[i].float()).exp()
            dsinks.index_add_(
                0, _stage_heads(layout, group, i, dsinks.device), -(p_sink * rows).sum((0, 2))
            )
        del qh, oh, doh
        dq_chunks.append(head_to_seq(dqh, group))  # [B, s, P, c, D]
        del dqh
        if dkh is None:  # first stage of the chunk: its gradients become the running sums
            dkh, dvh = dkh_i, dvh_i
        else:
            dkh.add_(dkh_i)
            dvh.add_(dvh_i)
        del dkh_i, dvh_i
        if layout.ends_kv_group(i):
            kh = vh = None
            if dk is None:
                dk = torch.empty(kv_shape, dtype=kv_dtype, device=device)
                dv = torch.empty(kv_shape, dtype=kv_dtype, device=device)
            _scatter_kv(dk, head_to_seq(dkh, group), layout, i)
            _scatter_kv(dv, head_to_seq(dvh, group), layout, i)
            dkh = dvh = None
    # [B, s, P, n, c, D] -> [B, s, H, D]: head r*H/P + i*c + j sits at [r, i, j]
    dq = torch.stack(dq_chunks, dim=3).view(B, s, H, D)
    return dq, dk.to(kv_dtype), dv.to(kv_dtype), dsinks


class UPipeAttentionFunction(torch.autograd.Function):
    """Autograd wrapper; see the module docstring for what is saved and recomputed.

    Saved: q, out, the per-stage log-sum-exps, and k/v: the head-layout chunks the forward received when there is
    no k/v replication (the same bytes as the local k/v, and the backward needs no k/v all-to-all), else the
    local k/v (replicated head-layout copies would be P/Hk times larger).
    """

    @staticmethod
    def forward(
        ctx, q, k, v, layout: HeadLayout, group, kernel: AttentionKernel, scale: float, sinks=None
    ):
        keep_kv = layout.kv_rep == 1
        out, lses, kept = upipe_attention_forward(
            q, k, v, layout, group, kernel, scale, keep_kv=keep_kv, sinks=sinks
        )
        kv = kept if keep_kv else [k, v]
        ctx.save_for_backward(q, out, *lses, *kv)
        ctx.sinks = sinks  # a parameter: not a saved tensor (FSDP2 frees and refills its storage in between)
        ctx.n_lse, ctx.keep_kv = len(lses), keep_kv
        ctx.layout, ctx.group, ctx.kernel, ctx.scale = layout, group, kernel, scale
        ctx.kv_like = (k.shape, k.dtype, k.device)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, out, *rest = ctx.saved_tensors
        sinks = ctx.sinks
        lses, kv = rest[: ctx.n_lse], rest[ctx.n_lse :]
        kv_args = dict(kv_chunks=kv) if ctx.keep_kv else dict(kv_local=tuple(kv))
        dq, dk, dv, dsinks = upipe_attention_backward(
            dout,
            q,
            out,
            lses,
            ctx.layout,
            ctx.group,
            ctx.kernel,
            ctx.scale,
            kv_like=ctx.kv_like,
            sinks=sinks,
            **kv_args,
        )
        dsinks = None if dsinks is None or not ctx.needs_input_grad[7] else dsinks.to(sinks.dtype)
        return dq, dk, dv, None, None, None, None, dsinks


def upipe_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    heads_per_chunk: int | None = 1,
    kernel: str | AttentionKernel = "auto",
    scale: float | None = None,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a sequence sharded contiguously across the ranks of `group`, heads in chunks.

    Args:
        q: [B, s, H, D] this rank's tokens (RoPE applied with global positions), any strides.
        k, v: [B, s, Hk, D], H % Hk == 0 (grouped-query attention; each query head meets its own k/v head).
        group: the sequence-parallel group (None or size 1: local attention).
        heads_per_chunk: query heads per rank per stage (1 = least memory); None = all local heads (Ulysses).
        kernel: "auto", a kernel name, or an `AttentionKernel`.
        scale: softmax scale, default D**-0.5.
        causal: must be True (the only mask this op implements).
        sinks: [H] per-head attention-sink logits (GPT-OSS's `sinks`), or None; gradients flow to them.

    Under autocast, q, k and v are cast to the autocast dtype first, as `scaled_dot_product_attention` casts them.

    Returns:
        out [B, s, H, D] contiguous.

    Raises:
        ValueError: shapes that do not match, or a head geometry the group size cannot split (the message names
            the sp sizes and heads_per_chunk values that work). Every rank sees the same shapes, so every rank
            raises, before any collective.
    """
    if not causal:
        raise NotImplementedError(
            "upipe_attention implements causal attention only (decoder language models)."
        )
    if (
        q.dim() != 4
        or k.shape != v.shape
        or k.dim() != 4
        or q.shape[0] != k.shape[0]
        or q.shape[1] != k.shape[1]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"upipe_attention expects q [B, s, H, D] and k, v [B, s, Hk, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    if torch.is_autocast_enabled(
        q.device.type
    ):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
        )  # (differentiable: their gradients come back in theirs)
    layout = HeadLayout(q.shape[2], k.shape[2], group_size(group), heads_per_chunk)
    kern = get_kernel(kernel, q.device, q.dtype) if isinstance(kernel, str) else kernel
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(
            f"sinks must be one logit per query head, shape ({q.shape[2]},); got {tuple(sinks.shape)}"
        )
    grads = [q, k, v] + ([] if sinks is None else [sinks])
    if torch.is_grad_enabled() and any(t.requires_grad for t in grads):
        return UPipeAttentionFunction.apply(q, k, v, layout, group, kern, scale, sinks)
    return upipe_attention_forward(q, k, v, layout, group, kern, scale, sinks=sinks)[0]
