"""The fused UPipe block's backward: the stage loop that turns dy into dx and the gradients of the block's tensors.

Entry points (used by `hf_upipe.ops.fused_attention`'s autograd function):
- `fused_backward(dy, x, cos, sin, w, plan, xas, za, inv_rms, grads, saved)`: returns dx [B, s, Dm] and fills
  `grads`.
- `Grads`: gradient buffers of the tensors that need one; `linear_backward`: the gradients of one projection's rows.

`fused_backward` runs the steps of `_Backward`, which holds what every step reads: the stage loop (`stage_loop`,
each stage's sends in `issue`, its gradients in `o_grads` / `input_grads`), then a whole-projection norm's coupled
term (`norm_correction`) and the LoRA A sides (`lora_a_sides`). The LoRA dropout masks are the plan's
(`hf_upipe.ops.lora_dropout.LoraDropout`), the ones the forward applied.

The two modes (recompute, save) and the overlap schedule are described in `hf_upipe.ops.fused_attention`. Legend
as there.
"""

from __future__ import annotations

import torch

from hf_upipe.ops.all_to_all import Pending, start_head_to_seq, start_seq_to_head
from hf_upipe.ops.block_weights import AttentionWeights, ProjectionNorm
from hf_upipe.ops.fused_stages import (
    StagePlan,
    block_sides,
    head_rows,
    project_rows,
    projection_features,
)
from hf_upipe.ops.head_transforms import correction, post, post_backward
from hf_upipe.ops.tiled_backward import tiled_backward

__all__ = ["Grads", "fused_backward", "linear_backward"]


class Grads:
    """Gradient buffers of the block's tensors that need one (None for frozen ones)."""

    def __init__(self, tensors: list[torch.Tensor], needs: list[bool]):
        self._pos = {id(t): i for i, t in reversed(list(enumerate(tensors)))}
        self.buf: list[torch.Tensor | None] = [
            torch.zeros_like(t) if n else None for t, n in zip(tensors, needs)
        ]

    def get(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else self.buf[self._pos[id(t)]]


def linear_backward(x2, proj, rows, d_pre2, xas, ts, grads: Grads, dx2) -> None:
    """Gradients of `project_rows` for rows R given d_pre2 [N, R]: dx2 [N, Dm] += ..., weight/bias rows, LoRA B rows,
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


def fused_backward(
    dy, x, cos, sin, w: AttentionWeights, plan: StagePlan, xas, za, inv_rms, grads: Grads, saved=()
) -> torch.Tensor:
    """The backward stage loop; returns dx and fills `grads`. `saved`: the forward's stage outputs (save mode)."""
    back = _Backward(dy, x, cos, sin, w, plan, xas, za, inv_rms, grads, saved)
    back.stage_loop()
    back.norm_correction()
    back.lora_a_sides()
    return back.dx


class _Backward:
    """One call's backward: the tensors every step reads, and the steps of the stage loop as methods.

    Built from the forward's saved tensors: the q/k sides with their norms, the LoRA A-side accumulators `ts`
    ({"q"|"k"|"v": [N, r] per adapter}, finished in `lora_a_sides`), `us` (dy @ Bo * s per o adapter [N, r]) and in
    save mode the stages' kept tensors (`kept[i]` = ((kh, vh) or None, oh, lse))."""

    def __init__(self, dy, x, cos, sin, w, plan, xas, za, inv_rms, grads, saved):
        self.x, self.cos, self.sin, self.w, self.plan = x, cos, sin, w, plan
        self.xas, self.grads = xas, grads
        self.layout, self.D, self.group, self.style = plan.layout, plan.D, plan.group, w.rope
        B, s, Dm = self.shape = x.shape
        self.P = self.layout.sp_size
        self.x2, self.dy2 = x.reshape(B * s, Dm), dy.reshape(B * s, -1)
        self.dx = torch.zeros_like(x)
        self.dx2 = self.dx.view(B * s, Dm)
        self.sides = block_sides(x, w, plan, xas, inv_rms)
        # per-token sums of a whole-projection norm's coupled term [B, s, 1] (None for other norms)
        self.sigma = {
            n: x.new_zeros(B, s, 1, dtype=torch.float32)
            if isinstance(self.sides[n].norm, ProjectionNorm)
            else None
            for n in "qk"
        }
        self.ts = {
            name: [x.new_zeros(B * s, a.A.shape[0]) for a in getattr(w, name).adapters]
            for name in "qkv"
        }
        if (g := grads.get(w.o.bias)) is not None:
            g.add_(self.dy2.sum(0))
        self.us = []  # dy @ Bo * s for each o adapter: [N, r]
        for ad, z in zip(w.o.adapters, za):
            if (g := grads.get(ad.B)) is not None:
                g.add_((self.dy2.t() @ z.reshape(B * s, -1)) * ad.scaling)
            self.us.append((self.dy2 @ ad.B) * ad.scaling)
        self.ov = plan.overlap
        # Wo's gradients need each stage's output in the local layout; without them (Wo frozen and no o_proj
        # adapter, e.g. PEFT's default LoRA targets q_proj, v_proj) the output is not sent back at all
        self.needs_out = grads.get(w.o.weight) is not None or any(
            grads.get(ad.A) is not None for ad in w.o.adapters
        )
        # save mode: per stage, (kh, vh) kept at a k/v chunk's first stage (else None), oh, lse (`_fused_forward`)
        self.kept, rest = [], list(saved)
        for i in range(self.layout.num_stages if plan.save else 0):
            kv = (rest.pop(0), rest.pop(0)) if self.layout.starts_kv_group(i) else None
            self.kept.append((kv, rest.pop(0), rest.pop(0)))

    def send_qkv(self, i):
        """Stage i's q (and k/v at a chunk's first stage, unless kept), recomputed and sent -> [B, S, c (kc), D]."""
        x, w, sides, D, group, style = self.x, self.w, self.sides, self.D, self.group, self.style
        (B, s, _), P, xas = self.shape, self.P, self.xas
        kv = None
        if self.layout.starts_kv_group(i) and not self.plan.save:
            kv_rows = head_rows(self.plan.kv_heads[i], D)
            k5 = post(
                sides["k"],
                project_rows(x, w.k, kv_rows, xas["k"]),
                kv_rows,
                self.cos,
                self.sin,
                D,
                style,
            )  # [B, s, P*kc, D]
            kv = (
                start_seq_to_head(k5.view(B, s, P, -1, D), group, True),
                start_seq_to_head(
                    project_rows(x, w.v, kv_rows, xas["v"]).view(B, s, P, -1, D), group, True
                ),
            )
            del k5
        rows = head_rows(self.plan.q_heads[i], D)
        q5 = post(
            sides["q"], project_rows(x, w.q, rows, xas["q"]), rows, self.cos, self.sin, D, style
        )  # [B, s, P*c, D]
        return start_seq_to_head(q5.view(B, s, P, -1, D), group, True), kv

    def send_dout(self, i):
        """d a_i = dy @ Wo[:, R] (+ LoRA) [N, P*c*D], sent to the head layout -> [B, S, c, D]."""
        (B, s, _), plan, w = self.shape, self.plan, self.w
        rows = head_rows(plan.q_heads[i], self.D)
        da = self.dy2 @ w.o.weight.index_select(1, rows)
        for j, (ad, u) in enumerate(zip(w.o.adapters, self.us)):
            da.add_(plan.dropout.output(u @ ad.A.index_select(1, rows), ad.dropout, j, rows))
        return start_seq_to_head(da.view(B, s, self.P, -1, self.D), self.group, True)

    def o_grads(self, i, a):
        """Wo's column gradients (and its LoRA A's) from stage i's output a [N, P*c*D]."""
        plan, w, grads = self.plan, self.w, self.grads
        rows = head_rows(plan.q_heads[i], self.D)
        if (g := grads.get(w.o.weight)) is not None:
            g.index_add_(1, rows, self.dy2.t() @ a)
        for j, (ad, u) in enumerate(zip(w.o.adapters, self.us)):
            if (g := grads.get(ad.A)) is not None:
                g.index_add_(1, rows, u.t() @ plan.dropout.output(a, ad.dropout, j, rows))

    def input_grads(self, items):
        """[(name, rows, dh [B, S, h, D] or its Pending)], consumed in order: dx, weight rows."""
        B, s, _ = self.shape
        x, D, xas = self.x, self.D, self.xas
        while items:
            # a tensor not yet sent: dq alone, or dk with dv, so that only one receive buffer of dq is live at once
            if not isinstance(items[0][2], Pending):
                k = 1 if items[0][0] == "q" else len(items)
                items[:k] = [
                    (nm, r, start_head_to_seq(t, self.group, True)) for nm, r, t in items[:k]
                ]
            name, r, dh = items.pop(0)
            d5 = dh.wait().reshape(B, s, -1, D)
            del dh  # [B, s, P*c (or P*kc), D]
            proj = getattr(self.w, name)
            d_pre = (
                d5.reshape(B * s, -1)
                if name == "v"
                else post_backward(
                    self.sides[name],
                    lambda: project_rows(x, proj, r, xas[name]),
                    r,
                    self.cos,
                    self.sin,
                    D,
                    self.style,
                    d5,
                    self.grads,
                    self.sigma[name],
                )
            )
            del d5
            linear_backward(
                self.x2,
                proj,
                r,
                d_pre.reshape(B * s, -1),
                xas[name],
                self.ts[name],
                self.grads,
                self.dx2,
            )
            del d_pre

    def finish(self, i, out_sent, items):
        """Overlap: stage i's Wo gradients and input gradients, once they are back."""
        if out_sent is not None:
            self.o_grads(i, out_sent.wait().reshape(self.shape[0] * self.shape[1], -1))
        self.input_grads(items)

    def issue(self, i):
        """Stage i's inputs, in flight together: q (k/v), d a, and in save mode its output."""
        plan = self.plan
        if not (self.ov or plan.save):
            # recompute mode, in order: the output, then d a, after the kernel forward
            return self.send_qkv(i), None, None
        # in this order: the output's buffers after q's projection's peak
        qkv, dout = self.send_qkv(i), self.send_dout(i)
        out = (
            start_head_to_seq(self.kept[i][1], self.group, True)
            if plan.save and self.needs_out
            else None
        )
        return qkv, dout, out

    # Every all-to-all is issued asynchronously, those a step needs together, so the ranks meet once per group (at
    # its first wait) rather than once per tensor; each group is what the memory peak allows (the simulation in
    # benchmarks/attention_memory.py shows every peak as with one tensor at a time). Without overlap each stage
    # runs in order: save mode {q, d a, saved output}, o_proj's gradients, kernel backward, {dq}, {dk, dv} at a k/v
    # chunk's end; recompute mode {q (k, v)}, kernel forward, {output}, o_proj's gradients, {d a}, kernel
    # backward, {dq}, {dk, dv}. With overlap, stage i+1's inputs are in flight during stage i's kernel, and stage i's
    # gradients (and output) during stage i+1's.
    def stage_loop(self) -> None:
        """Every stage's kernel backward, with its all-to-alls and the gradients of its rows."""
        layout, plan, ov = self.layout, self.plan, self.ov
        N = self.shape[0] * self.shape[1]
        self.kh = self.vh = self.dk_sum = self.dv_sum = None
        nxt = self.issue(0) if ov and layout.num_stages else None
        prev = None  # overlap: (stage, output in flight, gradients in flight) of the previous stage
        for i in range(layout.num_stages):
            (q_sent, kv_sent), dout_sent, out_sent = nxt if ov else self.issue(i)
            if kv_sent is not None:
                self.kh, self.vh = kv_sent[0].wait(), kv_sent[1].wait()  # [B, S, kc, D]
            elif plan.save and self.kept[i][0] is not None:
                self.kh, self.vh = self.kept[i][0]  # [B, S, kc, D], kept by the forward
            qh = q_sent.wait()  # [B, S, c, D]
            nxt = self.issue(i + 1) if ov and i + 1 < layout.num_stages else None
            if plan.save:
                oh, lse = self.kept[i][1:]
            else:  # recomputed
                oh, lse = plan.kernel.forward(qh, self.kh, self.vh, scale=plan.scale, causal=True)
            if self.needs_out and out_sent is None:
                out_sent = start_head_to_seq(oh, self.group, True)
            if not (ov or plan.save) and out_sent is not None:
                # recompute in order: the output's buffers go before d a's come (one chunk's at a time: with all
                # of a rank's heads in one chunk, both at once would add a [S, c, D] buffer to the step's peak)
                self.o_grads(i, out_sent.wait().reshape(N, -1))
                out_sent = None
            dout_sent = dout_sent or self.send_dout(i)
            doh = dout_sent.wait()
            if not ov:
                if out_sent is not None:
                    self.o_grads(i, out_sent.wait().reshape(N, -1))
                out_sent = None
            dqh, dkh, dvh = tiled_backward(
                plan.kernel, doh, qh, self.kh, self.vh, oh, lse, scale=plan.scale, causal=True
            )
            del qh, oh, doh
            items = self.stage_gradients(i, dqh, dkh, dvh)
            del dqh, dkh, dvh
            if not ov:
                self.input_grads(items)
                continue
            if prev is not None:
                self.finish(*prev)
            prev = (i, out_sent, items)
            del items, out_sent
        if prev is not None:
            self.finish(*prev)

    def stage_gradients(self, i, dqh, dkh, dvh) -> list:
        """Stage i's head-layout gradients as input_grads' items (sent now with overlap, else when consumed).

        Recompute mode: every gradient goes straight back to the local layout and into dx / the weights, no
        accumulators (the stages sharing a k/v chunk each send their dk/dv partial; the linear backward sums them).
        Save mode: dk/dv are summed over the chunk's stages here [B, S, kc, D] and sent once, at its end."""
        layout, plan = self.layout, self.plan
        if layout.ends_kv_group(i):
            self.kh = self.vh = None
        if plan.save:
            self.dk_sum = dkh if self.dk_sum is None else self.dk_sum.add_(dkh)
            self.dv_sum = dvh if self.dv_sum is None else self.dv_sum.add_(dvh)
            dkh = dvh = None
            if layout.ends_kv_group(i):
                dkh, dvh, self.dk_sum, self.dv_sum = self.dk_sum, self.dv_sum, None, None
        rows, kv_rows = head_rows(plan.q_heads[i], self.D), head_rows(plan.kv_heads[i], self.D)
        return [
            (n, r, start_head_to_seq(t, self.group, True) if self.ov else t)
            for n, r, t in (("q", rows, dqh), ("k", kv_rows, dkh), ("v", kv_rows, dvh))
            if t is not None
        ]

    def norm_correction(self) -> None:
        """A whole-projection norm's coupled term, d pre += factor * pre, over the distinct rows a chunk at a time."""
        B, s, _ = self.shape
        x, plan = self.x, self.plan
        for name in "qk":
            if self.sigma[name] is None:
                continue
            factor = correction(self.sides[name], self.sigma[name], projection_features(plan, name))
            proj, n = getattr(self.w, name), None
            for r in torch.arange(projection_features(plan, name), device=x.device).split(
                plan.chunk_rows
            ):
                # [B, s, len(r)]
                n = (factor * project_rows(x, proj, r, self.xas[name]).float()).to(x.dtype)
                linear_backward(
                    self.x2,
                    proj,
                    r,
                    n.reshape(B * s, -1),
                    self.xas[name],
                    self.ts[name],
                    self.grads,
                    self.dx2,
                )
            del n

    def lora_a_sides(self) -> None:
        """LoRA A sides of q/k/v: one product with x (or dropout(x)) each, after the loop."""
        drop, streams = self.plan.dropout, self.w.lora_streams()
        for name in "qkv":
            for a, t, k in zip(getattr(self.w, name).adapters, self.ts[name], streams[name]):
                if (g := self.grads.get(a.A)) is not None:
                    g.add_(t.t() @ drop.inputs(self.x2, a.dropout, k))
                self.dx2.add_(drop.inputs(t @ a.A, a.dropout, k))
