"""Hollow attention in a measured training step: every tensor of the step, without the attention's arithmetic.

Entry points:
- `hollow_twin(kernel, device, dtype) -> str`: "hollow-<name>", the hollow twin (`hf_upipe.ops.kernels_hollow`)
  of the kernel `kernel` resolves to on `device` with `dtype` ("auto": the one "auto" picks there, i.e. the one
  the planned run uses).
- `hollow_torch_sdpa()`: a context inside which `torch.nn.functional.scaled_dot_product_attention` is a hollow twin
  of torch's flash SDPA path (native grouped-query attention: k/v not expanded): what transformers' "sdpa"
  attention calls, and DeepSpeed's Ulysses around it (`StepSettings(impl="deepspeed")`), whose step has no
  hf_upipe kernel to swap. Causal attention without a mask or dropout only (what those steps run); anything else
  is refused.
- `step_attention(impl, kernel)`: the context `hf_upipe.planning.train_step.measure_train_step` runs its step in:
  nothing for hf_upipe's impls (they take the kernel through `init_sequence_parallel`), `hollow_torch_sdpa()` for
  DeepSpeed's with a hollow kernel name (any "hollow-<name>": DeepSpeed's attention is torch's SDPA, whose twin
  is the one above).

Both need an open `hf_upipe.ops.kernels_hollow.hollow_attention()` scope to run: their outputs are garbage by
design, and only the memory of the step is meaningful. Torch's flash SDPA saves q, k, v, out and the log-sum-exp
for its backward, as `_HollowSdpa` does; what the backend torch chooses allocates beyond that (its workspace, the
flash backward's expanded dk/dv for grouped-query attention) is measured by comparing with the real step
(`benchmarks/gpu/max_context.py --check-lengths`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.kernels_hollow import hollow_name, measuring

__all__ = ["hollow_torch_sdpa", "hollow_twin", "step_attention"]


def hollow_twin(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The name of the hollow twin of `kernel` ("auto" or a name) on `device` with `dtype`."""
    if kernel.startswith("hollow-"):
        return kernel
    return hollow_name(get_kernel(kernel, device, dtype).name)


def _zeros_bshd(b: int, h: int, s: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """[B, h, S, D] as a view of a new contiguous [B, S, h, D] tensor of zeros: the layout torch's SDPA returns."""
    return torch.zeros(b, s, h, d, dtype=like.dtype, device=like.device).transpose(1, 2)


class _HollowSdpa(torch.autograd.Function):
    """Twin of torch's flash SDPA with native grouped-query attention: q [B,h,S,D], k/v [B,hk,S,D] -> out
    [B,h,S,D]. Allocates what that path returns (out, lse [B,h,S] fp32, on CUDA the philox seed and offset) and
    saves what its autograd node saves (q, k, v, out, lse); the backward returns dq, dk, dv (k/v not expanded)."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, s, d = q.shape
        out, lse = _zeros_bshd(b, h, s, d, q), torch.zeros(b, h, s, device=q.device)
        if (
            q.device.type == "cuda"
        ):  # the CUDA kernels' philox seed and offset, saved too (the CPU one has none)
            ctx.philox = tuple(
                torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2)
            )
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        return tuple(_zeros_bshd(*x.shape, x) for x in (q, k, v))


def _hollow_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`torch.nn.functional.scaled_dot_product_attention`'s signature; causal, no mask, no dropout only."""
    if not measuring():
        raise RuntimeError(
            "the hollow SDPA computes nothing (its outputs are meaningless zeros) and serves memory measurement "
            "only, inside `hf_upipe.ops.kernels_hollow.hollow_attention()`"
        )
    if attn_mask is not None or dropout_p != 0.0 or not is_causal:
        raise NotImplementedError(
            "the hollow SDPA stands for causal attention without a mask or dropout; got "
            f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}, "
            f"is_causal={is_causal}"
        )
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError("k/v with fewer heads than q need enable_gqa=True, as in torch's SDPA")
    return _HollowSdpa.apply(query, key, value)


@contextlib.contextmanager
def hollow_torch_sdpa() -> Iterator[None]:
    """`torch.nn.functional.scaled_dot_product_attention` is the hollow twin inside (see the module docstring)."""
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _hollow_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def step_attention(impl: str, kernel: str):
    """The context of a measured step's attention (see the module docstring)."""
    if impl != "deepspeed":
        return contextlib.nullcontext()
    if kernel == "auto":
        return contextlib.nullcontext()  # DeepSpeed's Ulysses as it runs: torch's own SDPA
    if not kernel.startswith("hollow-"):
        raise ValueError(
            f"kernel={kernel!r}: DeepSpeed's Ulysses runs torch's own SDPA; a step of it takes kernel='auto' "
            "(as it runs) or a hollow kernel (memory measurement)"
        )
    return hollow_torch_sdpa()
