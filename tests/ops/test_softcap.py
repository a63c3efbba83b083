"""Attention-logit soft-capping (Gemma 2) in the UPipe op vs a float64 single-process reference written from the
definition (scores = cap * tanh(q.k * scale / cap), causal, optional sliding window, optional sinks), on spawned
gloo ranks: output, dq, dk, dv (and the sinks' gradient), fp32 tight and bf16 within 2x the plain bf16 reference's
error plus one bf16 ulp; query blocks small enough that every case runs several; packed documents through
`DocumentKernel`.
"""

import pytest
import torch
import torch.distributed as dist

from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.kernels import SdpaCpuKernel
from hf_upipe.ops.softcap import SoftcapKernel
from hf_upipe.ops.upipe_attention import upipe_attention
from tests._dist import run_distributed


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _reference(q, k, v, sinks, scale, cap, window, docs):
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    raw = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    logits = cap * torch.tanh(raw / cap)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True) & (docs[:, None] == docs[None, :])
    logits = logits.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        logits = torch.cat(
            [logits, sinks.view(1, H, 1, 1).expand(B, H, S, 1).to(logits.dtype)], dim=-1
        )
        return torch.einsum("bhij,bjhd->bihd", logits.softmax(-1)[..., :-1], vv)
    return torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), vv)


def _case(rank, world, group, case):
    B, S, H, Hk, D, chunk, cap, window, with_sinks, packed, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) * sc + off
        for h, sc, off in ((H, 2.5, 0.1), (Hk, 1.5, -0.2), (Hk, 1.0, 0.3))
    )  # large scores: the cap bites
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) if with_sinks else None
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    cuts = [0, S // 3 + 1, S] if packed else [0, S]  # B == 1 when packed
    docs = torch.cat([torch.full((e - a,), n) for n, (a, e) in enumerate(zip(cuts, cuts[1:]))])
    scale = D**-0.5
    full = [t.clone().requires_grad_() for t in (q, k, v) + ((sinks,) if with_sinks else ())]
    ref = _reference(*full[:3], full[3] if with_sinks else None, scale, cap, window, docs)
    ref_grads = torch.autograd.grad(ref, full, dout)
    s = S // world
    sh = slice(rank * s, (rank + 1) * s)
    local = [t[:, sh].to(dtype).requires_grad_() for t in (q, k, v)] + (
        [sinks.to(dtype).requires_grad_()] if with_sinks else []
    )
    kernel = SoftcapKernel(
        SdpaCpuKernel(), cap, window, block_elements=B * H * S * 5
    )  # 5-query blocks
    if packed:
        kernel = DocumentKernel(kernel, torch.tensor(cuts, dtype=torch.int32), S)
    out = upipe_attention(
        *local[:3],
        group=group,
        heads_per_chunk=chunk,
        kernel=kernel,
        scale=scale,
        sinks=local[3] if with_sinks else None,
    )
    grads = list(torch.autograd.grad(out, local, dout[:, sh].to(dtype)))
    if with_sinks and world > 1:
        dist.all_reduce(grads[3], group=group)
    errs = (
        [_rel(out, ref[:, sh])]
        + [_rel(g, r[:, sh]) for g, r in zip(grads[:3], ref_grads[:3])]
        + [_rel(g, r) for g, r in zip(grads[3:], ref_grads[3:])]
    )
    base = None
    if dtype == torch.bfloat16:
        low = [t.to(dtype).requires_grad_() for t in full]
        o = _reference(*low[:3], low[3] if with_sinks else None, scale, cap, window, docs)
        g = torch.autograd.grad(o, low, dout.to(dtype))
        base = (
            [_rel(o[:, sh], ref[:, sh])]
            + [_rel(a[:, sh], r[:, sh]) for a, r in zip(g[:3], ref_grads[:3])]
            + [_rel(a, r) for a, r in zip(g[3:], ref_grads[3:])]
        )
    return errs, base


def _worker(rank, world, cases):
    return [_case(rank, world, dist.group.WORLD if world > 1 else None, c) for c in cases]


def _cases(world):
    S = 12 * world
    F32, BF16 = torch.float32, torch.bfloat16
    return [
        (2, S, 8, 2, 8, 1, 2.0, None, False, False, F32, 1),
        (1, S, 8, 4, 8, None, 5.0, 7, False, False, F32, 2),
        (1, S, 4, 1, 8, 1, 3.0, None, True, False, F32, 3),
        (1, S, 8, 2, 8, 2, 2.0, None, False, True, F32, 4),
        (1, S, 8, 2, 8, 1, 2.0, 5, True, False, BF16, 5),
    ]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_softcap_matches_the_definition(world):
    cases = _cases(world)
    results = [_worker(0, 1, cases)] if world == 1 else run_distributed(_worker, world, cases)
    for per_rank in results:
        for case, (errs, base) in zip(cases, per_rank):
            for n, e in enumerate(errs):
                if base is None:
                    assert e < 1e-5, f"tensor {n}: rel err {e:.2e} in {case}"
                else:
                    assert e <= 2 * base[n] + 2**-7, (
                        f"tensor {n}: rel err {e:.2e} vs plain {base[n]:.2e} in {case}"
                    )


def test_other_kernels_refuse_softcap():
    class Other:
        name = "cuda-sdpa"

    with pytest.raises(NotImplementedError, match="soft-capping .* not for the 'cuda-sdpa' kernel"):
        SoftcapKernel(Other(), 30.0)
