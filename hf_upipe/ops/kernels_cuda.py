"""CUDA attention kernels behind `hf_upipe.ops.kernels.AttentionKernel`: one import place for all of them.

Entry points (re-exported from the modules that hold them):
- `SdpaCudaKernel` ("sdpa" on CUDA), `CudnnKernel` ("cudnn") and `cudnn_available`: torch's own SDPA flash /
  memory-efficient and cuDNN kernels called at the aten level (`hf_upipe.ops.kernels_aten`).
- `FlashAttnKernel` ("flash_attn") and `flash_attn_available`: FlashAttention-2 from the `flash_attn` package
  (`hf_upipe.ops.kernels_flash_attn`).

Every kernel returns out [B,S,h,D] and lse [B,h,S] fp32 from forward and takes the lse back in backward. The CPU
tests drive them through fakes of the module-level indirections each of those two modules names.
"""

from __future__ import annotations

from hf_upipe.ops.kernels_aten import CudnnKernel, SdpaCudaKernel, cudnn_available
from hf_upipe.ops.kernels_flash_attn import FlashAttnKernel, flash_attn_available

__all__ = [
    "CudnnKernel",
    "FlashAttnKernel",
    "SdpaCudaKernel",
    "cudnn_available",
    "flash_attn_available",
]
