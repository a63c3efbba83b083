"""Scopes that name the storages created inside them, for the `MemoryTracker` s that record such names.

Entry points:

* `storage_label(label)`: a context manager; storages created inside get `label` in every labeling tracker,
  whatever its labeler says (code that knows what it allocates, such as the offload's copy back of a checkpoint,
  says so).
* `checkpoint_label()`: `storage_label("checkpoints")`, the planner's restore context for the offload.
* `allocation_stream(name)`: a context manager; storages created inside are logged as allocated on stream `name`
  by trackers with ``record_events`` (`hf_upipe.planning.alloc_trace`).
* `host_memory()`: a context manager; storages created (or `track`-ed) inside are host memory: trackers count them
  apart from the device (`MemoryTracker.host_bytes`), as FSDP2's host offload keeps the model's state there.
* `LABEL_OVERRIDE` / `STREAM` / `HOST`: the stacks of those scopes, innermost last, which `hf_upipe.planning.tracker`
  reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "HOST",
    "LABEL_OVERRIDE",
    "STREAM",
    "allocation_stream",
    "checkpoint_label",
    "host_memory",
    "storage_label",
]

LABEL_OVERRIDE: list[str] = []  # the label of storages created now, innermost last
STREAM: list[str] = []  # the stream allocations are made on, innermost last
HOST: list[bool] = []  # non-empty: storages created now are host memory


def checkpoint_label():
    """`storage_label("checkpoints")`: the planner passes it as the offload's `restore_context`, so the layer inputs
    copied back to the device in backward are counted as checkpoints (hf_upipe.planning.categories)."""
    return storage_label("checkpoints")


@contextlib.contextmanager
def storage_label(label: str) -> Iterator[None]:
    """Storages created inside get `label` in every labeling `MemoryTracker`, whatever its labeler says."""
    LABEL_OVERRIDE.append(label)
    try:
        yield
    finally:
        LABEL_OVERRIDE.pop()


@contextlib.contextmanager
def allocation_stream(name: str) -> Iterator[None]:
    """Storages created inside are logged as allocated on stream `name` by trackers with ``record_events``."""
    STREAM.append(name)
    try:
        yield
    finally:
        STREAM.pop()


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Storages created (or `track`-ed) inside are host memory: trackers count them apart from the device."""
    HOST.append(True)
    try:
        yield
    finally:
        HOST.pop()
