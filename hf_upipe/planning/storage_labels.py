"""Scopes that name the storages created inside them, for the `MemoryTracker` s that record such names.

Entry points:

* `storage_label(label)`: a context manager; storages created inside get `label` in every labeling tracker,
  whatever its labeler says (code that knows what it allocates, such as the offload's copy back of a checkpoint,
  says so).
* `checkpoint_label()`: `storage_label("checkpoints")`, the planner's restore context for the offload.
* `allocation_stream(name)`: a context manager; storages created inside are logged as allocated on stream `name`
  by trackers with ``record_events`` (`hf_upipe.planning.alloc_trace`).
* `LABEL_OVERRIDE` / `STREAM`: the stacks of those names, innermost last, which `hf_upipe.planning.tracker` reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["LABEL_OVERRIDE", "STREAM", "allocation_stream", "checkpoint_label", "storage_label"]

LABEL_OVERRIDE: list[str] = []  # the label of storages created now, innermost last
STREAM: list[str] = []  # the stream allocations are made on, innermost last


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
