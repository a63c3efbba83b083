"""UPipe op vs single-process SDPA: outputs and q/k/v gradients, on spawned gloo ranks.

Every rank builds the same full-sequence inputs from a seed, runs `upipe_attention` on its contiguous shard and
compares its shard of the output and of every gradient with a float64 single-process reference. fp32 must match
tightly; bf16 must be within 2x the error of plain single-process bf16 SDPA (the flash-attention test rule) plus
one bf16 ulp of the largest value (2**-7 relative): with k/v replication or k/v chunks shared by several stages,
dk/dv are sums of partials the kernel already rounded to bf16, as in any Ulysses with k/v replication.
"""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_upipe.ops.head_layout import HeadLayout, valid_heads_per_chunk
from hf_upipe.ops.upipe_attention import upipe_attention
from tests._dist import run_distributed


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _sdpa(q, k, v):
    """[B, S, H, D] single-process causal GQA attention."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)


def _case_errors(rank, world, group, case):
    """Max relative error of out, dq, dk, dv on this rank's shard; for bf16 also plain bf16 SDPA's error."""
    B, S, H, Hk, D, chunk, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    # non-symmetric inputs: different scales per tensor and an offset, so mistakes in head/token order show
    q, k, v = (
        torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) * sc + off
        for h, sc, off in ((H, 1.3, 0.1), (Hk, 0.7, -0.2), (Hk, 1.0, 0.3))
    )
    dout = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _sdpa(*full)
    ref_grads = torch.autograd.grad(ref, full, dout)
    s = S // world
    shard = slice(rank * s, (rank + 1) * s)
    local = [t[:, shard].to(dtype).requires_grad_() for t in (q, k, v)]
    out = upipe_attention(*local, group=group, heads_per_chunk=chunk)
    grads = torch.autograd.grad(out, local, dout[:, shard].to(dtype))
    errs = [_rel(out, ref[:, shard])] + [_rel(g, r[:, shard]) for g, r in zip(grads, ref_grads)]
    base = None
    if dtype != torch.float64 and dtype != torch.float32:  # error of the plain low-precision model
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = _sdpa(*low)
        g = torch.autograd.grad(o, low, dout.to(dtype))
        base = [_rel(o[:, shard], ref[:, shard])] + [
            _rel(a[:, shard], r[:, shard]) for a, r in zip(g, ref_grads)
        ]
    return errs, base


def _worker(rank, world, cases):
    return [_case_errors(rank, world, dist.group.WORLD if world > 1 else None, c) for c in cases]


def _cases(world):
    """(B, S, H, Hk, D, heads_per_chunk, dtype, seed) covering MHA, GQA, kv_heads != P and kv_heads < P."""
    geoms = {
        1: [(4, 4), (8, 2)],
        2: [(4, 4), (8, 4), (8, 2), (6, 1)],
        4: [(8, 8), (8, 2), (16, 4), (4, 1)],
    }[world]
    out = []
    for i, (H, Hk) in enumerate(geoms):
        for chunk in (1, 2, None):
            if chunk is not None and chunk not in valid_heads_per_chunk(H, Hk, world):
                continue
            for dtype in (torch.float32, torch.bfloat16):
                out.append(
                    (1 + (i % 2), 16 * world, H, Hk, 8, chunk, dtype, 100 * i + (chunk or 0))
                )
    return out


def _random_cases(world, n, seed):
    """Geometries the tests do not name: random heads, head dim, batch and length."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        Hk = rng.choice([1, 2, 3, 4, 6, 8])
        H = Hk * rng.choice([1, 2, 3, 4])
        try:
            HeadLayout(H, Hk, world, 1)
        except ValueError:
            continue
        chunk = rng.choice(valid_heads_per_chunk(H, Hk, world) + [None])
        out.append(
            (
                rng.choice([1, 2, 3]),
                world * rng.choice([3, 5, 9, 13]),
                H,
                Hk,
                rng.choice([4, 8, 12]),
                chunk,
                torch.float32,
                rng.randrange(10**6),
            )
        )
    return out


def _check(cases, results):
    for rank_results in results:
        for case, (errs, base) in zip(cases, rank_results):
            names = ("out", "dq", "dk", "dv")
            if case[6] == torch.float32:
                for name, e in zip(names, errs):
                    assert e < 2e-5, f"{name} rel err {e:.2e} for case {case}"
            else:
                for name, e, b in zip(names, errs, base):
                    assert e <= 2 * b + 2**-7, (
                        f"{name} rel err {e:.2e} vs plain bf16 {b:.2e} for case {case}"
                    )


def test_single_process_is_exact_local_attention():
    cases = _cases(1)
    _check(cases, [_worker(0, 1, cases)])


@pytest.mark.parametrize("world", [2, 4])
def test_parity_against_single_process_sdpa(world):
    cases = _cases(world) + _random_cases(world, 4, seed=world)
    _check(cases, run_distributed(_worker, world, cases))


def test_bad_geometry_names_the_numbers_and_the_fix():
    with pytest.raises(
        ValueError, match=r"num_attention_heads=6 is not divisible by sp_size=4.*\[1, 2, 3, 6"
    ):
        HeadLayout(6, 6, 4, 1)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 and sp_size=2"):
        HeadLayout(6, 3, 2, 1)
    with pytest.raises(ValueError, match=r"heads_per_chunk=3 .* use one of \[1, 2, 4\]"):
        HeadLayout(32, 8, 8, 3)
