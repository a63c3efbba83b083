"""The tiled attention backward (`hf_upipe.ops.tiled_backward`) against the kernel's own backward and against
autograd through plain attention in float64, on random non-symmetric inputs: causal and not, GQA, lengths that
are no multiple of the tile, fp32 tight and bf16 loose; then the fused block and the registered path with tiles
of a few tokens against their plain references (the tests of those paths, rerun with the tiling in force)."""

import math

import pytest
import torch

from hf_upipe.ops import tiled_backward as tb
from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.kernels_aten import CudnnKernel, SdpaCudaKernel
from hf_upipe.ops.kernels_hollow import build_hollow, hollow_attention


def _inputs(seed, B, Sq, Sk, H, Hk, D, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(B, s, h, D, generator=g, dtype=torch.float64).to(dtype)
        for s, h in ((Sq, H), (Sk, Hk), (Sk, Hk), (Sq, H))
    )
    return q, k, v, dout


def _reference(q, k, v, dout, scale, causal):
    """Gradients of plain attention in float64 (query i sees keys 0..i when causal, top-left)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kx, vx = (t.repeat_interleave(g, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kx) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), vx)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "Sq,Sk,H,Hk,causal,block",
    [
        (37, 37, 4, 2, True, 8),
        (37, 37, 2, 2, True, 37 // 3),
        (37, 37, 4, 1, True, 8),
        (20, 37, 4, 1, False, 7),
        (37, 20, 2, 2, False, 7),
    ],
    ids=[
        "causal-gqa",
        "causal-mha",
        "causal-queries-outer",
        "rect-queries-outer",
        "rect-keys-outer",
    ],
)
def test_tiles_match_the_kernel_and_plain_attention_fp32(Sq, Sk, H, Hk, causal, block):
    kern = get_kernel("sdpa", "cpu", torch.float32)
    q, k, v, dout = _inputs(Sq + Sk + H, 2, Sq, Sk, H, Hk, 16, torch.float32)
    scale = 16**-0.5
    out, lse = kern.forward(q, k, v, scale=scale, causal=causal)
    assert tb.tiles(kern, q, k, causal, block)
    tiled = tb.tiled_backward(
        kern, dout, q, k, v, out, lse, scale=scale, causal=causal, block=block
    )
    whole = kern.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    ref = _reference(q, k, v, dout, scale, causal)
    assert _rel(out, ref[0]) < 1e-5
    for name, a, b, r in zip(("dq", "dk", "dv"), tiled, whole, ref[1:]):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        assert _rel(a, b) < 1e-5, f"{name}: tiled vs whole {_rel(a, b):.2e}"
        assert _rel(a, r) < 1e-5, f"{name}: tiled vs float64 {_rel(a, r):.2e}"


def test_tiles_in_bf16_are_as_close_as_the_whole_call():
    kern = get_kernel("sdpa", "cpu", torch.bfloat16)
    q, k, v, dout = _inputs(5, 1, 45, 45, 4, 2, 16, torch.bfloat16)
    scale = 0.25
    out, lse = kern.forward(q, k, v, scale=scale)
    tiled = tb.tiled_backward(kern, dout, q, k, v, out, lse, scale=scale, causal=True, block=10)
    whole = kern.backward(dout, q, k, v, out, lse, scale=scale, causal=True)
    ref = _reference(q, k, v, dout, scale, True)[1:]
    for name, a, b, r in zip(("dq", "dk", "dv"), tiled, whole, ref):
        assert a.dtype == torch.bfloat16
        assert _rel(a, r) <= 2 * _rel(b, r) + 2**-7, f"{name}: {_rel(a, r):.2e} vs {_rel(b, r):.2e}"


def test_which_calls_are_tiled(monkeypatch):
    kern = get_kernel("sdpa", "cpu", torch.float32)
    q, k = torch.zeros(1, 9, 2, 8), torch.zeros(1, 9, 1, 8)
    assert tb.tiles(kern, q, k, True, 4)
    assert not tb.tiles(kern, q, k, True, 9)  # one tile: the kernel's own call
    assert not tb.tiles(kern, q, k, True, 0)  # 0: never
    assert not tb.tiles(kern, q[:, :5], k, True, 4)  # causal, not square: left to the kernel
    assert tb.tiles(kern, q[:, :5], k, False, 4)
    docs = DocumentKernel(kern, torch.tensor([0, 4, 9]), 9)
    assert not tb.tiles(docs, q, k, True, 4)  # wrappers bound their own calls
    monkeypatch.setenv(tb.ENV, "3")
    assert tb.backward_block() == 3 and tb.tiles(kern, q, k, True)
    monkeypatch.delenv(tb.ENV)
    assert tb.backward_block() == tb.DEFAULT_BLOCK == 262144
    for bad in ("-1", "256K"):
        monkeypatch.setenv(tb.ENV, bad)
        with pytest.raises(ValueError, match="UPIPE_BACKWARD_BLOCK"):
            tb.backward_block()


def test_documents_in_the_loop_tile_each_document(monkeypatch):
    """Packed rows through `DocumentKernel`'s loop: each document's call is tiled, the result is the untiled one."""
    kern = get_kernel("sdpa", "cpu", torch.float32)
    q, k, v, dout = _inputs(11, 1, 40, 40, 2, 1, 8, torch.float32)
    docs = DocumentKernel(kern, torch.tensor([0, 7, 31, 40]), 40)
    out, lse = docs.forward(q, k, v, scale=0.3)
    whole = docs.backward(dout, q, k, v, out, lse, scale=0.3)
    monkeypatch.setenv(tb.ENV, "5")
    tiled_calls = _count_tiled(monkeypatch)
    tiled = docs.backward(dout, q, k, v, out, lse, scale=0.3)
    assert tiled_calls[0] == 3  # documents of 7, 24 and 9 tokens, each longer than a tile
    ref = _reference(q[:, 7:31], k[:, 7:31], v[:, 7:31], dout[:, 7:31], 0.3, True)
    assert _rel(tiled[0][:, 7:31], ref[1]) < 1e-5
    for name, a, b in zip(("dq", "dk", "dv"), tiled, whole):
        assert _rel(a, b) < 1e-5, name


def test_cudnn_tiles_run_the_kernel_of_the_whole_call():
    kern = CudnnKernel()
    short = torch.empty(1, CudnnKernel.MAX_S, 1, 128, device="meta")
    long = torch.empty(1, CudnnKernel.MAX_S + 1, 1, 128, device="meta")
    assert kern.tile_kernel(short) is kern
    assert isinstance(kern.tile_kernel(long), SdpaCudaKernel)


def test_hollow_tiles_allocate_the_outputs_of_the_whole_call():
    q, k, v, dout = _inputs(3, 1, 20, 20, 2, 1, 8, torch.float32)
    lse = torch.zeros(1, 2, 20)
    with hollow_attention():
        hollow = build_hollow("sdpa", torch.device("cpu"))
        assert tb.tiles(hollow, q, k, True, 6)
        dq, dk, dv = tb.tiled_backward(
            hollow, dout, q, k, v, q, lse, scale=1.0, causal=True, block=6
        )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save"])
def test_fused_block_with_tiles_matches_the_plain_block(monkeypatch, save):
    from tests.ops import test_fused_attention as fused

    monkeypatch.setenv(tb.ENV, "3")  # the single-process cases have 8 tokens: 3 tiles per call
    tiled = _count_tiled(monkeypatch)
    cases = fused._cases(1)
    fused._check(cases, [fused._worker(0, 1, cases, save)])
    assert tiled[0] >= len(cases)


def test_registered_path_with_tiles_matches_plain_attention(monkeypatch):
    from tests.ops import test_upipe_attention as registered

    monkeypatch.setenv(tb.ENV, "5")  # 16 tokens: 4 tiles, the last one short
    tiled = _count_tiled(monkeypatch)
    cases = registered._cases(1)
    registered._check(cases, [registered._worker(0, 1, cases)])
    assert tiled[0] >= len(cases)


def _count_tiled(monkeypatch) -> list[int]:
    """Counts the backward calls that `tiled_backward` tiles (so the tests above cannot pass untiled)."""
    count, tiles = [0], tb.tiles

    def counting(*args, **kwargs):
        yes = tiles(*args, **kwargs)
        count[0] += yes
        return yes

    monkeypatch.setattr(tb, "tiles", counting)
    return count


def _ring_worker_with_tiles(rank, world, U, R):
    """test_ring's worker with tiles of 3 tokens (set in the rank: its forkserver may predate the test's env)."""
    import os

    from tests.ops import test_ring as ring

    os.environ[tb.ENV] = "3"
    counted = [0]
    tiles = tb.tiles

    def counting(*args, **kwargs):
        yes = tiles(*args, **kwargs)
        counted[0] += yes
        return yes

    tb.tiles = counting
    try:
        return ring._worker(rank, world, U, R), counted[0]
    finally:
        tb.tiles = tiles
        del os.environ[tb.ENV]


@pytest.mark.slow
def test_ring_with_tiles_matches_one_process():
    from tests._dist import run_distributed
    from tests.ops import test_ring as ring

    for per_rank, tiled in run_distributed(_ring_worker_with_tiles, 2, 1, 2, timeout=300):
        assert tiled > 0
        for what, errs, base in per_rank:
            ring._check(errs, base, what)
