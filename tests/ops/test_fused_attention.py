"""Fused UPipe attention block vs the same block computed by plain autograd in one process.

Random non-symmetric weights with q/k/v/o biases, per-head QK-norm and LoRA adapters on all four projections;
output and the gradients of x and of every tensor (frozen base weights get none), fp32 tight, bf16 within 2x the
plain bf16 block's own error plus one bf16 ulp. The architecture variants: a norm over the whole q/k projection
(OLMo 2), interleaved RoPE in fp32 (Cohere), partial rotary and a fused qkv projection whose LoRA adapter shares
one A (Phi-3), no RoPE (SmolLM3's NoPE layers); the reference implements each from its definition.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_upipe.ops.all_to_all import Pending
from hf_upipe.ops.fused_attention import (
    AttentionWeights,
    HeadNorm,
    LoraAdapter,
    Projection,
    ProjectionNorm,
    RopeStyle,
    fused_upipe_attention,
)
from hf_upipe.ops.head_layout import valid_heads_per_chunk
from tests._dist import run_distributed


def _rms(weight, eps=1e-6):
    def fn(t):  # Qwen3RMSNorm's math, computed in at least float32 (float64 stays float64)
        tf = t.to(torch.promote_types(t.dtype, torch.float32))
        return weight * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)).to(t.dtype)

    return HeadNorm(fn, (weight,))


def _ref_rope(t, cos, sin, style: RopeStyle):
    """RoPE from its definition: pairs (i, i + Dr/2), or (2i, 2i+1) when interleaved, on the first Dr dims."""
    if not style.rotate:
        return t
    Dr = cos.shape[-1]
    r, rest = t[..., :Dr], t[..., Dr:]
    if style.interleaved:
        rot = torch.stack((-r[..., 1::2], r[..., ::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-r[..., Dr // 2 :], r[..., : Dr // 2]), dim=-1)
    return torch.cat((r * cos[:, :, None] + rot * sin[:, :, None], rest), dim=-1)


def _make(gen, Dm, H, Hk, D, bias, norm, lora, frozen, dtype, opts=None):
    """Random block tensors (float64 masters) and a builder for AttentionWeights in any dtype.

    opts: "norm": "proj" (a norm over the whole projection), "qkv": True (q/k/v rows of one weight, LoRA with one
    shared A), "rope": a RopeStyle, "lora_on": the projections with an adapter (default "qkvo")."""
    opts = opts or {}

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    spec = {}
    for name, out_f, in_f in (
        ("q", H * D, Dm),
        ("k", Hk * D, Dm),
        ("v", Hk * D, Dm),
        ("o", Dm, H * D),
    ):
        spec[name] = dict(
            weight=rnd(out_f, in_f, scale=in_f**-0.5),
            bias=rnd(out_f, scale=0.3) if bias else None,
            adapters=[(rnd(3, in_f, scale=in_f**-0.5), rnd(out_f, 3, scale=0.5), 0.7)]
            if lora and name in opts.get("lora_on", "qkvo")
            else [],
        )
    if norm:
        nq, nk = (H * D, Hk * D) if opts.get("norm") == "proj" else (D, D)
        spec["q_norm"], spec["k_norm"] = 1 + rnd(nq, scale=0.3), 1 + rnd(nk, scale=0.3)
    if opts.get("qkv"):  # one weight (rows q | k | v) and, with LoRA, one A
        spec["qkv"] = dict(
            weight=torch.cat([spec[n]["weight"] for n in "qkv"]),
            A=rnd(3, Dm, scale=Dm**-0.5) if lora else None,
            B=torch.cat([spec[n]["adapters"][0][1] for n in "qkv"]) if lora else None,
        )

    def build(dtype):
        leaves = []

        def leaf(t, trainable):
            t = t.to(dtype).requires_grad_(trainable)
            leaves.append(t)
            return t

        projs = {}
        for name in "qkvo":
            p = spec[name]
            projs[name] = Projection(
                weight=leaf(p["weight"], not frozen),
                bias=None if p["bias"] is None else leaf(p["bias"], not frozen),
                adapters=tuple(
                    LoraAdapter(leaf(A, True), leaf(Bm, True), sc) for A, Bm, sc in p["adapters"]
                ),
            )
        if "qkv" in spec:  # replace q/k/v by row slices of one weight (and one shared A)
            del leaves[: len(leaves)]
            W = leaf(spec["qkv"]["weight"], not frozen)
            A = leaf(spec["qkv"]["A"], True) if lora else None
            Bq = leaf(spec["qkv"]["B"], True) if lora else None
            edges = [0, H * D, (H + Hk) * D, (H + 2 * Hk) * D]
            for n, (a, b) in zip("qkv", zip(edges, edges[1:])):
                projs[n] = Projection(W[a:b], None, (LoraAdapter(A, Bq[a:b], 0.7),) if lora else ())
            o = spec["o"]
            projs["o"] = Projection(
                leaf(o["weight"], not frozen),
                None if o["bias"] is None else leaf(o["bias"], not frozen),
                tuple(
                    LoraAdapter(leaf(A_, True), leaf(B_, True), sc) for A_, B_, sc in o["adapters"]
                ),
            )
        if opts.get("norm") == "proj":
            norms = {
                n: ProjectionNorm(leaf(spec[n], not frozen), 1e-6)
                for n in ("q_norm", "k_norm")
                if n in spec
            }
        else:
            norms = {n: _rms(leaf(spec[n], not frozen)) for n in ("q_norm", "k_norm") if n in spec}
        return AttentionWeights(**projs, **norms, rope=opts.get("rope", RopeStyle())), leaves

    return build


def _reference(x, cos, sin, w: AttentionWeights, H, Hk, D):
    """Plain autograd, whole sequence, one process: [B, S, Dm] -> [B, S, Dm]."""

    def lin(t, p):
        out = F.linear(t, p.weight, p.bias)
        for a in p.adapters:
            out = out + (t @ a.A.t()) @ a.B.t() * a.scaling
        return out

    B, S, _ = x.shape
    q, k, v = lin(x, w.q), lin(x, w.k), lin(x, w.v)
    if isinstance(w.q_norm, ProjectionNorm):  # over all H*D (Hk*D) features of a token
        q, k = (
            n.weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + n.eps))
            for t, n in ((q, w.q_norm), (k, w.k_norm))
        )
    q, k, v = q.view(B, S, H, D), k.view(B, S, Hk, D), v.view(B, S, Hk, D)
    if isinstance(w.q_norm, HeadNorm):
        q, k = w.q_norm.fn(q), w.k_norm.fn(k)
    q, k = _ref_rope(q, cos, sin, w.rope), _ref_rope(k, cos, sin, w.rope)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    return lin(o.reshape(B, S, H * D), w.o)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _tables(S, D, gen, interleaved=False):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None] + torch.rand(
        1, generator=gen, dtype=torch.float64
    )
    emb = ang.repeat_interleave(2, -1)[None] if interleaved else torch.cat([ang, ang], -1)[None]
    return emb.cos(), emb.sin()


def _block_errors(build, x, dy, cos, sin, H, Hk, D, dtype, idx, call):
    """The fused block `call(xl, cos_l, sin_l, w)` on this rank's tokens `idx` (a slice or an index) against the
    plain float64 block over the whole sequence: relative errors of y, dx and every trainable tensor's gradient
    (summed over the ranks when distributed), and in bf16 the plain bf16 block's own errors (else None)."""
    w_ref, ref_leaves = build(torch.float64)
    xr = x.clone().requires_grad_()
    y_ref = _reference(xr, cos, sin, w_ref, H, Hk, D)
    ref_grads = torch.autograd.grad(y_ref, [xr] + [t for t in ref_leaves if t.requires_grad], dy)
    w, leaves = build(dtype)
    xl = x[:, idx].to(dtype).requires_grad_()
    y = call(xl, cos[:, idx].to(dtype), sin[:, idx].to(dtype), w)
    grads = list(
        torch.autograd.grad(y, [xl] + [t for t in leaves if t.requires_grad], dy[:, idx].to(dtype))
    )
    for g in grads[1:]:  # parameter gradients: every rank holds its tokens' contribution
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(g)
    errs = [_rel(y, y_ref[:, idx]), _rel(grads[0], ref_grads[0][:, idx])] + [
        _rel(g, r) for g, r in zip(grads[1:], ref_grads[1:])
    ]
    base = None
    if dtype == torch.bfloat16:
        w16, leaves16 = build(dtype)
        x16 = x.to(dtype).requires_grad_()
        y16 = _reference(x16, cos.to(dtype), sin.to(dtype), w16, H, Hk, D)
        g16 = torch.autograd.grad(
            y16, [x16] + [t for t in leaves16 if t.requires_grad], dy.to(dtype)
        )
        base = [_rel(y16[:, idx], y_ref[:, idx]), _rel(g16[0][:, idx], ref_grads[0][:, idx])] + [
            _rel(g, r) for g, r in zip(g16[1:], ref_grads[1:])
        ]
    return errs, base, len(grads)


def _case(rank, world, group, case, save=False, overlap=False):
    B, S, Dm, H, Hk, D, chunk, bias, norm, lora, frozen, dtype, seed, *opts = case
    opts = opts[0] if opts else {}
    gen = torch.Generator().manual_seed(seed)
    build = _make(gen, Dm, H, Hk, D, bias, norm, lora, frozen, dtype, opts)
    x = torch.randn(B, S, Dm, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, S, Dm, generator=gen, dtype=torch.float64)
    cos, sin = _tables(S, opts.get("rotary", D), gen, opts.get("rope", RopeStyle()).interleaved)
    s = S // world

    def call(xl, cos_l, sin_l, w):
        return fused_upipe_attention(
            xl,
            cos_l,
            sin_l,
            w,
            num_heads=H,
            num_kv_heads=Hk,
            head_dim=D,
            group=group,
            heads_per_chunk=chunk,
            save_attention=save,
            overlap=overlap,
        )

    return _block_errors(
        build, x, dy, cos, sin, H, Hk, D, dtype, slice(rank * s, (rank + 1) * s), call
    )


def _worker(rank, world, cases, save=False, overlap=False):
    group = dist.group.WORLD if world > 1 else None
    return [_case(rank, world, group, c, save, overlap) for c in cases]


def _cases(world):
    out = []
    for i, (H, Hk) in enumerate(
        [(4, 2), (8, 8), (8, 2)] if world < 4 else [(8, 4), (8, 2), (4, 1)]
    ):
        for chunk in (1, None):
            if chunk is not None and chunk not in valid_heads_per_chunk(H, Hk, world):
                continue
            out.append(
                (
                    1 + i % 2,
                    8 * world,
                    24,
                    H,
                    Hk,
                    8,
                    chunk,
                    True,
                    i % 2 == 0,
                    True,
                    i == 1,
                    torch.float32,
                    10 * i + (chunk or 0),
                )
            )
    out.append((1, 8 * world, 24, 8, 2, 8, 1, True, True, True, False, torch.bfloat16, 99))
    out.append(
        (
            2,
            8 * world,
            16,
            4,
            4,
            4,
            2 if 2 in valid_heads_per_chunk(4, 4, world) else None,
            False,
            False,
            False,
            False,
            torch.float32,
            98,
        )
    )
    # architecture variants (GQA with replication at 4 ranks): whole-projection norm (OLMo 2), fp32 interleaved
    # partial RoPE with a fused qkv projection (Cohere / Phi-3), no RoPE (SmolLM3)
    proj, cohere_phi = (
        {"norm": "proj"},
        {"qkv": True, "rope": RopeStyle(interleaved=True, fp32=True), "rotary": 4},
    )
    out += [
        (2, 8 * world, 24, 8, 2, 8, 1, True, True, True, False, torch.float32, 60, proj),
        (1, 8 * world, 24, 4, 4, 8, None, False, True, True, False, torch.float32, 61, proj),
        (1, 8 * world, 24, 8, 2, 8, 1, False, False, True, False, torch.float32, 62, cohere_phi),
        (1, 8 * world, 24, 8, 4, 8, None, True, False, True, True, torch.float32, 63, cohere_phi),
        # (no bias: without RoPE a k bias shifts every key's score equally, so its true gradient is 0)
        (
            1,
            8 * world,
            24,
            4,
            2,
            8,
            1,
            False,
            False,
            True,
            False,
            torch.float32,
            64,
            {"rope": RopeStyle(rotate=False)},
        ),
        (1, 8 * world, 24, 8, 2, 8, 1, True, True, True, False, torch.bfloat16, 65, proj),
        # PEFT's default LoRA on Llama: adapters on q_proj and v_proj only, base frozen (no Wo gradient, so the
        # backward sends no stage output back)
        (
            1,
            8 * world,
            24,
            8,
            2,
            8,
            1,
            True,
            True,
            True,
            True,
            torch.float32,
            66,
            {"lora_on": "qv"},
        ),
    ]
    return out


def _check(cases, results):
    for per_rank in results:
        for case, (errs, base, n) in zip(cases, per_rank):
            assert len(errs) == n + 1
            for k, e in enumerate(errs):
                if base is None:
                    assert e < 1e-4, f"tensor {k}: rel err {e:.2e} in {case}"
                else:
                    assert e <= 2 * base[k] + 2**-7, (
                        f"tensor {k}: rel err {e:.2e} vs {base[k]:.2e} in {case}"
                    )


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save"])
def test_fused_single_process(save):
    cases = _cases(1)
    _check(cases, [_worker(0, 1, cases, save)])


@pytest.mark.parametrize(
    "world,save,overlap",
    [
        (2, False, False),
        (4, False, False),
        (2, True, False),
        pytest.param(4, True, False, marks=pytest.mark.slow),
        (2, True, True),
        pytest.param(4, False, True, marks=pytest.mark.slow),
    ],
    ids=["2-recompute", "4-recompute", "2-save", "4-save", "2-save-overlap", "4-recompute-overlap"],
)
def test_fused_matches_plain_block(world, save, overlap):
    # overlap in each mode at one SP size: with the bitwise equality of the two schedules (test below) and the
    # synchronous schedule's parity at both sizes, that covers every (mode, schedule, size)
    cases = _cases(world)
    _check(cases, run_distributed(_worker, world, cases, save, overlap))


def _counting_worker(rank, world):
    """Kernel forwards and all-to-all bytes of one fused fwd+bwd in each mode (H=8, Hk=2 at 2 ranks, c=1: four
    stages share each rank's k/v chunk); and the two modes' gradients agree."""
    from hf_upipe.ops import fused_attention
    from hf_upipe.ops.kernels import get_kernel

    inner = get_kernel("sdpa", torch.device("cpu"), torch.float32)
    calls = {"forward": 0, "bytes": 0}

    class Counting:
        def forward(self, *a, **k):
            calls["forward"] += 1
            return inner.forward(*a, **k)

        def backward(self, *a, **k):
            return inner.backward(*a, **k)

    original = dist.all_to_all_single

    def counted(out, inp, *a, **k):
        calls["bytes"] += inp.numel() * inp.element_size()
        return original(out, inp, *a, **k)

    gen = torch.Generator().manual_seed(4)
    builds = {
        "full": _make(gen, 24, 8, 2, 8, True, True, True, False, torch.float32),
        # PEFT's default LoRA targets: no Wo gradient, so no stage output goes back in the backward
        "lora_qv": _make(
            gen, 24, 8, 2, 8, True, True, True, True, torch.float32, {"lora_on": "qv"}
        ),
    }
    x = torch.randn(1, 8, 24, generator=gen)
    cos, sin = _tables(16, 8, gen)
    cos, sin = (t[:, rank * 8 : (rank + 1) * 8].float() for t in (cos, sin))
    out = {}
    dist.all_to_all_single = counted
    try:
        for name, build in builds.items():
            w, leaves = build(torch.float32)
            for save in (False, True):
                calls.update(forward=0, bytes=0)
                xl = x.clone().requires_grad_()
                y = fused_attention.fused_upipe_attention(
                    xl,
                    cos,
                    sin,
                    w,
                    num_heads=8,
                    num_kv_heads=2,
                    head_dim=8,
                    group=dist.group.WORLD,
                    heads_per_chunk=1,
                    kernel=Counting(),
                    save_attention=save,
                )
                grads = torch.autograd.grad(
                    y, [xl] + [t for t in leaves if t.requires_grad], torch.ones_like(y)
                )
                out[name, save] = (dict(calls), grads)
    finally:
        dist.all_to_all_single = original
    return {k: v[0] for k, v in out.items()}, {
        name: max(_rel(a, b) for a, b in zip(out[name, False][1], out[name, True][1]))
        for name in builds
    }


def test_save_mode_runs_no_attention_forward_in_backward_keeps_kv_and_sends_dk_dv_once():
    for calls, agree in run_distributed(_counting_worker, 2):
        stages = 4  # 8 query heads / 2 ranks, one per stage
        recompute, save = calls["full", False], calls["full", True]
        assert recompute["forward"] == 2 * stages and save["forward"] == stages, (recompute, save)
        # the all-to-alls differ only in the backward's k/v: dk/dv one per stage (recompute: 4 + 4) or one per k/v
        # chunk (save: 1 + 1), and k, v re-sent (recompute: 1 + 1) or kept (save: 0), each [B, S, kc, D] =
        # [1, 16, 1, 8] fp32 = 512 bytes per rank
        assert recompute["bytes"] - save["bytes"] == 8 * 512, (recompute, save)
        # without Wo's gradients no stage output [B, S, c, D] (512 bytes) is sent back, in either mode
        for save_mode in (False, True):
            full, lora = calls["full", save_mode], calls["lora_qv", save_mode]
            assert full["bytes"] - lora["bytes"] == stages * 512, (save_mode, full, lora)
        assert max(agree.values()) < 1e-5, agree


def test_lora_dropout_gradients_match_finite_differences():
    """With LoRA dropout the reference cannot reproduce the masks, so check the gradients against central finite
    differences of the fused op itself (same seed -> same masks), in float64."""
    gen = torch.Generator().manual_seed(5)
    B, S, Dm, H, Hk, D = 1, 12, 16, 4, 2, 4
    build = _make(gen, Dm, H, Hk, D, True, True, True, False, torch.float64)
    w, leaves = build(torch.float64)
    w = AttentionWeights(
        **{
            n: Projection(
                p.weight, p.bias, tuple(LoraAdapter(a.A, a.B, a.scaling, 0.3) for a in p.adapters)
            )
            for n, p in (("q", w.q), ("k", w.k), ("v", w.v), ("o", w.o))
        },
        q_norm=w.q_norm,
        k_norm=w.k_norm,
    )
    x = torch.randn(B, S, Dm, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(S, D, gen)
    dy = torch.randn(B, S, Dm, generator=gen, dtype=torch.float64)

    def f():
        torch.manual_seed(123)  # the op draws its dropout seed from torch's RNG
        return fused_upipe_attention(
            x, cos, sin, w, num_heads=H, num_kv_heads=Hk, head_dim=D, heads_per_chunk=1
        )

    y = f()
    targets = [x] + [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(y, targets, dy)
    torch.manual_seed(0)
    assert not torch.equal(y, f().new_zeros(y.shape))
    for t, g in zip(targets, grads):
        v = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        eps = 1e-6
        with torch.no_grad():
            t.add_(v, alpha=eps)
            up = (f() * dy).sum()
            t.sub_(v, alpha=2 * eps)
            down = (f() * dy).sum()
            t.add_(v, alpha=eps)
        numeric, analytic = (up - down) / (2 * eps), (g * v).sum()
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (
            tuple(t.shape),
            numeric,
            analytic,
        )
    # and dropout is really on: a different seed gives a different output
    torch.manual_seed(7)
    y2 = fused_upipe_attention(
        x, cos, sin, w, num_heads=H, num_kv_heads=Hk, head_dim=D, heads_per_chunk=1
    )
    assert not torch.allclose(y, y2)


def _schedule_worker(rank, world):
    """One fused fwd+bwd per (mode, overlap) with LoRA dropout, logging the all-to-alls (and whether each was issued
    asynchronously), the waits on them and the kernel calls in order; returns the logs and whether overlap left every
    result bitwise equal."""
    from hf_upipe.ops.kernels import get_kernel

    inner = get_kernel("sdpa", torch.device("cpu"), torch.float32)
    log = []

    class Logging:
        def forward(self, *a, **k):
            log.append("fwd")
            return inner.forward(*a, **k)

        def backward(self, *a, **k):
            log.append("bwd")
            return inner.backward(*a, **k)

    original, original_wait = dist.all_to_all_single, Pending.wait

    def logged(out, inp, *a, **k):
        log.append("a2a-async" if k.get("async_op") else "a2a")
        return original(out, inp, *a, **k)

    def logged_wait(self):
        log.append("wait")
        return original_wait(self)

    gen = torch.Generator().manual_seed(8)
    build = _make(gen, 24, 8, 2, 8, True, True, True, False, torch.float32)
    w, leaves = build(torch.float32)
    w = AttentionWeights(
        **{
            n: Projection(
                p.weight, p.bias, tuple(LoraAdapter(a.A, a.B, a.scaling, 0.2) for a in p.adapters)
            )
            for n, p in (("q", w.q), ("k", w.k), ("v", w.v), ("o", w.o))
        },
        q_norm=w.q_norm,
        k_norm=w.k_norm,
    )
    x = torch.randn(1, 8, 24, generator=gen)
    dy = torch.randn(1, 8, 24, generator=gen)
    cos, sin = _tables(16, 8, gen)
    cos, sin = (t[:, rank * 8 : (rank + 1) * 8].float() for t in (cos, sin))
    logs, equal = {}, {}
    dist.all_to_all_single, Pending.wait = logged, logged_wait
    try:
        for save in (False, True):
            results = {}
            for overlap in (False, True):
                log.clear()
                torch.manual_seed(11)  # the same dropout seed for both schedules
                xl = x.clone().requires_grad_()
                y = fused_upipe_attention(
                    xl,
                    cos,
                    sin,
                    w,
                    num_heads=8,
                    num_kv_heads=2,
                    head_dim=8,
                    group=dist.group.WORLD,
                    heads_per_chunk=1,
                    kernel=Logging(),
                    save_attention=save,
                    overlap=overlap,
                )
                grads = torch.autograd.grad(y, [xl] + [t for t in leaves if t.requires_grad], dy)
                results[overlap] = (y, *grads)
                logs[(save, overlap)] = list(log)
            equal[save] = all(torch.equal(a, b) for a, b in zip(results[False], results[True]))
    finally:
        dist.all_to_all_single, Pending.wait = original, original_wait
    return logs, equal


def _meetings(log: list[str]) -> int:
    """Points where the ranks meet: runs of waits after all-to-alls issued since the previous run."""
    count, issued = 0, False
    for event in log:
        if event.startswith("a2a"):
            issued = True
        elif event == "wait" and issued:
            count, issued = count + 1, False
    return count


def test_overlap_issues_the_next_stage_before_the_kernel_and_changes_no_bit():
    """H=8, Hk=2 on 2 ranks, c=1: 4 stages, one k/v chunk. Every all-to-all is issued asynchronously. The forward is
    overlapped in both schedules (a backward follows): stage 0's k, v, q and stage 1's q are in flight when stage
    0's kernel runs. The synchronous schedule's backward issues a stage's tensors together, just before they are
    needed, so the ranks meet once per group of them rather than once per tensor; the overlapped one issues them
    one stage ahead. Output, dx and every gradient are bitwise those of the synchronous schedule (LoRA dropout on)."""
    forward = 2 + 4 + 4 + 4  # all-to-alls of k, v, four q, four outputs; four kernel forwards
    for logs, equal in run_distributed(_schedule_worker, 2):
        assert equal == {False: True, True: True}, equal
        for save in (False, True):
            sync, ov = ([e for e in logs[(save, o)] if e != "wait"] for o in (False, True))
            assert sync[:forward] == ov[:forward], (sync[:forward], ov[:forward])
            assert ov[:5] == ["a2a-async"] * 4 + ["fwd"], ov[:5]
            assert sync[:forward].count("fwd") == 4, sync[:forward]
            assert "a2a" not in ov + sync and sync.count("a2a-async") == ov.count("a2a-async"), (
                sync,
                ov,
            )
            # backward: before stage 0's kernel backward, stage 0's q, d a and stage 1's q, d a were sent, and
            # stage 0's output (recompute mode: after its kernel forward); recompute mode also re-sent k, v, save
            # mode (which kept them) sent stage 1's output
            assert ov[forward : ov.index("bwd")].count("a2a-async") == (6 if save else 7), (
                save,
                ov,
            )
            # k, v (recompute mode only), q, out, d a
            assert sync[forward : sync.index("bwd")].count("a2a-async") == (3 if save else 5), (
                save,
                sync,
            )
            # where the synchronous backward's ranks meet, per stage: save mode {q, d a, out}, {dq}, and {dk, dv}
            # once, at the chunk's end; recompute mode {q (k, v)}, {out}, {d a}, {dq}, {dk, dv} (the output's
            # buffers go before d a's come)
            full = logs[(save, False)]
            backward = full[[i for i, e in enumerate(full) if e != "wait"][forward] :]
            assert _meetings(backward) == (4 * 2 + 1 if save else 4 * 5), (save, backward)
