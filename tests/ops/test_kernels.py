"""Attention kernels (hf_upipe.ops.kernels / kernels_cuda: kernels_aten, kernels_flash_attn) on CPU.

(a) the CPU "sdpa" kernel against a float64 reference (F.scaled_dot_product_attention for out and grads, logsumexp
    of the masked score matrix for lse), MHA and GQA, strided inputs, fp32 and bf16;
(b) the CUDA kernels' glue without a GPU: the aten ops and the flash_attn package are replaced by CPU fakes with the
    same signatures and return layouts, which also assert what they are handed;
(c) the kernel registry.
"""

import importlib.machinery
import math
import sys
import types
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

from hf_upipe.ops import kernels, kernels_aten, kernels_cuda, kernels_flash_attn
from hf_upipe.ops.kernels import SdpaCpuKernel, available_kernels, check_kernel_name, get_kernel
from hf_upipe.ops.kernels_cuda import FlashAttnKernel, SdpaCudaKernel

HEADS = [(4, 4), (4, 2), (4, 1)]


# ----------------------------------------------------------------------------------------------- references
def _inputs(b, s, h, hk, d, dtype, seed=0):
    """q/k/v/dout [B,S,*,D] as non-contiguous views of [S,B,*,D] buffers (what the all-to-all hands over)."""
    g = torch.Generator().manual_seed(seed)

    def mk(nh):
        return torch.randn(s, b, nh, d, generator=g).to(dtype).transpose(0, 1)

    q, k, v, dout = mk(h), mk(hk), mk(hk), mk(h)
    assert q.stride(1) == b * h * d and q.stride(-1) == 1  # seq stride spans the batch
    return q, k, v, dout


def _reference(q, k, v, dout, scale, causal=True):
    """float64: out [B,S,h,D], lse [B,h,S], dq/dk/dv (dk/dv with hk heads) for top-left causal GQA attention."""
    h, hk = q.shape[2], k.shape[2]
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    qt = q64.transpose(1, 2)
    kt = k64.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vt = v64.transpose(1, 2).repeat_interleave(h // hk, dim=1)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    scores = (qt @ kt.transpose(-1, -2)) * scale
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _check(kernel, q, k, v, dout, scale, causal=True, lse_atol=None):
    out, lse = kernel.forward(q, k, v, scale=scale, causal=causal)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
    r_out, r_lse, r_dq, r_dk, r_dv = _reference(q, k, v, dout, scale, causal)
    tol = TOL[q.dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dk.dtype == k.dtype and dv.dtype == v.dtype
    assert _rel(out, r_out) < tol
    assert (lse.double() - r_lse).abs().max().item() < (
        lse_atol if lse_atol is not None else tol * 10
    )
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert _rel(got, want) < tol, _rel(got, want)


# ----------------------------------------------------------------------------------------------- (a) CPU sdpa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hk", HEADS)
@pytest.mark.parametrize("b", [1, 2])
def test_cpu_sdpa_matches_reference(b, h, hk, dtype):
    q, k, v, dout = _inputs(b, 23, h, hk, 16, dtype, seed=b * 10 + hk)
    _check(SdpaCpuKernel(), q, k, v, dout, scale=0.3)


def test_reference_is_causal_top_left():
    q, k, v, dout = _inputs(1, 5, 2, 2, 8, torch.float32)
    out, lse, *_ = _reference(q, k, v, dout, 0.5)
    # query 0 sees key 0 only: out = v[0], lse = q0.k0 * scale
    assert torch.allclose(out[:, 0], v[:, 0].double(), atol=1e-12)
    assert torch.allclose(lse[:, :, 0], (q[:, 0] * k[:, 0]).sum(-1).double() * 0.5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- (b) aten fakes
def _masked(sc, causal, window=None):
    """Causal masking of scores [.., S, S] (keys after the query), and keys at least `window` behind it."""
    s = sc.shape[-1]
    if causal:
        sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if window is not None:
        sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).tril(-window), float("-inf"))
    return sc


def _math(q, k, v, scale, causal, window=None):
    """[B,h,S,D] equal heads -> out (input dtype) and lse (fp32), from float64."""
    qt, kt, vt = q.double(), k.double(), v.double()
    sc = _masked((qt @ kt.transpose(-1, -2)) * scale, causal, window)
    lse = torch.logsumexp(sc, -1)
    out = torch.softmax(sc, -1) @ vt
    return out, lse


def _math_grads(q, k, v, dout, scale, causal, window=None):
    """Closed-form attention backward in float64 ([B,h,S,D], equal heads): no autograd (fakes may run in custom ops)."""
    qd, kd, vd, dod = q.double(), k.double(), v.double(), dout.double()
    out, lse = _math(qd, kd, vd, scale, causal, window)
    sc = _masked((qd @ kd.transpose(-1, -2)) * scale, causal, window)
    p = torch.exp(sc - lse[..., None])
    dv = p.transpose(-1, -2) @ dod
    ds = p * (dod @ vd.transpose(-1, -2) - (dod * out).sum(-1, keepdim=True))
    return (ds @ kd) * scale, (ds.transpose(-1, -2) @ qd) * scale, dv


def _aten_layout(x, dtype):
    """[B,h,S,D] with aten's physical layout: a transposed view of a contiguous [B,S,h,D] tensor."""
    return x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


def _check_bhsd(*xs):
    b, h, s, d = xs[0].shape
    for x in xs:
        assert (
            x.dim() == 4 and x.shape == (b, h, s, d) and x.stride(-1) == 1
        )  # GQA expanded by the kernel
    assert d % 8 == 0


class FakeAten:
    """CPU stand-ins for the four aten SDPA ops, with their exact signatures and return shapes."""

    def __init__(self):
        self.calls = []

    def flash_fwd(
        self,
        query,
        key,
        value,
        dropout_p=0.0,
        is_causal=False,
        return_debug_mask=False,
        *,
        scale=None,
    ):
        self.calls.append("flash_fwd")
        _check_bhsd(query, key, value)
        assert query.dtype in (torch.float16, torch.bfloat16)
        assert dropout_p == 0.0 and return_debug_mask is False and isinstance(scale, float)
        out, lse = _math(query, key, value, scale, is_causal)
        b, h, s, _ = query.shape
        return (
            _aten_layout(out, query.dtype),
            lse.float(),
            None,
            None,
            s,
            key.shape[2],
            torch.zeros(2, dtype=torch.int64),
            torch.empty(0),
            torch.empty(0),
        )

    def flash_bwd(
        self,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        philox_seed,
        philox_offset,
        *,
        scale=None,
    ):
        self.calls.append("flash_bwd")
        _check_bhsd(grad_out, query, key, value, out)
        assert cum_seq_q is None and cum_seq_k is None  # undefined: dense (not varlen) path
        assert (max_q, max_k) == (query.shape[2], key.shape[2]) and dropout_p == 0.0
        assert isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor)
        assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
        assert logsumexp.shape == query.shape[:3]
        r_out, r_lse = _math(query, key, value, scale, is_causal)
        torch.testing.assert_close(logsumexp.double(), r_lse, atol=1e-4, rtol=1e-4)
        assert _rel(out, r_out) < 1e-2
        dq, dk, dv = _math_grads(query, key, value, grad_out, scale, is_causal)
        return tuple(_aten_layout(x, query.dtype) for x in (dq, dk, dv))

    def eff_fwd(
        self,
        query,
        key,
        value,
        attn_bias,
        compute_log_sumexp,
        dropout_p=0.0,
        is_causal=False,
        *,
        scale=None,
    ):
        self.calls.append("eff_fwd")
        _check_bhsd(query, key, value)
        assert (
            attn_bias is None
            and compute_log_sumexp is True
            and dropout_p == 0.0
            and isinstance(scale, float)
        )
        out, lse = _math(query, key, value, scale, is_causal)
        b, h, s, _ = query.shape
        lse_p = torch.full(
            (b, h, math.ceil(s / 32) * 32), float("nan")
        )  # padded along S like CUDA's kAlignLSE
        lse_p[:, :, :s] = lse
        zero = torch.zeros((), dtype=torch.int64)
        return _aten_layout(out, query.dtype), lse_p, zero, zero.clone()

    def eff_bwd(
        self,
        grad_out_,
        query,
        key,
        value,
        attn_bias,
        out,
        logsumexp,
        philox_seed,
        philox_offset,
        dropout_p,
        grad_input_mask,
        is_causal=False,
        *,
        scale=None,
    ):
        self.calls.append("eff_bwd")
        _check_bhsd(grad_out_, query, key, value, out)
        b, h, s, _ = query.shape
        assert (
            attn_bias is None
            and dropout_p == 0.0
            and list(grad_input_mask) == [True, True, True, False]
        )
        assert isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor)
        assert logsumexp.dtype == torch.float32 and logsumexp.shape == (
            b,
            h,
            math.ceil(s / 32) * 32,
        )
        r_out, r_lse = _math(query, key, value, scale, is_causal)
        torch.testing.assert_close(logsumexp[:, :, :s].double(), r_lse, atol=1e-4, rtol=1e-4)
        assert _rel(out, r_out) < 1e-2
        dq, dk, dv = _math_grads(query, key, value, grad_out_, scale, is_causal)
        return (*(_aten_layout(x, query.dtype) for x in (dq, dk, dv)), None)

    def cudnn_fwd(self, query, key, value, is_causal, *, scale):
        """Our indirection's signature; the real op returns (out, stats [B,h,S,1] fp32, cum_q, cum_k, max_q, max_k,
        philox_seed, philox_offset, debug_mask) (stats shape as seen on the H100, torch 2.11)."""
        self.calls.append("cudnn_fwd")
        _check_bhsd(query, key, value)
        assert query.dtype in (torch.float16, torch.bfloat16) and isinstance(scale, float)
        out, lse = _math(query, key, value, scale, is_causal)
        zero = torch.zeros((), dtype=torch.int64)
        return (
            _aten_layout(out, query.dtype),
            lse.float()[..., None],
            None,
            None,
            query.shape[2],
            key.shape[2],
            zero,
            zero.clone(),
            None,
        )

    def cudnn_bwd(
        self, dout, query, key, value, out, lse, seed, offset, max_q, max_k, is_causal, *, scale
    ):
        self.calls.append("cudnn_bwd")
        _check_bhsd(dout, query, key, value, out)
        assert dout.stride() == out.stride()  # cuDNN wants dO laid out like O
        assert (max_q, max_k) == (query.shape[2], key.shape[2])
        assert (
            lse.dtype == torch.float32
            and lse.is_contiguous()
            and lse.shape == (*query.shape[:3], 1)
        )
        r_out, r_lse = _math(query, key, value, scale, is_causal)
        torch.testing.assert_close(lse[..., 0].double(), r_lse, atol=1e-4, rtol=1e-4)
        dq, dk, dv = _math_grads(query, key, value, dout, scale, is_causal)
        return tuple(_aten_layout(x, query.dtype) for x in (dq, dk, dv))


@pytest.fixture
def fake_aten(monkeypatch):
    fake = FakeAten()
    monkeypatch.setattr(kernels_aten, "_aten_cudnn_fwd", fake.cudnn_fwd)
    monkeypatch.setattr(kernels_aten, "_aten_cudnn_bwd", fake.cudnn_bwd)
    monkeypatch.setattr(kernels_aten, "_aten_flash_fwd", fake.flash_fwd)
    monkeypatch.setattr(kernels_aten, "_aten_flash_bwd", fake.flash_bwd)
    monkeypatch.setattr(kernels_aten, "_aten_eff_fwd", fake.eff_fwd)
    monkeypatch.setattr(kernels_aten, "_aten_eff_bwd", fake.eff_bwd)
    return fake


@pytest.mark.parametrize(
    "dtype,cap,d,path",
    [
        (torch.float32, (9, 0), 16, "eff"),  # fp32: memory-efficient
        (torch.bfloat16, (9, 0), 16, "flash"),  # half on sm80+: flash
        (torch.bfloat16, (9, 0), 12, "flash"),  # head dim padded 12 -> 16
        (torch.bfloat16, (7, 5), 16, "eff"),  # pre-Ampere: memory-efficient
        (torch.bfloat16, (9, 0), 264, "eff"),  # head dim > 256: memory-efficient
        (torch.float32, (8, 0), 20, "eff"),  # padded 20 -> 24 on the efficient path too
    ],
)
@pytest.mark.parametrize("h,hk", HEADS)
def test_sdpa_cuda_glue(fake_aten, monkeypatch, dtype, cap, d, path, h, hk):
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: cap)
    q, k, v, dout = _inputs(
        2, 19, h, hk, d, dtype, seed=hk
    )  # S=19: the efficient lse is padded to 32
    _check(SdpaCudaKernel(), q, k, v, dout, scale=1 / math.sqrt(d), lse_atol=1e-3)
    assert fake_aten.calls == [f"{path}_fwd", f"{path}_bwd"]


def test_sdpa_cuda_glue_non_causal(fake_aten, monkeypatch):
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: (9, 0))
    q, k, v, dout = _inputs(1, 9, 4, 2, 8, torch.float32)
    _check(SdpaCudaKernel(), q, k, v, dout, scale=0.4, causal=False)


@pytest.mark.parametrize(
    "d,max_s,path", [(16, None, "cudnn"), (12, None, "cudnn"), (264, None, "eff"), (16, 8, "flash")]
)
@pytest.mark.parametrize("h,hk", HEADS)
def test_cudnn_glue(fake_aten, monkeypatch, d, max_s, path, h, hk):
    """cuDNN's stats [B,h,S,1] out as lse [B,h,S] and back; GQA; padded head dims; head dims above 128 and sequences
    above the verified length go to the flash / memory-efficient kernels, in forward and backward alike."""
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: (9, 0))
    kern = kernels_cuda.CudnnKernel()
    if max_s is not None:
        monkeypatch.setattr(kern, "MAX_S", max_s)
    q, k, v, dout = _inputs(2, 19, h, hk, d, torch.bfloat16, seed=hk)
    _check(kern, q, k, v, dout, scale=1 / math.sqrt(d), lse_atol=1e-3)
    assert fake_aten.calls == [f"{path}_fwd", f"{path}_bwd"]


def test_cudnn_glue_non_causal(fake_aten, monkeypatch):
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: (9, 0))
    q, k, v, dout = _inputs(1, 9, 4, 2, 8, torch.float16)
    _check(kernels_cuda.CudnnKernel(), q, k, v, dout, scale=0.4, causal=False)


# ----------------------------------------------------------------------------------------------- (b) flash_attn fakes
EXPECTED = {}  # what the fakes must receive: q/k/v shapes (native GQA), scale


def _check_bshd(q, k, v):
    b, s, h, d = q.shape
    assert k.shape == v.shape and k.shape[:2] == (b, s) and k.shape[3] == d
    assert (q.shape, k.shape) == (EXPECTED["q"], EXPECTED["k"])  # native layout, k/v NOT expanded
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and d % 8 == 0
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype


def _bshd_math(q, k, v, scale, causal, window=None):
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return _math(qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1), scale, causal, window)


def _fa_window(wl, wr, causal):
    """flash-attn's (left, right) -> our window (keys i-w+1 .. i), as the fakes read it."""
    if (wl, wr) == (-1, -1):
        return None
    assert causal and wr == 0 and wl >= 0 and EXPECTED.get("window") == wl + 1
    return wl + 1


def _fa_forward_impl(
    q, k, v, dropout_p, softmax_scale, causal, wl, wr, softcap, alibi_slopes, return_softmax
):
    _check_bshd(q, k, v)
    assert dropout_p == 0.0 and softmax_scale == EXPECTED["scale"] and isinstance(causal, bool)
    assert softcap == 0.0 and alibi_slopes is None and return_softmax is False
    out, lse = _bshd_math(q, k, v, softmax_scale, causal, _fa_window(wl, wr, causal))
    out = out.transpose(1, 2).to(q.dtype).contiguous()
    return out, lse.float(), torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


def _fa_backward_impl(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    wl,
    wr,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state,
):
    _check_bshd(q, k, v)
    assert dout.shape == out.shape == q.shape and dout.stride(-1) == 1 and out.stride(-1) == 1
    assert (dq.shape, dk.shape, dv.shape) == (
        q.shape,
        k.shape,
        v.shape,
    ) and dq.dtype == dk.dtype == q.dtype
    assert softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous()
    assert softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert dropout_p == 0.0 and softmax_scale == EXPECTED["scale"] and softcap == 0.0
    assert alibi_slopes is None and deterministic is False and rng_state is None
    window = _fa_window(wl, wr, causal)
    r_out, r_lse = _bshd_math(q, k, v, softmax_scale, causal, window)
    torch.testing.assert_close(softmax_lse.double(), r_lse, atol=1e-4, rtol=1e-4)
    assert _rel(out.transpose(1, 2), r_out) < 1e-2
    g = q.shape[2] // k.shape[2]
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))
    gq, gk, gv = _math_grads(
        qt,
        kt.repeat_interleave(g, 1),
        vt.repeat_interleave(g, 1),
        dot,
        softmax_scale,
        causal,
        window,
    )
    dq.copy_(gq.transpose(1, 2))
    dk.copy_(gk.unflatten(1, (k.shape[2], g)).sum(2).transpose(1, 2))  # GQA: sum over the group
    dv.copy_(gv.unflatten(1, (k.shape[2], g)).sum(2).transpose(1, 2))
    b, s, h, _ = q.shape
    return torch.zeros(b, h, (s + 127) // 128 * 128)  # softmax_d: [B, h, S rounded up to 128] fp32


@torch.library.custom_op("upipe_test_fake_fa::fwd", mutates_args=(), device_types="cpu")
def _fa28_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fa_forward_impl(
        q,
        k,
        v,
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
    "upipe_test_fake_fa::bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _fa28_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _fa_backward_impl(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
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


def _fa26_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    assert isinstance(window_size, tuple) and len(window_size) == 2
    out, lse, s_dmask, rng = _fa_forward_impl(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        *window_size,
        softcap,
        alibi_slopes,
        return_softmax,
    )
    return out, q, k, v, out, lse, s_dmask, rng


def _fa26_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
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
    return _fa_backward_impl(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        *window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state,
    )


def _fa25_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
):
    raise AssertionError("flash-attn 2.5 API must be refused before any call")


FLAVOURS = {
    # 2.7/2.8: torch.library.custom_op wrappers (signature behind CustomOpDef._init_fn); no __version__: the
    # signature alone must decide
    "2.8-custom-op": (None, _fa28_forward, _fa28_backward),
    "2.6-tuple-window": (None, _fa26_forward, _fa26_backward),
    # signature not inspectable: the version decides
    "2.7-opaque": (
        "2.7.4",
        lambda *a, **kw: _fa28_forward(*a, **kw),
        lambda *a, **kw: _fa28_backward(*a, **kw),
    ),
}


def _install_flash_attn(monkeypatch, version, fwd, bwd):
    pkg = types.ModuleType("flash_attn")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    pkg.__path__ = []
    if version is not None:
        pkg.__version__ = version
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward, iface._flash_attn_backward = fwd, bwd
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)


@pytest.fixture
def clear_flash_cache():
    kernels_flash_attn._flash_api.cache_clear()
    yield
    kernels_flash_attn._flash_api.cache_clear()


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("h,hk", HEADS)
@pytest.mark.parametrize("d", [16, 12])
def test_flash_attn_glue(monkeypatch, clear_flash_cache, flavour, h, hk, d):
    _install_flash_attn(monkeypatch, *FLAVOURS[flavour])
    q, k, v, dout = _inputs(2, 17, h, hk, d, torch.bfloat16, seed=hk + d)
    dp = (d + 7) // 8 * 8
    EXPECTED.update(q=(2, 17, h, dp), k=(2, 17, hk, dp), scale=1 / math.sqrt(d))
    _check(FlashAttnKernel(), q, k, v, dout, scale=1 / math.sqrt(d), lse_atol=1e-3)
    assert kernels_flash_attn._flash_api()[2] is (flavour != "2.6-tuple-window")


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_flash_attn_glue_non_causal(monkeypatch, clear_flash_cache, flavour):
    _install_flash_attn(monkeypatch, *FLAVOURS[flavour])
    q, k, v, dout = _inputs(1, 11, 4, 2, 8, torch.bfloat16, seed=3)
    EXPECTED.update(q=q.shape, k=k.shape, scale=0.35)
    _check(FlashAttnKernel(), q, k, v, dout, scale=0.35, causal=False, lse_atol=1e-3)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_flash_attn_window_glue(monkeypatch, clear_flash_cache, flavour):
    """`WindowKernel` over flash-attn passes window_size (w - 1, 0); the stand-in computes that window's attention,
    compared with the windowed reference of `tests/ops/test_windowed.py` (output, lse, every gradient)."""
    from hf_upipe.ops.windowed import WindowKernel
    from tests.ops.test_windowed import _reference as windowed_reference

    _install_flash_attn(monkeypatch, *FLAVOURS[flavour])
    q, k, v, dout = _inputs(2, 19, 4, 2, 8, torch.bfloat16, seed=5)
    EXPECTED.update(q=q.shape, k=k.shape, scale=0.3, window=6)
    kernel = WindowKernel(FlashAttnKernel(), 6)
    out, lse = kernel.forward(q, k, v, scale=0.3)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=0.3)
    want, want_lse = windowed_reference(q, k, v, 6, 0.3)
    assert _rel(out, want) < 2e-2 and (lse.double() - want_lse).abs().max() < 1e-3
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    windowed_reference(qr, kr, vr, 6, 0.3)[0].backward(dout.double())
    for got, ref in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert _rel(got, ref) < 2e-2, _rel(got, ref)
    EXPECTED.pop("window")


def test_flash_attn_too_old_is_refused(monkeypatch, clear_flash_cache):
    _install_flash_attn(monkeypatch, "2.5.9", _fa25_forward, _fa25_forward)
    q, k, v, _ = _inputs(1, 4, 2, 2, 8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="2.6"):
        FlashAttnKernel().forward(q, k, v, scale=0.3)


@pytest.mark.parametrize("module", [kernels_cuda, kernels_aten, kernels_flash_attn])
def test_flash_attn_not_imported_at_module_import(module):
    src = open(module.__file__).read()
    assert (
        "\nimport flash_attn" not in src
        and "\nfrom flash_attn" not in src
        and "transformers" not in src
    )


# ----------------------------------------------------------------------------------------------- (c) registry
def test_registry_cpu():
    kern = get_kernel("auto", "cpu", torch.float32)
    assert isinstance(kern, SdpaCpuKernel) and kern.name == "sdpa"
    assert isinstance(get_kernel("sdpa", "cpu", torch.bfloat16), SdpaCpuKernel)
    assert {"sdpa", "flash_attn"} <= set(available_kernels())
    assert available_kernels("cpu", torch.float16) == ["sdpa"]
    with pytest.raises(ValueError, match=r"'flash_attn'.*usable there: \['sdpa'\]"):
        get_kernel("flash_attn", "cpu", torch.float16)
    with pytest.raises(ValueError, match="nope"):
        check_kernel_name("nope")
    with pytest.raises(ValueError, match="nope"):
        get_kernel("nope", "cpu", torch.float32)
    check_kernel_name("auto")
    check_kernel_name("flash_attn")


@pytest.mark.parametrize("installed", [True, False])
def test_registry_cuda_selection(monkeypatch, installed):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels_flash_attn, "_flash_attn_installed", lambda: installed)
    monkeypatch.setattr(
        kernels_aten, "_cudnn_installed", lambda: False
    )  # cuDNN: test_registry_cudnn_on_hopper
    half = ["flash_attn", "sdpa"] if installed else ["sdpa"]
    assert available_kernels("cuda", torch.bfloat16) == half
    assert available_kernels("cuda", torch.float16) == half
    assert available_kernels("cuda", torch.float32) == ["sdpa"]
    assert available_kernels("cuda", torch.float64) == []
    want = FlashAttnKernel if installed else SdpaCudaKernel
    assert isinstance(get_kernel("auto", "cuda", torch.bfloat16), want)
    assert isinstance(get_kernel("auto", "cuda", torch.float32), SdpaCudaKernel)
    assert isinstance(get_kernel("sdpa", "cuda:0", torch.float16), SdpaCudaKernel)
    with pytest.raises(ValueError, match="flash_attn"):
        get_kernel("flash_attn", "cuda", torch.float32)
    with pytest.raises(ValueError):
        get_kernel("auto", "cuda", torch.float64)
    assert kernels._REGISTRY["flash_attn"][2] < kernels._REGISTRY["sdpa"][2]


@pytest.mark.parametrize("cap,cudnn", [((9, 0), True), ((8, 0), False)])
def test_registry_cudnn_on_hopper(monkeypatch, cap, cudnn):
    """ "auto" picks cuDNN for fp16/bf16 on sm90 (verified and faster there), never for fp32 or older GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels_flash_attn, "_flash_attn_installed", lambda: False)
    monkeypatch.setattr(kernels_aten, "_cudnn_installed", lambda: True)
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: cap)
    assert available_kernels("cuda", torch.bfloat16) == (["cudnn", "sdpa"] if cudnn else ["sdpa"])
    assert available_kernels("cuda", torch.float32) == ["sdpa"]
    want = kernels_cuda.CudnnKernel if cudnn else SdpaCudaKernel
    assert isinstance(get_kernel("auto", "cuda", torch.float16), want)
    assert isinstance(get_kernel("auto", "cuda", torch.float32), SdpaCudaKernel)
