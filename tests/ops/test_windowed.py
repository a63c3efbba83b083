"""`WindowKernel` against plain attention with an explicit [S, S] sliding-window mask: output, log-sum-exp and the
gradients of q, k, v, for windows shorter than, equal to and longer than a block, with grouped-query heads."""

import math

import pytest
import torch

from hf_upipe.ops.kernels import SdpaCpuKernel
from hf_upipe.ops.windowed import WindowKernel


def _reference(q, k, v, window, scale):
    """q [B, S, h, D], k/v [B, S, hk, D] -> out [B, S, h, D], lse [B, h, S] (fp64 math, explicit mask)."""
    h, hk = q.shape[2], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(h // hk, 1), vd.repeat_interleave(h // hk, 1)
    S = q.shape[1]
    i, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
    seen = (t <= i) & (t > i - window)
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))  # [B, h, S, S]
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2), lse


@pytest.mark.parametrize("S, window", [(13, 4), (16, 16), (9, 20), (17, 1), (24, 7)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_window_kernel_matches_masked_attention(S, window, dtype, tol):
    gen = torch.Generator().manual_seed(S * 31 + window)
    B, h, hk, D = 2, 4, 2, 8
    q, k, v = (torch.randn(B, S, n, D, generator=gen).to(dtype) for n in (h, hk, hk))
    dout = torch.randn(B, S, h, D, generator=gen).to(dtype)
    scale = 1 / math.sqrt(D)
    kernel = WindowKernel(SdpaCpuKernel(), window)
    out, lse = kernel.forward(q, k, v, scale=scale)
    want, want_lse = _reference(q, k, v, window, scale)
    assert (out.double() - want).abs().max() <= tol * want.abs().max()
    assert (lse.double() - want_lse).abs().max() <= tol * want_lse.abs().max()
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=scale)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _reference(qr, kr, vr, window, scale)
    ref.backward(dout.double())
    for got, ref_grad in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - ref_grad).abs().max() <= tol * (
            4 * ref_grad.abs().max() + 1
        )  # dq = 0 at window 1


def test_window_kernel_refuses_other_kernels_and_bad_windows():
    class Other:
        name = "flash_attn"

    with pytest.raises(NotImplementedError, match="'flash_attn' kernel"):
        WindowKernel(Other(), 8)
    with pytest.raises(ValueError, match="window=0"):
        WindowKernel(SdpaCpuKernel(), 0)
