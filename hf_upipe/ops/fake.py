"""Fake-tensor helpers shared by the runtime (ops, memory, integrations) and the planner: the bottom module.

Entry points:
- `is_fake(t)`: whether `t` is a fake tensor (memory simulation: shapes and storages, no data).
- `simulating()`: whether new tensors are fake (a memory simulation's fake mode is active).
- `chunk_starts(total, step, *tensors)`: the start offsets of a chunk loop, abbreviated to its first three and last
  two chunks when any of `tensors` is fake (the simulation shortcut that keeps a 5M-token step to seconds; its
  docstring says why it is exact). On real tensors it is `range(0, total, step)`.

The runtime never needs the planner: code that must behave differently on fake tensors (skip a value check, count
a host copy as freed device memory) asks `is_fake` here. This module imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["chunk_starts", "is_fake", "simulating"]


def simulating() -> bool:
    """True inside a fake mode (a memory simulation): tensors created now carry no values."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def is_fake(t: Any) -> bool:
    """Returns True if ``t`` is a fake tensor (also through functional or traceable-subclass wrappers).

    Args:
        t: Any object; non-tensors give False.
    """
    if not isinstance(t, torch.Tensor):
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake as _torch_is_fake
    except ImportError:  # older torch: no wrapper-aware helper
        return isinstance(t, FakeTensor)
    return bool(_torch_is_fake(t))


def chunk_starts(total: int, step: int, *tensors: Any) -> range | list[int]:
    """``range(0, total, step)``, or on fake tensors only its first three and last two starts.

    For the chunk loops of the tiled loss, tiled MLP/RMSNorm and blockwise accumulators. Every chunk of a loop
    allocates storages of the same sizes and frees them before the chunk after next, and nothing that outlives a
    chunk is allocated inside the loop (outputs and accumulators are allocated before it or by chunk 0). So the
    live bytes of chunk k >= 2 repeat those of chunk 1, except for a shorter last chunk: running chunks
    0, 1, 2 and the last two gives the same peak as running them all. On fake tensors the skipped chunks
    compute nothing anyway; on real tensors every chunk runs. ``tests/planning/test_model_step.py`` checks the
    abbreviated simulation against tracked real runs of loops with many chunks, byte for byte.

    Args:
        total: loop extent. step: chunk length (>= 1). tensors: the loop's inputs; any fake one abbreviates.
    """
    starts = range(0, total, step)
    if len(starts) <= 5 or not any(is_fake(t) for t in tensors):
        return starts
    return [*starts[:3], *starts[-2:]]
