"""hf_upipe.ops.documents.DocumentKernel: causal attention inside documents of packed rows.

(a) the loop path around the CPU "sdpa" kernel against a float64 SDPA math reference with an explicit
    block-diagonal causal mask: two rows with different document layouts, documents of length 1, GQA, fp32/bf16;
(b) the native varlen path of FlashAttnKernel with CPU stand-ins for flash-attn's `_flash_attn_varlen_forward/
    _backward` (2.8 custom-op and 2.6 tuple-window signatures), checking what they are handed;
(c) validation of cu_seqlens.
"""

import importlib.machinery
import sys
import types
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

from hf_upipe.ops import kernels_flash_attn
from hf_upipe.ops.documents import DocumentKernel, document_segments
from hf_upipe.ops.kernels import SdpaCpuKernel
from hf_upipe.ops.kernels_cuda import FlashAttnKernel

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
LAYOUTS = {  # documents per row (lengths), S = 23
    "mixed": [[5, 1, 9, 8], [12, 10, 1]],
    "one row whole": [[23], [1, 1, 21]],
    "whole rows": [[23], [23]],
}


def _cu(layout):
    """int32 [N+1] boundaries over the flattened [B*S] batch."""
    lengths = torch.tensor([n for row in layout for n in row])
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)


def _doc_ids(layout):
    """[B, S] document index of every token (per row)."""
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in layout]
    )


def _inputs(b, s, h, hk, d, dtype, seed=0):
    """q/k/v/dout [B,S,*,D] as non-contiguous views of [S,B,*,D] buffers (what the all-to-all hands over)."""
    g = torch.Generator().manual_seed(seed)

    def mk(nh):
        return torch.randn(s, b, nh, d, generator=g).to(dtype).transpose(0, 1)

    return mk(h), mk(hk), mk(hk), mk(h)


def _reference(q, k, v, dout, scale, layout):
    """float64 SDPA (math) with a block-diagonal causal mask [B, 1, S, S]: out, lse [B,h,S], dq, dk, dv."""
    h, hk, S = q.shape[2], k.shape[2], q.shape[1]
    doc = _doc_ids(layout)  # [B, S]
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(
        S, S, dtype=torch.bool
    ).tril()  # [B, S, S]
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    qt = q64.transpose(1, 2)  # [B, h, S, D]
    kt = k64.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vt = v64.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=allowed[:, None], scale=scale
    ).transpose(1, 2)
    scores = ((qt @ kt.transpose(-1, -2)) * scale).masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, h, S]
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _check(kernel, q, k, v, dout, scale, layout, lse_atol=None):
    out, lse = kernel.forward(q, k, v, scale=scale, causal=True)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=True)
    r_out, r_lse, r_dq, r_dk, r_dv = _reference(q, k, v, dout, scale, layout)
    tol = TOL[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.dtype == k.dtype
    assert _rel(out, r_out) < tol, _rel(out, r_out)
    assert (lse.double() - r_lse).abs().max().item() < (
        lse_atol if lse_atol is not None else tol * 10
    )
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert _rel(got, want) < tol, _rel(got, want)


# ----------------------------------------------------------------------------------------------- (a) loop path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2)])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loop_path_matches_block_diagonal_reference(name, h, hk, dtype):
    layout = LAYOUTS[name]
    q, k, v, dout = _inputs(2, 23, h, hk, 16, dtype, seed=hk)
    kernel = DocumentKernel(SdpaCpuKernel(), _cu(layout), 23)
    assert not kernel.native
    _check(kernel, q, k, v, dout, 0.3, layout)


class _Counting:
    """An inner kernel that counts its calls and records the slice shapes it gets."""

    name = "counting"

    def __init__(self):
        self.inner, self.shapes = SdpaCpuKernel(), []

    def forward(self, q, k, v, *, scale, causal=True):
        self.shapes.append(tuple(q.shape[:2]))
        return self.inner.forward(q, k, v, scale=scale, causal=causal)

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        return self.inner.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)


def test_loop_calls_once_per_document_and_once_for_whole_rows():
    q, k, v, _ = _inputs(2, 23, 2, 2, 8, torch.float32)
    inner = _Counting()
    DocumentKernel(inner, _cu(LAYOUTS["mixed"]), 23).forward(q, k, v, scale=0.3)
    assert inner.shapes == [(1, 5), (1, 1), (1, 9), (1, 8), (1, 12), (1, 10), (1, 1)]
    inner.shapes.clear()
    DocumentKernel(inner, _cu(LAYOUTS["whole rows"]), 23).forward(q, k, v, scale=0.3)
    assert inner.shapes == [(2, 23)]


# ----------------------------------------------------------------------------------------------- (b) flash varlen
SEEN = {}  # what the stand-ins received


def _segments(cu):
    c = cu.tolist()
    return list(zip(c, c[1:]))


def _seg_math(q, k, v, scale):
    """One document, [L, h|hk, D] -> float64 scores-derived p [h, L, L], out [L, h, D], lse [h, L]."""
    g = q.shape[1] // k.shape[1]
    qt = q.double().transpose(0, 1)  # [h, L, D]
    kt, vt = (x.double().transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
    L = q.shape[0]
    sc = ((qt @ kt.transpose(-1, -2)) * scale).masked_fill(
        torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")
    )
    lse = torch.logsumexp(sc, -1)
    p = torch.exp(sc - lse[..., None])
    return p, (p @ vt).transpose(0, 1), lse, qt, kt, vt


def _check_varlen_args(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    T, h, d = q.shape
    assert k.shape == v.shape and k.shape[0] == T and d % 8 == 0 and q.stride(-1) == 1
    assert (q.shape, k.shape) == (
        SEEN["q"],
        SEEN["k"],
    )  # flattened tokens, native GQA, head dim padded
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and int(cu_q[-1]) == T
    longest = max(e - a for a, e in _segments(cu_q))
    assert max_q == max_k and max_q >= max(longest, 2) and causal is True


def _varlen_fwd_impl(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, wl, wr, softcap, alibi, ret
):
    _check_varlen_args(q, k, v, cu_q, cu_k, max_q, max_k, causal)
    assert (
        dropout_p == 0.0
        and (wl, wr) == (-1, -1)
        and softcap == 0.0
        and alibi is None
        and ret is False
    )
    out, lse = (
        torch.empty_like(q),
        torch.empty(q.shape[1], q.shape[0], dtype=torch.float32),
    )  # [T,h,D], [h,T]
    for a, e in _segments(cu_q):
        _, o, m, *_ = _seg_math(q[a:e], k[a:e], v[a:e], scale)
        out[a:e], lse[:, a:e] = o.to(q.dtype), m.float()
    SEEN["fwd"] = SEEN.get("fwd", 0) + 1
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _varlen_bwd_impl(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dq,
    dk,
    dv,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    scale,
    causal,
    wl,
    wr,
    softcap,
    alibi,
    deterministic,
    rng_state,
):
    _check_varlen_args(q, k, v, cu_q, cu_k, max_q, max_k, causal)
    assert (
        lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    )
    assert dout.shape == out.shape == dq.shape == q.shape and (dk.shape, dv.shape) == (
        k.shape,
        v.shape,
    )
    assert dropout_p == 0.0 and (wl, wr) == (-1, -1) and alibi is None and deterministic is False
    g = q.shape[1] // k.shape[1]
    for a, e in _segments(cu_q):  # closed-form backward (no autograd inside a custom op)
        p, o, m, qt, kt, vt = _seg_math(q[a:e], k[a:e], v[a:e], scale)
        torch.testing.assert_close(lse[:, a:e].double(), m, atol=1e-3, rtol=1e-3)
        do = dout[a:e].double().transpose(0, 1)  # [h, L, D]
        ds = p * (do @ vt.transpose(-1, -2) - (do * o.transpose(0, 1)).sum(-1, keepdim=True))
        dq[a:e] = ((ds @ kt) * scale).transpose(0, 1).to(dq.dtype)
        gk, gv = (ds.transpose(-1, -2) @ qt) * scale, p.transpose(-1, -2) @ do  # [h, L, D]
        dk[a:e] = gk.unflatten(0, (k.shape[1], g)).sum(1).transpose(0, 1).to(dk.dtype)
        dv[a:e] = gv.unflatten(0, (k.shape[1], g)).sum(1).transpose(0, 1).to(dv.dtype)
    SEEN["bwd"] = SEEN.get("bwd", 0) + 1
    return torch.empty(0)


@torch.library.custom_op("upipe_test_fake_fa_varlen::fwd", mutates_args=(), device_types="cpu")
def _fa28_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert block_table is None and leftpad_k is None and seqused_k is None and zero_tensors is False
    return _varlen_fwd_impl(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        return_softmax,
    )


@torch.library.custom_op(
    "upipe_test_fake_fa_varlen::bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _fa28_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    return _varlen_bwd_impl(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )


def _fa26_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
):
    assert isinstance(window_size, tuple) and len(window_size) == 2
    out, lse, s_dmask, rng = _varlen_fwd_impl(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        *window_size,
        softcap,
        alibi_slopes,
        return_softmax,
    )
    return out, q, k, v, out, lse, s_dmask, rng


def _fa26_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    assert isinstance(window_size, tuple) and len(window_size) == 2
    _varlen_bwd_impl(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        *window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )
    return dq, dk, dv, torch.empty(0)


def _dense_28(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
):
    raise AssertionError("the dense flash-attn call must not be used for documents")


def _dense_26(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
):
    raise AssertionError("the dense flash-attn call must not be used for documents")


FLAVOURS = {
    "2.8-custom-op": (_dense_28, _fa28_varlen_forward, _fa28_varlen_backward),
    "2.6-tuple-window": (_dense_26, _fa26_varlen_forward, _fa26_varlen_backward),
}


@pytest.fixture
def flash_varlen(monkeypatch, request):
    dense, fwd, bwd = FLAVOURS[request.param]
    pkg = types.ModuleType("flash_attn")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    pkg.__path__ = []
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = iface._flash_attn_backward = dense
    iface._flash_attn_varlen_forward, iface._flash_attn_varlen_backward = fwd, bwd
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    kernels_flash_attn._flash_api.cache_clear()
    kernels_flash_attn._flash_varlen_api.cache_clear()
    SEEN.clear()
    yield request.param
    kernels_flash_attn._flash_api.cache_clear()
    kernels_flash_attn._flash_varlen_api.cache_clear()


@pytest.mark.parametrize("flash_varlen", sorted(FLAVOURS), indirect=True)
@pytest.mark.parametrize("d", [16, 12])
@pytest.mark.parametrize("name", ["mixed", "one row whole"])
def test_flash_varlen_glue(flash_varlen, name, d):
    layout = LAYOUTS[name]
    q, k, v, dout = _inputs(2, 23, 4, 2, d, torch.bfloat16, seed=d)
    dp = (d + 7) // 8 * 8
    SEEN.update(q=(46, 4, dp), k=(46, 2, dp))
    kernel = DocumentKernel(
        FlashAttnKernel(), _cu(layout), 23, max_seqlen=max(max(r) for r in layout)
    )
    assert kernel.native
    _check(kernel, q, k, v, dout, d**-0.5, layout, lse_atol=1e-3)
    assert SEEN["fwd"] == 1 and SEEN["bwd"] == 1  # one call for all documents
    assert kernels_flash_attn._flash_varlen_api()[2] is (flash_varlen != "2.6-tuple-window")


@pytest.mark.parametrize("flash_varlen", ["2.8-custom-op"], indirect=True)
def test_flash_varlen_all_single_token_documents(flash_varlen):
    layout = [
        [1] * 5,
        [1] * 5,
    ]  # max_seqlen 1 is raised to 2 (flash-attn's head swap at max_seqlen_q == 1)
    q, k, v, dout = _inputs(2, 5, 4, 2, 8, torch.bfloat16, seed=1)
    SEEN.update(q=(10, 4, 8), k=(10, 2, 8))
    _check(
        DocumentKernel(FlashAttnKernel(), _cu(layout), 5), q, k, v, dout, 0.4, layout, lse_atol=1e-3
    )


# ----------------------------------------------------------------------------------------------- (c) validation
@pytest.mark.parametrize(
    "cu,match",
    [
        ([0, 5, 23, 46], None),
        ([0, 30, 46], "crossing a row boundary"),
        ([0, 5, 5, 46], "increase strictly"),
        ([0, 23, 40], "from 0 to B\\*S"),
        ([3, 23, 46], "from 0 to B\\*S"),
    ],
)
def test_segments_validation(cu, match):
    cu = torch.tensor(cu, dtype=torch.int32)
    if match is None:
        assert document_segments(cu, 2, 23) == [(0, 0, 5), (0, 5, 23), (1, 0, 23)]
    else:
        with pytest.raises(ValueError, match=match):
            document_segments(cu, 2, 23)
    with pytest.raises(ValueError, match="built for sequences of 23"):
        DocumentKernel(SdpaCpuKernel(), cu, 23).forward(
            *_inputs(2, 11, 2, 2, 8, torch.float32)[:3], scale=0.3
        )
