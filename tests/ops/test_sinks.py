"""Attention sinks in the UPipe op (GPT-OSS's per-head sink logit, a key of value 0 every query sees) vs a float64
single-process reference written from the definition (softmax over [scores, sink], the sink column dropped).

Output, dq, dk, dv and the sinks' gradient (summed over the SP group, as a trainer's gradient reduction does), on
spawned gloo ranks; GQA with k/v replication, one and several heads per chunk, alone and inside the sliding-window
kernel, fp32 tight and bf16 within 2x the plain bf16 reference's error plus one bf16 ulp.
"""

import pytest
import torch
import torch.distributed as dist

from hf_upipe.ops.kernels import SdpaCpuKernel
from hf_upipe.ops.upipe_attention import upipe_attention
from hf_upipe.ops.windowed import WindowKernel
from tests._dist import run_distributed


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _reference(q, k, v, sinks, scale, window):
    """[B, S, H, D] causal GQA attention with one sink logit per head (and an optional sliding window)."""
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) * scale  # [B, H, S, S]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, S, 1).to(scores.dtype)], dim=-1)
    probs = logits.softmax(-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs, vv)


def _case(rank, world, group, case):
    B, S, H, Hk, D, chunk, window, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) * sc + off
        for h, sc, off in ((H, 1.3, 0.1), (Hk, 0.7, -0.2), (Hk, 1.0, 0.3))
    )
    sinks = (
        torch.randn(H, generator=gen, dtype=torch.float64) * 2
    )  # some sinks dominate, some vanish
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    scale = D**-0.5
    full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = _reference(*full, scale, window)
    ref_grads = torch.autograd.grad(ref, full, dout)
    s = S // world
    sh = slice(rank * s, (rank + 1) * s)
    local = [t[:, sh].to(dtype).requires_grad_() for t in (q, k, v)] + [
        sinks.to(dtype).requires_grad_()
    ]
    kernel = WindowKernel(SdpaCpuKernel(), window) if window else "sdpa"
    out = upipe_attention(
        *local[:3], group=group, heads_per_chunk=chunk, kernel=kernel, scale=scale, sinks=local[3]
    )
    grads = list(torch.autograd.grad(out, local, dout[:, sh].to(dtype)))
    if world > 1:
        dist.all_reduce(
            grads[3], group=group
        )  # each rank holds its head-layout heads' sink gradients
    errs = (
        [_rel(out, ref[:, sh])]
        + [_rel(g, r[:, sh]) for g, r in zip(grads[:3], ref_grads[:3])]
        + [_rel(grads[3], ref_grads[3])]
    )
    base = None
    if dtype == torch.bfloat16:
        low = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        o = _reference(*low, scale, window)
        g = torch.autograd.grad(o, low, dout.to(dtype))
        base = (
            [_rel(o[:, sh], ref[:, sh])]
            + [_rel(a[:, sh], r[:, sh]) for a, r in zip(g[:3], ref_grads[:3])]
            + [_rel(g[3], ref_grads[3])]
        )
    return errs, base


def _worker(rank, world, cases):
    return [_case(rank, world, dist.group.WORLD if world > 1 else None, c) for c in cases]


def _cases(world):
    S = 12 * world
    return [
        (2, S, 8, 2, 8, 1, None, torch.float32, 1),
        (1, S, 8, 4, 8, None, None, torch.float32, 2),
        (1, S, 4, 1, 8, 1, 5, torch.float32, 3),
        (1, S, 8, 2, 8, 2, 7, torch.float32, 4),
        (1, S, 8, 2, 8, 1, None, torch.bfloat16, 5),
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sinks_match_the_definition(world):
    cases = _cases(world)
    results = [_worker(0, 1, cases)] if world == 1 else run_distributed(_worker, world, cases)
    for per_rank in results:
        for case, (errs, base) in zip(cases, per_rank):
            for name, e, b in zip(("out", "dq", "dk", "dv", "dsinks"), errs, base or [None] * 5):
                if b is None:
                    assert e < 1e-5, f"{name}: rel err {e:.2e} in {case}"
                else:
                    assert e <= 2 * b + 2**-7, f"{name}: rel err {e:.2e} vs plain {b:.2e} in {case}"


def test_sinks_must_be_one_per_head():
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\); got \(2,\)"):
        upipe_attention(q, q[:, :, :2], q[:, :, :2], sinks=torch.zeros(2))
