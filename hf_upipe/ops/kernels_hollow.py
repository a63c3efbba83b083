"""Hollow attention kernels: a real kernel's tensors without its arithmetic, for measuring memory only.

A hollow kernel is the twin of a real one: the real kernel's own wrapper code runs unchanged (the head-dim padding,
the k/v expansion for grouped-query attention, the transposes, the contiguous copies, the dk/dv sums), and only
the call into aten or flash-attn is replaced by allocations of the outputs that call returns, with the same
shapes, strides and dtypes, in the same order (zero-filled: a memset, no other allocation, and the numbers
downstream stay finite, so the step's checks on values, such as the tiled loss's, still pass). So a training
step with a hollow kernel allocates every tensor the real step allocates, at the cost of the projections, the MLP
and the loss alone: a step at millions of tokens takes seconds to minutes instead of hours of attention
arithmetic. What the real call allocates *inside* (its workspace, e.g. the flash backward's fp32 accumulator of
dq) is not allocated here: measure it as the difference between the real and the hollow step where both finish
(`benchmarks/gpu/max_context.py --check-lengths`).

**The outputs of a hollow kernel are garbage by design** (zeros, whatever the inputs): loss, gradients and weights
of a step with one are meaningless. Hence the guard: a hollow kernel can only be built, and only runs, inside
`hollow_attention()`, the scope a memory measurement opens (`hf-upipe calibrate --hollow-attention`, the GPU
max-context benchmark). Outside it, `get_kernel("hollow-...")` raises ValueError (so a run's kernel check
reports it with the other configuration errors) and every call of a hollow kernel raises RuntimeError; "auto"
never picks one (`hf_upipe.ops.kernels.register_kernel(..., auto=False)`), and `available_kernels()` does not list
them. A configuration naming one for training therefore fails at its kernel check, before any step.

Entry points:
- `hollow_attention()`: the measurement scope (a context manager; nests).
- `build_hollow(name, device)`: the hollow twin of the registered kernel `name` ("sdpa", "cudnn", "flash_attn");
  registered on import as "hollow-<name>" (`hf_upipe.ops` imports this module), usable where `name` is, so
  `get_kernel("hollow-<name>", ...)` calls it.
- `hollow_name(name)`: "hollow-<name>" for a real kernel's name.
- Twins: `HollowSdpaCpuKernel` (of `SdpaCpuKernel`), `HollowSdpaCudaKernel` (of `SdpaCudaKernel`: torch's flash
  and memory-efficient SDPA kernels), `HollowCudnnKernel` (of `CudnnKernel`), `HollowFlashAttnKernel` (of
  `FlashAttnKernel`; dense attention only, no flash-attn package needed).

A long call's backward is tiled around a hollow twin as around its kernel (`hf_upipe.ops.tiled_backward`: the
twin's class is its kernel's subclass, and `HollowCudnnKernel.tile_kernel` gives the twin of the fallback), so a
hollow step allocates each tile's outputs and the tiles' accumulators as the real step does.

The allocations stand for the real ops' outputs as `tests/ops/test_kernels.py`'s CPU fakes return them (which
that file checks against the wrappers), and, on CPU, as aten's CPU flash kernel returns them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_upipe.ops.kernels import SdpaCpuKernel, available_kernels, register_kernel
from hf_upipe.ops.kernels_aten import CudnnKernel, SdpaCudaKernel, efficient_lse_len
from hf_upipe.ops.kernels_flash_attn import FlashAttnKernel

__all__ = [
    "HollowCudnnKernel",
    "HollowFlashAttnKernel",
    "HollowSdpaCpuKernel",
    "HollowSdpaCudaKernel",
    "build_hollow",
    "hollow_attention",
    "hollow_name",
    "measuring",
]

_DEPTH = [0]  # open hollow_attention() scopes


@contextlib.contextmanager
def hollow_attention() -> Iterator[None]:
    """The scope in which hollow kernels may be built and run (memory measurement; see the module docstring)."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def measuring() -> bool:
    """Whether a `hollow_attention()` scope is open."""
    return _DEPTH[0] > 0


def hollow_name(name: str) -> str:
    return f"hollow-{name}"


def _require_scope(what: str, error: type[Exception] = RuntimeError) -> None:
    if not measuring():
        raise error(
            f"{what}: hollow attention kernels compute nothing (their outputs are meaningless zeros) and serve "
            "memory measurement only; they run inside `hf_upipe.ops.kernels_hollow.hollow_attention()`. For "
            "training, choose kernel='auto' or a real kernel."
        )


# ----------------------------------------------------------------------------------------------- allocations
def _bshd_as_bhsd(b: int, h: int, s: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """[B, h, S, D] as a view of a new contiguous [B, S, h, D] tensor (zeros): the layout aten's kernels return."""
    return torch.zeros(b, s, h, d, dtype=like.dtype, device=like.device).transpose(1, 2)


def _f32(*shape: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=like.device)


def _i64(*shape: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64, device=like.device)


def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv for [B, h, S, D] inputs, in aten's returned layout, allocated in that order."""
    return tuple(_bshd_as_bhsd(*x.shape, like=x) for x in (q, k, v))


class _Guarded:
    """forward / backward refused outside `hollow_attention()` (mixed in before the real kernel class)."""

    def forward(self, *args, **kwargs):
        _require_scope(f"attention kernel {self.name!r}")
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        _require_scope(f"attention kernel {self.name!r}")
        return super().backward(*args, **kwargs)


# ----------------------------------------------------------------------------------------------- twins
class HollowSdpaCpuKernel(_Guarded, SdpaCpuKernel):
    """Twin of `SdpaCpuKernel`: aten's CPU flash kernel returns out in q's physical layout (`empty_like`), lse
    [B,h,S] fp32 as a view of a contiguous [B,S,h], and its gradients as views of contiguous [B,S,h,D] tensors."""

    name = hollow_name("sdpa")

    @staticmethod
    def _fwd(q, k, v, dropout_p, is_causal, *, scale):
        b, h, s, _ = q.shape
        return torch.zeros_like(q), _f32(b, s, h, like=q).transpose(1, 2)

    @staticmethod
    def _bwd(dout, q, k, v, out, lse, dropout_p, is_causal, *, scale):
        return _grads(q, k, v)


class HollowSdpaCudaKernel(_Guarded, SdpaCudaKernel):
    """Twin of `SdpaCudaKernel` (torch's flash and memory-efficient SDPA kernels at the aten level)."""

    name = hollow_name("sdpa")

    def _flash_fwd(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        b, h, s, d = q.shape
        out, lse = _bshd_as_bhsd(b, h, s, d, like=q), _f32(b, h, s, like=q)
        rng, empty = _i64(2, like=q), torch.empty(0, device=q.device)
        return out, lse, None, None, s, k.shape[2], rng, empty, torch.empty(0, device=q.device)

    def _flash_bwd(self, dout, q, k, v, *args, **kwargs):
        return _grads(q, k, v)

    def _eff_fwd(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
        b, h, s, d = q.shape
        out, lse = _bshd_as_bhsd(b, h, s, d, like=q), _f32(b, h, efficient_lse_len(s), like=q)
        return out, lse, _i64(like=q), _i64(like=q)  # philox seed, offset: 0-d int64

    def _eff_bwd(self, dout, q, k, v, *args, **kwargs):
        return (*_grads(q, k, v), None)


class HollowCudnnKernel(_Guarded, CudnnKernel):
    """Twin of `CudnnKernel`: out like aten's, softmax stats [B,h,S,1] fp32; its fallbacks (head dims above 128,
    sequences above `MAX_S`) go to `HollowSdpaCudaKernel`, as the real one's go to `SdpaCudaKernel`."""

    name = hollow_name("cudnn")
    _fallback_class = HollowSdpaCudaKernel

    def _cudnn_fwd(self, q, k, v, is_causal, *, scale):
        b, h, s, d = q.shape
        out, stats = _bshd_as_bhsd(b, h, s, d, like=q), _f32(b, h, s, 1, like=q)
        return out, stats, None, None, s, k.shape[2], _i64(like=q), _i64(like=q), None

    def _cudnn_bwd(self, dout, q, k, v, *args, **kwargs):
        return _grads(q, k, v)


def _fa_forward(q, k, v, dropout_p, scale, causal, wl, wr, softcap, alibi, return_softmax):
    """flash-attn >= 2.7 `_flash_attn_forward`'s outputs: out [B,S,h,D] contiguous, lse [B,h,S] fp32, the (empty)
    softmax debug tensor, rng_state int64 [2]."""
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=q.dtype, device=q.device)
    lse = _f32(b, h, s, like=q)
    return out, lse, torch.empty(0, dtype=q.dtype, device=q.device), _i64(2, like=q)


def _fa_backward(dout, q, *args):
    """flash-attn's `_flash_attn_backward` writes dq/dk/dv into the caller's buffers and returns softmax_d
    [B, h, S rounded up to 128] fp32."""
    b, s, h, _ = q.shape
    return _f32(b, h, (s + 127) // 128 * 128, like=q)


class HollowFlashAttnKernel(_Guarded, FlashAttnKernel):
    """Twin of `FlashAttnKernel` (dense attention; flash-attn 2.7+'s calling convention, no package needed)."""

    name = hollow_name("flash_attn")

    def _api(self):
        return _fa_forward, _fa_backward, True

    def forward_varlen(self, *args, **kwargs):
        raise NotImplementedError("hollow kernels cover dense attention only (no packed documents)")

    backward_varlen = forward_varlen


def build_hollow(name: str, device: torch.device) -> object:
    """The hollow twin of the kernel registered as `name`, for `device` (inside `hollow_attention()` only)."""
    _require_scope(
        f"attention kernel {hollow_name(name)!r}", ValueError
    )  # the runtime checks report it
    device = torch.device(device)
    if name == "sdpa":
        return HollowSdpaCpuKernel() if device.type == "cpu" else HollowSdpaCudaKernel()
    if name == "cudnn":
        return HollowCudnnKernel()
    if name == "flash_attn":
        return HollowFlashAttnKernel()
    raise ValueError(f"no hollow twin of attention kernel {name!r}; twins: sdpa, cudnn, flash_attn")


def _register() -> None:
    def twin(name):
        return (
            lambda device: build_hollow(name, device),
            lambda device, dtype: name in available_kernels(device, dtype),
        )

    for name in ("sdpa", "cudnn", "flash_attn"):
        register_kernel(hollow_name(name), *twin(name), priority=1000, auto=False)


_register()
