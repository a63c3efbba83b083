"""Hollow attention kernels (hf_upipe.ops.kernels_hollow) against the real kernels they stand for, on CPU.

For every twin (CPU sdpa against aten's real CPU kernel; CUDA sdpa's flash and memory-efficient paths, cuDNN and
its fallback, and flash-attn against the CPU fakes of tests/ops/test_kernels.py): forward and backward return
tensors of the same shapes, dtypes and strides, and `MemoryTracker` records the same allocations and frees, in
the same order, for MHA and GQA, padded head dims, fp16 and bf16. The fakes compute in float64 internally; for
the allocation record they run with the tracker suspended and their outputs are re-created under it, so the
record holds what the real op returns (the wrapper's own allocations are recorded as they happen). Then the guard:
never chosen by "auto", not listed, refused outside `hollow_attention()`.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from hf_upipe.ops import kernels_aten, kernels_flash_attn
from hf_upipe.ops.kernels import SdpaCpuKernel, available_kernels, check_kernel_name, get_kernel
from hf_upipe.ops.kernels_cuda import CudnnKernel, FlashAttnKernel, SdpaCudaKernel
from hf_upipe.ops.kernels_hollow import (
    HollowCudnnKernel,
    HollowFlashAttnKernel,
    HollowSdpaCpuKernel,
    HollowSdpaCudaKernel,
    hollow_attention,
)
from hf_upipe.planning.tracker import MemoryTracker
from tests.ops.test_kernels import EXPECTED, FLAVOURS, FakeAten, _inputs, _install_flash_attn

HEADS = [(4, 4), (4, 1), (8, 2)]
DTYPES = [torch.float16, torch.bfloat16]


def _materialized(fn):
    """`fn` with its own work hidden from the tracker and each tensor it returns re-created under it."""

    def fresh(r):
        if not torch.is_tensor(r):
            return r
        return torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=r.device).copy_(r)

    def run(*args, **kwargs):
        with _disable_current_modes():
            res = fn(*args, **kwargs)
        return tuple(fresh(r) for r in res) if isinstance(res, tuple) else fresh(res)

    return run


@pytest.fixture
def recorded_fakes(monkeypatch):
    """The aten fakes of test_kernels, materialized (see `_materialized`), on a Hopper-like device."""
    fake = FakeAten()
    for name in ("flash_fwd", "flash_bwd", "eff_fwd", "eff_bwd", "cudnn_fwd", "cudnn_bwd"):
        monkeypatch.setattr(kernels_aten, f"_aten_{name}", _materialized(getattr(fake, name)))
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: (9, 0))
    return fake


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """flash-attn 2.8's calling convention (the hollow twin's), fakes materialized."""
    _, fwd, bwd = FLAVOURS["2.8-custom-op"]
    kernels_flash_attn._flash_api.cache_clear()
    _install_flash_attn(monkeypatch, "2.8.3", _materialized(fwd), _materialized(bwd))
    yield
    kernels_flash_attn._flash_api.cache_clear()


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride()


def _run(kernel, q, k, v, dout, scale):
    """(metadata of out, lse, dq, dk, dv; the tracker's allocations and frees, keys numbered by allocation)."""
    with MemoryTracker(record_events=True) as tracker:
        out, lse = kernel.forward(q, k, v, scale=scale)
        grads = kernel.backward(dout, q, k, v, out, lse, scale=scale)
        meta = [_meta(t) for t in (out, lse, *grads)]
        del out, lse, grads
    index, events, n = {}, [], 0
    for ev in tracker.events:
        if ev[0] == "a":
            index[ev[1]], n = n, n + 1
            events.append(("a", ev[2]))
        elif ev[1] in index:  # (the tracker logs no allocation of 0 bytes, but logs its free)
            events.append(("f", index.pop(ev[1])))
    return meta, events


def _compare(real, hollow, q, k, v, dout):
    scale = 1 / math.sqrt(q.shape[-1])
    want_meta, want_events = _run(real, q, k, v, dout, scale)
    with hollow_attention():
        got_meta, got_events = _run(hollow, q, k, v, dout, scale)
    assert got_meta == want_meta
    assert any(e[0] == "a" for e in want_events)  # the record sees the outputs
    assert got_events == want_events


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 12])
@pytest.mark.parametrize("h,hk", HEADS)
def test_hollow_cpu_sdpa_matches_aten(h, hk, d, dtype):
    q, k, v, dout = _inputs(2, 19, h, hk, d, dtype, seed=h + hk)
    _compare(SdpaCpuKernel(), HollowSdpaCpuKernel(), q, k, v, dout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,path", [(16, "flash"), (12, "flash"), (264, "eff")])
@pytest.mark.parametrize("h,hk", HEADS)
def test_hollow_sdpa_cuda_matches_fakes(recorded_fakes, h, hk, d, path, dtype):
    q, k, v, dout = _inputs(1, 19, h, hk, d, dtype, seed=hk)
    _compare(SdpaCudaKernel(), HollowSdpaCudaKernel(), q, k, v, dout)
    assert recorded_fakes.calls == [f"{path}_fwd", f"{path}_bwd"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "d,max_s,path", [(16, None, "cudnn"), (12, None, "cudnn"), (16, 8, "flash")]
)
@pytest.mark.parametrize("h,hk", HEADS)
def test_hollow_cudnn_matches_fakes(recorded_fakes, monkeypatch, h, hk, d, max_s, path, dtype):
    real, hollow = CudnnKernel(), HollowCudnnKernel()
    if max_s is not None:  # longer than verified: both fall back to the flash kernel
        monkeypatch.setattr(real, "MAX_S", max_s)
        monkeypatch.setattr(hollow, "MAX_S", max_s)
    q, k, v, dout = _inputs(2, 19, h, hk, d, dtype, seed=hk + d)
    _compare(real, hollow, q, k, v, dout)
    assert recorded_fakes.calls == [f"{path}_fwd", f"{path}_bwd"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 12])
@pytest.mark.parametrize("h,hk", HEADS)
def test_hollow_flash_attn_matches_fakes(fake_flash_attn, h, hk, d, dtype):
    q, k, v, dout = _inputs(1, 17, h, hk, d, dtype, seed=hk + d)
    dp = (d + 7) // 8 * 8
    EXPECTED.update(q=(1, 17, h, dp), k=(1, 17, hk, dp), scale=1 / math.sqrt(d))
    _compare(FlashAttnKernel(), HollowFlashAttnKernel(), q, k, v, dout)


def test_allocation_record_tells_kernels_apart(recorded_fakes):
    """The comparison can fail: cuDNN's stats [B,h,S,1] against the flash kernel's lse differ in the record."""
    q, k, v, dout = _inputs(1, 19, 4, 1, 16, torch.bfloat16)
    with pytest.raises(AssertionError):
        _compare(
            CudnnKernel(), HollowSdpaCudaKernel(), q, k, v, dout
        )  # eff lse padded: other sizes
    flash_meta = _run(SdpaCudaKernel(), q, k, v, dout, 0.25)[1]
    with hollow_attention():
        cudnn_meta = _run(HollowCudnnKernel(), q, k, v, dout, 0.25)[1]
    assert flash_meta != cudnn_meta  # cuDNN copies dO to O's layout: one allocation more


def test_hollow_is_never_auto_and_refused_outside_measurement():
    q, k, v, dout = _inputs(1, 8, 2, 2, 8, torch.float32)
    assert all(not n.startswith("hollow") for n in available_kernels())
    assert all(not n.startswith("hollow") for n in available_kernels("cpu", torch.float32))
    check_kernel_name("hollow-cudnn")  # a registered name
    with pytest.raises(ValueError, match="memory measurement only"):
        get_kernel("hollow-sdpa", "cpu", torch.float32)
    with hollow_attention():
        assert isinstance(get_kernel("auto", "cpu", torch.float32), SdpaCpuKernel)
        assert not isinstance(get_kernel("auto", "cpu", torch.float32), HollowSdpaCpuKernel)
        kern = get_kernel("hollow-sdpa", "cpu", torch.float32)
        assert isinstance(kern, HollowSdpaCpuKernel) and kern.name == "hollow-sdpa"
        out, lse = kern.forward(q, k, v, scale=0.3)
        with pytest.raises(ValueError, match="cannot run on cpu"):
            get_kernel("hollow-cudnn", "cpu", torch.bfloat16)
    with pytest.raises(RuntimeError, match="hollow-sdpa"):
        kern.forward(q, k, v, scale=0.3)  # built inside, called outside
    with pytest.raises(RuntimeError, match="memory measurement only"):
        kern.backward(dout, q, k, v, out, lse, scale=0.3)


def test_hollow_registry_on_cuda(monkeypatch):
    """On a Hopper-like CUDA device the twins are usable by name where their kernels are, and "auto" is unchanged."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels_flash_attn, "_flash_attn_installed", lambda: True)
    monkeypatch.setattr(kernels_aten, "_cudnn_installed", lambda: True)
    monkeypatch.setattr(kernels_aten, "_device_capability", lambda device: (9, 0))
    assert available_kernels("cuda", torch.bfloat16) == ["flash_attn", "cudnn", "sdpa"]
    with hollow_attention():
        assert isinstance(get_kernel("auto", "cuda", torch.bfloat16), FlashAttnKernel)
        for name, cls in (
            ("hollow-sdpa", HollowSdpaCudaKernel),
            ("hollow-cudnn", HollowCudnnKernel),
            ("hollow-flash_attn", HollowFlashAttnKernel),
        ):
            assert type(get_kernel(name, "cuda", torch.bfloat16)) is cls
        with pytest.raises(NotImplementedError, match="dense"):
            HollowFlashAttnKernel().forward_varlen()
