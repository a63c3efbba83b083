"""Local attention patterns of transformers' masks under SP: a sliding window or chunked attention (Llama 4).

Entry points:
- `local_pattern(mask_function, batch_size, size, seq_len)`: transformers passes both a sliding-window and a chunked
  mask's size as `local_size`; which one this mask function is ("window": key t seen by query i when
  0 <= i - t < size; "chunk": when t <= i and t // size == i // size), probed at GLOBAL indices around multiples
  of `size` (a shard's local indices cannot tell them apart when the size exceeds the shard), or None (neither).
- `chunk_kernel(kernel, chunk, batch, seq_len, device, dtype)`: the kernel run inside each chunk of every row:
  `hf_upipe.ops.documents.DocumentKernel` over chunk boundaries, exactly as over packed documents (after the
  all-to-all each rank holds its heads over the whole sequence, so chunks are a property of the kernel only).
"""

from __future__ import annotations

import torch

from hf_upipe.integrations.mask_probe import mask_agrees
from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.kernels import get_kernel

__all__ = ["chunk_kernel", "local_pattern"]


def local_pattern(mask_function, batch_size: int, size: int, seq_len: int) -> str | None:
    """See the module docstring. The probes: pairs (q, k) around the first boundaries, where the two patterns
    differ (q = size, k = size - 1: a window sees it, a chunk does not) and agree (both causal inside)."""
    edges = [e for e in (size, 2 * size) if e < seq_len]
    points = sorted(
        {
            p
            for e in edges
            for p in (0, 1, e - 1, e, e + 1, min(seq_len - 1, e + size - 1))
            if 0 <= p < seq_len
        }
    )
    if not edges:
        return None
    grid = torch.tensor(points)
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(grid, grid, indexing="ij"))
    causal = q_idx >= kv_idx
    patterns = {
        "window": causal & (q_idx - kv_idx < size),
        "chunk": causal & (q_idx // size == kv_idx // size),
    }
    for name, expected in patterns.items():
        if all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size)):
            return name
    return None


def chunk_kernel(kernel, chunk: int, batch: int, seq_len: int, device, dtype):
    """`kernel` (a name or a kernel) inside each `chunk`-token block of every row of `batch` rows of `seq_len`."""
    inner = get_kernel(kernel, device, dtype) if isinstance(kernel, str) else kernel
    cuts = sorted(
        {r * seq_len + c for r in range(batch) for c in range(0, seq_len, chunk)}
        | {batch * seq_len}
    )
    return DocumentKernel(
        inner, torch.tensor(cuts, dtype=torch.int32, device=device), seq_len, min(chunk, seq_len)
    )
