"""Pure-torch operations with explicit process groups (no transformers, accelerate or peft imports).

``upipe_attention`` is the main API: headwise-chunked sequence-parallel causal attention. Building blocks:
``all_to_all`` (sequence <-> head layouts), ``head_layout`` (GQA geometry and its checks), ``kernels`` (inner
attention kernels returning the log-sum-exp; the CUDA ones in ``kernels_cuda``, which re-exports ``kernels_aten``:
torch's SDPA and cuDNN kernels, and ``kernels_flash_attn``: FlashAttention-2; ``kernels_hollow``: their hollow
twins, which allocate a kernel's outputs without computing them, for memory measurement only), ``ring`` (ring
attention across ranks, as a kernel UPipe's stage loops call).
"""

from hf_upipe.ops.all_to_all import all_to_all_head_to_seq, all_to_all_seq_to_head
from hf_upipe.ops.head_layout import HeadLayout, valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.ops.kernels import AttentionKernel, available_kernels, get_kernel, register_kernel
from hf_upipe.ops.kernels_hollow import hollow_attention
from hf_upipe.ops.ring import RingKernel, zigzag_order
from hf_upipe.ops.upipe_attention import upipe_attention

__all__ = [
    "AttentionKernel",
    "HeadLayout",
    "RingKernel",
    "all_to_all_head_to_seq",
    "all_to_all_seq_to_head",
    "available_kernels",
    "get_kernel",
    "hollow_attention",
    "register_kernel",
    "upipe_attention",
    "valid_heads_per_chunk",
    "valid_sp_sizes",
    "zigzag_order",
]
