"""Memory planning without a GPU: exact storage tracking and single-process simulation of a parallel rank."""

from hf_upipe.planning.simulate import fake_tensors, is_fake, simulated_world
from hf_upipe.planning.tracker import GiB, MemoryTracker, MiB, StorageRecord

__all__ = [
    "GiB",
    "MemoryTracker",
    "MiB",
    "StorageRecord",
    "fake_tensors",
    "is_fake",
    "simulated_world",
]
