"""The simulated training step's allocation trace: every device allocation and free, in order, with its stream.

Entry points:

* `record_step_trace(model_config, settings, *, seq_len, world_size, sp_size, layers, ...)`: runs
  `hf_upipe.planning.train_step.simulate_train_step` with a recording `MemoryTracker` around all of it, so the trace
  holds the model's build, FSDP2 sharding and the optimizer's states (what is allocated before the step), a
  `("mark", "step")` where the step starts, then the step itself. Returns the events and the simulation's result.
* `stream_names()`: the streams a trace can name (`STREAMS`).

Streams. The CUDA caching allocator keeps the blocks of each stream apart, so the trace says which stream each
allocation is made on. On a machine without CUDA, FSDP2 enters its streams through `torch.cpu.stream` (dummies
that exist for device-agnostic code); while recording, that function is wrapped to name the stream FSDP2 enters:
"all_gather_copy_in" (the all-gather output buffer of forward and pre-backward unshards), "all_gather",
"reduce_scatter" (the reduced gradient shards), "all_reduce". The offload's copies back to the device are named
by `hf_upipe.training.offload.RESTORE_STREAM` through the step's restore context. Everything else is "default".

The trace is exact for what the tracker counts (tensor storages, including FSDP2's in-place resizes) and blind to
what it does not (kernel workspaces, NCCL buffers): `hf_upipe.planning.reserved` adds those as an allowance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_upipe.planning import tracker as _tracker
from hf_upipe.planning.simulate import fake_tensors, simulated_world

__all__ = ["STREAMS", "record_step_trace", "stream_names"]

STREAMS = ("default", "all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce", "offload")
_FSDP_STREAMS = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream")
_FSDP_STREAMS += ("all_reduce_stream",)


def stream_names() -> tuple[str, ...]:
    return STREAMS


@contextlib.contextmanager
def _named_cpu_streams() -> Iterator[None]:
    """`torch.cpu.stream(s)` also pushes the name of the FSDP2 stream `s` (see the module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext

    names: dict[int, str] = {}
    original_stream, original_init = torch.cpu.stream, FSDPCommContext.lazy_init

    def lazy_init(self, *args, **kwargs):
        out = original_init(self, *args, **kwargs)
        for attr in _FSDP_STREAMS:
            if hasattr(self, attr):
                names[id(getattr(self, attr))] = attr.removesuffix("_stream")
        return out

    @contextlib.contextmanager
    def stream(s):
        with original_stream(s), _tracker.allocation_stream(names.get(id(s), "default")):
            yield

    torch.cpu.stream, FSDPCommContext.lazy_init = stream, lazy_init
    try:
        yield
    finally:
        torch.cpu.stream, FSDPCommContext.lazy_init = original_stream, original_init


class _StepMark:
    """The `around_step` of `measure_train_step`: marks where the step starts and ends in the trace."""

    def __init__(self, recorder: _tracker.MemoryTracker):
        self.recorder = recorder

    def __enter__(self):
        self.recorder.events.append(("mark", "step"))
        return self

    def __exit__(self, *exc):
        self.recorder.events.append(("mark", "end"))
        return False


def record_step_trace(
    model_config,
    settings,
    *,
    seq_len: int,
    world_size: int,
    sp_size: int,
    layers: int,
    dtype: torch.dtype = torch.bfloat16,
    lora=None,
    kernel: str = "auto",
) -> tuple[list[tuple], dict]:
    """(events, result): the allocation trace of rank 0's build and step, and `measure_train_step`'s result.

    Events: ``("a", key, nbytes, stream)``, ``("f", key)``, ``("mark", "step" | "end")``; a key is reused only
    after its free. `kernel`: the attention kernel (`measure_train_step`'s).
    """
    from hf_upipe.planning.train_step import fsdp_mesh, measure_train_step

    with simulated_world(world_size), _named_cpu_streams():
        mesh = fsdp_mesh()
        with fake_tensors(torch.float32):
            with _tracker.MemoryTracker(record_events=True) as recorder:
                result = measure_train_step(
                    model_config,
                    settings,
                    seq_len=seq_len,
                    sp_size=sp_size,
                    layers=layers,
                    dtype=dtype,
                    mesh=mesh,
                    lora=lora,
                    around_step=_StepMark(recorder),
                    kernel=kernel,
                )
    return recorder.events, result
