"""Single-process simulation of a sequence-parallel rank: fake process group + fake tensors.

Entry points:

* :func:`simulated_world`: initialises a ``torch.distributed`` process group with the ``"fake"`` backend, so that
  collectives (``all_to_all_single``, ``all_gather_into_tensor``, ``new_group``, device meshes, ...) run in one
  process without communicating. Use it for shapes and memory only: with real tensors an all-to-all just leaves a copy
  of the input in the output buffer, and ``all_reduce`` leaves the tensor unchanged.
* :func:`fake_tensors`: enters ``FakeTensorMode``, so that tensors carry shapes, dtypes, strides and storage sizes but
  no data. Combined with :class:`hf_upipe.planning.tracker.MemoryTracker` this measures the per-rank memory of
  a real model at sequence lengths that could never be allocated on the host.
* :func:`is_fake` and :func:`chunk_starts`: re-exported from :mod:`hf_upipe.ops.fake`, the bottom module the
  runtime shares with the planner (fake-tensor detection; chunk loops abbreviated on fake tensors).

Recipe (Llama-sized attention at S = 1M on 8 ranks, in well under a second)::

    with simulated_world(8), fake_tensors(dtype=torch.bfloat16):
        q = torch.empty(1, 2**20 // 8, 32, 128, requires_grad=True)
        with MemoryTracker() as tracker:  # inside the fake mode
            ...

This module does not import transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_upipe.ops.fake import chunk_starts, is_fake

__all__ = ["chunk_starts", "fake_tensors", "is_fake", "simulated_world"]


@contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Runs the body as rank ``rank`` of a fake ``world_size``-rank process group.

    The group uses the ``"fake"`` backend from ``torch.testing._internal.distributed.fake_pg`` (importing that module
    registers the backend), with a ``FakeStore``. Collectives return immediately and subgroups (``dist.new_group``,
    ``init_device_mesh("cpu", ...)``) work for any rank. The default group is destroyed on exit, even on error, so
    several simulated worlds can run one after another in the same process.

    Args:
        world_size: Number of simulated ranks, at least 1.
        rank: The rank this process plays, in ``[0, world_size)``.

    Yields:
        The default (world) process group.

    Raises:
        ValueError: If ``world_size`` or ``rank`` is out of range.
        RuntimeError: If ``torch.distributed`` is unavailable or a process group is already initialised (a real job
            or another simulation: nesting would silently replace it).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_world() needs a process without a process group, but one is already initialised "
            f"(backend={dist.get_backend()!r}, world_size={dist.get_world_size()}); "
            "call torch.distributed.destroy_process_group() first"
        )
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,
    )  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        world = dist.group.WORLD
        assert world is not None
        yield world
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def fake_tensors(
    dtype: torch.dtype | None = None, *, allow_non_fake_inputs: bool = False
) -> Iterator[FakeTensorMode]:
    """Runs the body under ``FakeTensorMode``: tensors and modules built inside hold no data.

    Tensors stay on device ``"cpu"``. Do not switch the simulation to other devices:

    * fake ``"cuda"`` on a CPU-only build of torch aborts the whole process (an uncatchable C++ ``terminate``) as
      soon as autograd runs, and ``nn.Module`` s cannot be moved there;
    * ``"meta"`` (plain or fake) sends ``F.scaled_dot_product_attention`` to the math backend, which materialises the
      S x S score matrix, so attention memory would be wrong by orders of magnitude. On fake ``"cpu"`` tensors SDPA
      uses the CPU flash kernel, whose memory is linear in S like the GPU kernels.

    The byte counts of fake CPU tensors equal those of CUDA tensors with the same shapes and dtypes.

    Args:
        dtype: If given, the torch default dtype for the duration of the block, so that modules are *built* in this
            dtype (``module.to(dtype)`` fails under fake mode: "Cannot swap t1 because it has weakref"). Must be a
            floating-point dtype. The previous default dtype is restored on exit.
        allow_non_fake_inputs: Passed to ``FakeTensorMode``: allow real tensors created outside the block to be mixed
            with fake ones (they are then treated as fake).

    Yields:
        The active ``FakeTensorMode``.

    Raises:
        ValueError: If ``dtype`` is not a floating-point dtype.
    """
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"default dtype must be a floating-point dtype, got {dtype}")
    previous = torch.get_default_dtype()
    mode = FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with mode:
            yield mode
    finally:
        torch.set_default_dtype(previous)
