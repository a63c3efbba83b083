"""Ring attention across R ranks under UPipe over U ranks (`hf_upipe.ops.ring`), against one process.

U x R in {1x2, 2x2, 1x4} (1x4, a ring of more than two hops, in the slow tier): R ring shards in zigzag order
(`zigzag_order`), each held by U ranks contiguously; the
registered op (`upipe_attention`) and the fused block (`fused_upipe_attention`, both backward modes, overlapped)
with a `RingKernel` as their kernel. MHA, GQA and k/v replication (Hk < U); every rank's output and the
gradients of q, k, v (op) or of x and every block tensor with LoRA (fused), in fp32 (tight) and bf16 (within 2x
the single-process bf16 error plus one bf16 ulp). A ring that merged the blocks wrongly, skipped or doubled a
block pair, or sent a dk/dv accumulator to the wrong rank fails these.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_upipe.ops.fused_attention import fused_upipe_attention
from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.ring import RingKernel, zigzag_order
from hf_upipe.ops.upipe_attention import upipe_attention
from tests._dist import run_distributed
from tests.ops.test_fused_attention import _block_errors, _make, _rel, _tables


def _groups(U: int, R: int):
    """(Ulysses group of this rank's ring shard, its ring group); every rank creates every group, in one order."""
    rank, uly, ring = dist.get_rank(), None, None
    for g in range(R):
        ranks = [g * U + u for u in range(U)]
        made = dist.new_group(ranks)
        uly = made if rank in ranks else uly
    for u in range(U):
        ranks = [g * U + u for g in range(R)]
        made = dist.new_group(ranks)
        ring = made if rank in ranks else ring
    return uly, ring


def _tokens(rank: int, S: int, U: int, R: int) -> torch.Tensor:
    """The global token indices this rank holds: its ring shard's part u, s = S/(U*R) tokens."""
    g, u = divmod(rank, U)
    s = S // (U * R)
    return zigzag_order(S, R)[g * U * s + u * s : g * U * s + (u + 1) * s]


def _check(errs, base, what):
    for k, e in enumerate(errs):
        if base is None:
            assert e < 1e-5, f"tensor {k}: rel err {e:.2e} in {what}"
        else:
            assert e <= 2 * base[k] + 2**-7, (
                f"tensor {k}: rel err {e:.2e} vs {base[k]:.2e} in {what}"
            )


def _op_case(rank, U, R, uly, ring, H, Hk, chunk, dtype, seed):
    B, S, D = 2, 16 * U * R, 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hk, Hk, H)
    )

    def attend(q, k, v):  # [B, S, h, D], causal, whole sequence
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        ).transpose(1, 2)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attend(*full)
    ref_grads = torch.autograd.grad(ref, full, dout)
    idx = _tokens(rank, S, U, R)
    mine = [t[:, idx].to(dtype).requires_grad_() for t in (q, k, v)]
    kernel = RingKernel(get_kernel("sdpa", torch.device("cpu"), dtype), ring)
    out = upipe_attention(*mine, group=uly, heads_per_chunk=chunk, kernel=kernel)
    grads = torch.autograd.grad(out, mine, dout[:, idx].to(dtype))
    errs = [_rel(out, ref[:, idx])] + [_rel(g, r[:, idx]) for g, r in zip(grads, ref_grads)]
    base = None
    if dtype == torch.bfloat16:
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        y = attend(*low)
        g16 = torch.autograd.grad(y, low, dout.to(dtype))
        base = [_rel(y[:, idx], ref[:, idx])] + [
            _rel(g[:, idx], r[:, idx]) for g, r in zip(g16, ref_grads)
        ]
    return errs, base


def _fused_case(rank, U, R, uly, ring, H, Hk, chunk, save, overlap, dtype, seed):
    S, Dm, D = 16 * U * R, 24, 8
    gen = torch.Generator().manual_seed(seed)
    build = _make(gen, Dm, H, Hk, D, True, True, True, False, dtype)
    x = torch.randn(1, S, Dm, generator=gen, dtype=torch.float64)
    dy = torch.randn(1, S, Dm, generator=gen, dtype=torch.float64)
    cos, sin = _tables(S, D, gen)
    kernel = RingKernel(get_kernel("sdpa", torch.device("cpu"), dtype), ring)

    def call(xl, cos_l, sin_l, w):
        return fused_upipe_attention(
            xl,
            cos_l,
            sin_l,
            w,
            num_heads=H,
            num_kv_heads=Hk,
            head_dim=D,
            group=uly,
            heads_per_chunk=chunk,
            kernel=kernel,
            save_attention=save,
            overlap=overlap,
        )

    errs, base, _ = _block_errors(
        build, x, dy, cos, sin, H, Hk, D, dtype, _tokens(rank, S, U, R), call
    )
    return errs, base


def _worker(rank, world, U, R):
    uly, ring = _groups(U, R)
    results = []
    # (H, Hk): MHA, GQA, and with U = 2 one k/v head replicated over the Ulysses group
    for n, (H, Hk) in enumerate([(4, 4), (8, 2)] + ([(4, 1)] if U > 1 else [])):
        for chunk in (1, None):
            what = ("op", U, R, H, Hk, chunk)
            results.append(
                (what, *_op_case(rank, U, R, uly, ring, H, Hk, chunk, torch.float32, 10 * n))
            )
    results.append(
        (("op bf16", U, R), *_op_case(rank, U, R, uly, ring, 8, 2, 1, torch.bfloat16, 7))
    )
    for save, overlap in ((False, False), (True, False), (True, True)):
        what = ("fused", U, R, save, overlap)
        results.append(
            (what, *_fused_case(rank, U, R, uly, ring, 8, 2, 1, save, overlap, torch.float32, 20))
        )
    results.append(
        (
            ("fused bf16", U, R),
            *_fused_case(rank, U, R, uly, ring, 8, 2, 1, True, False, torch.bfloat16, 21),
        )
    )
    return results


@pytest.mark.parametrize(
    "U,R",
    [
        pytest.param(1, 2, id="1x2"),
        pytest.param(2, 2, id="2x2"),
        # the longest ring (4 ranks, one per shard): the full suite runs it, 1x2 and 2x2 keep the ring fast
        pytest.param(1, 4, id="1x4", marks=pytest.mark.slow),
    ],
)
def test_ring_under_upipe_matches_one_process(U, R):
    for per_rank in run_distributed(_worker, U * R, U, R, timeout=300):
        for what, errs, base in per_rank:
            _check(errs, base, what)


def test_zigzag_order_gives_each_ring_rank_two_mirrored_chunks():
    order = zigzag_order(16, 2)  # chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(zigzag_order(48, 4).tolist()) == list(range(48))
    with pytest.raises(
        ValueError, match="30 tokens is not a multiple of 8; pad or trim to 24 or 32 tokens"
    ):
        zigzag_order(30, 4)
