"""Inner attention kernels behind one small interface: forward -> (out, lse), backward from (out, lse).

Entry points:
- `AttentionKernel`: the interface every kernel implements.
- `get_kernel(name, device, dtype)`: resolve "auto" (or a name) to a kernel instance.
- `available_kernels()`, `check_kernel_name(name)`, `register_kernel(name, factory, available, priority, auto)`.

Kernels registered here:
- "sdpa" on CPU: `aten::_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), a real flash kernel that
  returns the log-sum-exp and takes it back in backward. Grouped-query attention (fewer k/v heads) is native.
- CUDA kernels ("sdpa" on CUDA, "cudnn" and "flash_attn") live in `hf_upipe.ops.kernels_aten` and
  `hf_upipe.ops.kernels_flash_attn` (both re-exported by `hf_upipe.ops.kernels_cuda`); they are registered here with
  factories that import those modules only when a CUDA kernel is asked for.
- "hollow-<name>": each kernel's hollow twin, registered by `hf_upipe.ops.kernels_hollow` (imported by
  `hf_upipe.ops`) with `auto=False`: it allocates the kernel's outputs without computing them, for memory
  measurement only, never chosen by "auto" nor listed by `available_kernels`, usable only inside
  `hollow_attention()`.

Layout legend (every kernel): B batch, S full sequence, h query heads, hk k/v heads (h % hk == 0), D head dim.
q: [B, S, h, D], k/v: [B, S, hk, D], any strides with stride(-1) == 1 (the all-to-all hands over views of its
receive buffer); out: [B, S, h, D]; lse: [B, h, S] float32 (float64 for float64 inputs); the attention is
causal with the top-left alignment (query i sees keys 0..i).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

__all__ = [
    "AttentionKernel",
    "SdpaCpuKernel",
    "available_kernels",
    "check_kernel_name",
    "get_kernel",
    "register_kernel",
]


class AttentionKernel(Protocol):
    """What UPipe needs from an attention kernel."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,S,h,D], k/v [B,S,hk,D] -> out [B,S,h,D], lse [B,h,S] (fp32)."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        scale: float,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients dq [B,S,h,D], dk/dv [B,S,hk,D] (summed over the query heads that share a k/v head)."""
        ...


class SdpaCpuKernel:
    """torch SDPA's flash kernel for CPU, called at the aten level to get and reuse the log-sum-exp."""

    name = "sdpa"

    # the aten calls, overridden by the hollow twin (hf_upipe.ops.kernels_hollow)
    _fwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    _bwd = staticmethod(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def forward(self, q, k, v, *, scale, causal=True):
        # aten wants [B, h, S, D]; a transposed view costs no copy. out comes back in q's physical layout.
        out, lse = self._fwd(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse  # [B, S, h, D], [B, h, S]

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        dq, dk, dv = self._bwd(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            lse,
            0.0,
            causal,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# name -> (factory(device) -> kernel, available(device, dtype) -> bool, priority for "auto": lower first,
#          whether "auto" may pick it)
_REGISTRY: dict[
    str,
    tuple[
        Callable[[torch.device], AttentionKernel],
        Callable[[torch.device, torch.dtype], bool],
        int,
        bool,
    ],
] = {}


def register_kernel(
    name: str,
    factory: Callable[[torch.device], AttentionKernel],
    available: Callable[[torch.device, torch.dtype], bool],
    priority: int = 100,
    auto: bool = True,
) -> None:
    """Add a kernel. `available(device, dtype)` says whether it can run there; "auto" picks the lowest priority
    among those registered with `auto=True` (the hollow kernels of `hf_upipe.ops.kernels_hollow` are not)."""
    _REGISTRY[name] = (factory, available, priority, auto)


def available_kernels(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> list[str]:
    """Names of the kernels "auto" may pick; with a device (and dtype), only those that can run there, in "auto"'s
    order. (The hollow twins are registered too but not listed: `hf_upipe.ops.kernels_hollow`.)"""
    if device is None:
        return sorted(n for n, entry in _REGISTRY.items() if entry[3])
    return _usable(torch.device(device), dtype, auto_only=True)


def _usable(device: torch.device, dtype: torch.dtype | None, auto_only: bool = False) -> list[str]:
    """The registered kernels (with `auto_only`, those "auto" may pick) that can run on `device` with `dtype`, by
    priority."""
    return [
        n
        for n, (_, ok, _, auto) in sorted(_REGISTRY.items(), key=lambda kv: kv[1][2])
        if (auto or not auto_only) and ok(device, dtype)
    ]


def check_kernel_name(name: str) -> None:
    """Raise ValueError for a kernel name that is neither "auto" nor registered."""
    if name != "auto" and name not in _REGISTRY:
        raise ValueError(
            f"Unknown attention kernel {name!r}; choose 'auto' or one of {available_kernels()}."
        )


def get_kernel(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionKernel:
    """The kernel called `name` ("auto": the first available one by priority) for tensors on `device`/`dtype`.

    Raises:
        ValueError: unknown name, or a kernel that cannot run on this device/dtype (the message lists those that can).
    """
    check_kernel_name(name)
    device = torch.device(device)
    if name == "auto":
        usable = available_kernels(device, dtype)
        if not usable:
            raise ValueError(
                f"No attention kernel can run on {device} with {dtype}; registered: {available_kernels()}"
            )
        name = usable[0]
    elif name not in _usable(device, dtype):
        usable = available_kernels(device, dtype)
        raise ValueError(
            f"Attention kernel {name!r} cannot run on {device} with {dtype}; usable there: {usable or 'none'}."
        )
    return _REGISTRY[name][0](device)


_CPU_SDPA = SdpaCpuKernel()


# The CUDA kernels live in kernels_aten and kernels_flash_attn (both re-exported by kernels_cuda), imported only when a
# CUDA kernel is asked for (those modules import nothing from here: one direction only).
def _cuda_sdpa(device: torch.device) -> AttentionKernel:
    from hf_upipe.ops.kernels_aten import SdpaCudaKernel

    return SdpaCudaKernel()


def _cuda_sdpa_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    # the aten flash / memory-efficient CUDA kernels take fp16, bf16 and fp32 (no fp64)
    return (
        device.type == "cuda"
        and dtype in (None, torch.float16, torch.bfloat16, torch.float32)
        and torch.cuda.is_available()
    )


def _flash_attn(device: torch.device) -> AttentionKernel:
    from hf_upipe.ops.kernels_flash_attn import FlashAttnKernel

    return FlashAttnKernel()


def _flash_attn_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    if device.type != "cuda":
        return False
    from hf_upipe.ops.kernels_flash_attn import flash_attn_available

    return flash_attn_available(device, dtype)


def _cudnn(device: torch.device) -> AttentionKernel:
    from hf_upipe.ops.kernels_aten import CudnnKernel

    return CudnnKernel()


def _cudnn_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    if device.type != "cuda":
        return False
    from hf_upipe.ops.kernels_aten import cudnn_available

    return cudnn_available(device, dtype)


register_kernel(
    "sdpa",
    lambda device: _CPU_SDPA if device.type == "cpu" else _cuda_sdpa(device),
    lambda device, dtype: device.type == "cpu" or _cuda_sdpa_available(device, dtype),
    priority=50,
)
register_kernel("flash_attn", _flash_attn, _flash_attn_available, priority=10)
register_kernel("cudnn", _cudnn, _cudnn_available, priority=40)
