"""Hollow attention in a measured training step: every tensor of the step, without the attention's arithmetic.

Entry points:
- `hollow_twin(kernel, device, dtype) -> str`: "hollow-<name>", the hollow twin (`hf_upipe.ops.kernels_hollow`)
  of the kernel `kernel` resolves to on `device` with `dtype` ("auto": the one "auto" picks there, i.e. the one
  the planned run uses).
- `hollow_torch_sdpa(kernel)`: a context inside which `torch.nn.functional.scaled_dot_product_attention` runs the
  hollow kernel `kernel` ("hollow-<name>") instead of torch's: that is what transformers' "sdpa" attention calls,
  and DeepSpeed's Ulysses around it (`StepSettings(impl="deepspeed")`), whose step has no hf_upipe kernel to swap.
  Causal attention without a mask or dropout only (what those steps run); anything else is refused.
- `step_attention(impl, kernel)`: the context `hf_upipe.planning.train_step.measure_train_step` runs its step in:
  nothing for hf_upipe's impls (they take the kernel through `init_sequence_parallel`), `hollow_torch_sdpa` for
  DeepSpeed's with a hollow kernel.

Both need an open `hf_upipe.ops.kernels_hollow.hollow_attention()` scope to run: their outputs are garbage by
design, and only the memory of the step is meaningful. Torch's SDPA saves q, k, v, out and the log-sum-exp for its
backward, as `_HollowSdpa` does; what torch's chosen backend allocates beyond that (its workspace, a k/v expansion
for grouped-query attention) is measured by comparing with the real step (`benchmarks/gpu/max_context.py
--check-lengths`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.kernels_hollow import hollow_name

__all__ = ["hollow_torch_sdpa", "hollow_twin", "step_attention"]


def hollow_twin(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The name of the hollow twin of `kernel` ("auto" or a name) on `device` with `dtype`."""
    if kernel.startswith("hollow-"):
        return kernel
    return hollow_name(get_kernel(kernel, device, dtype).name)


class _HollowSdpa(torch.autograd.Function):
    """q [B,h,S,D], k/v [B,hk,S,D] -> out [B,h,S,D] through an `AttentionKernel` (layouts [B,S,*,D])."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale):
        out, lse = kernel.forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale
        )  # [B, S, h, D], [B, h, S]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale = kernel, scale
        return out.transpose(1, 2)  # [B, h, S, D]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.kernel.backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out,
            lse,
            scale=ctx.scale,
        )  # dq [B, S, h, D], dk/dv [B, S, hk, D]
        return (*(g.transpose(1, 2) for g in grads), None, None)


def _hollow_sdpa_function(kernel: str):
    def scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        if attn_mask is not None or dropout_p != 0.0 or not is_causal:
            raise NotImplementedError(
                f"the hollow SDPA ({kernel}) stands for causal attention without a mask or dropout; got "
                f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}, "
                f"is_causal={is_causal}"
            )
        kern = get_kernel(kernel, query.device, query.dtype)
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        return _HollowSdpa.apply(query, key, value, kern, scale)

    return scaled_dot_product_attention


@contextlib.contextmanager
def hollow_torch_sdpa(kernel: str) -> Iterator[None]:
    """`torch.nn.functional.scaled_dot_product_attention` runs the hollow `kernel` inside (see the docstring)."""
    if not kernel.startswith("hollow-"):
        raise ValueError(
            f"hollow_torch_sdpa takes a hollow kernel ('hollow-<name>'), got {kernel!r}"
        )
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _hollow_sdpa_function(kernel)
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
    return hollow_torch_sdpa(kernel)
