"""accelerate-prepared data loaders under sequence parallelism: the same batches on every rank of an SP group.

Entry points:
- `share_batches_within_sp(dataloader, state, *, evaluation=False)`: re-point accelerate's sharding of a prepared
  loader from all W processes to the dp_size SP groups (in place), so the ranks of one SP group get the same
  batches. With `evaluation=True` the loader also stops padding its last round with repeated examples and records
  how many examples every round holds (`eval_rounds`).
- `eval_rounds(dataloader, dp_size)`: after a full pass over such an evaluation loader, the examples of each round
  (round g = the g-th batch of every data-parallel replica; what a one-process run sees as its g-th batch).

Why evaluation differs: accelerate's `even_batches` completes the last round with examples from the start of the
data set so that every process runs the same number of batches; their loss would enter an evaluation mean. Here
the loader yields only real examples (a replica may get fewer batches than another); the evaluation loop
(`UPipeRuntime.evaluate`) runs the missing rounds as throw-away forwards, so FSDP's collectives stay in step, and
weights each round by the examples recorded here.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

from hf_upipe.distributed import SequenceParallelState

__all__ = ["eval_rounds", "share_batches_within_sp"]


class _RecordingBatchSampler:
    """The batch sampler accelerate shards, recording the size of every batch it yields (every replica's, in order;
    reset at each pass). Everything else is the wrapped sampler's."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes: list[int] = []

    def __iter__(self):
        self.sizes = []
        for batch in self.inner:
            self.sizes.append(len(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):  # batch_size, drop_last, sampler, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _ExactIterableShard(IterableDatasetShard):
    """accelerate's `IterableDatasetShard` (not split_batches) without the completion of the last round by repeated
    examples; records the examples of each round (`round_sizes`). The class of a prepared shard is switched to
    this one in place: the DataLoader that holds the shard cannot be given another data set."""

    def __iter__(self):
        self.round_sizes = []
        size, first = self.batch_size, self.process_index * self.batch_size
        buffer = []
        for element in self.dataset:
            buffer.append(element)
            if len(buffer) == size * self.num_processes:
                self.round_sizes.append(len(buffer))
                yield from buffer[first : first + size]
                buffer = []
        if buffer and not self.drop_last:
            self.round_sizes.append(len(buffer))
            yield from buffer[first : first + size]


def share_batches_within_sp(dataloader, state: SequenceParallelState, *, evaluation: bool = False):
    """Re-point an accelerate-prepared dataloader's sharding from all processes to the SP groups (in place).

    Returns:
        The same dataloader: rank r now gets the batches of data-parallel replica `state.dp_rank` of
        `state.dp_size`, so all ranks of one SP group get the same batches (seeding, epochs and resume skipping stay
        accelerate's). With `evaluation`, no repeated examples and the rounds recorded (module docstring).

    Raises:
        NotImplementedError: a dataloader accelerate dispatches from rank 0 (`dispatch_batches=True`), one without
            accelerate's sharding, one whose batches accelerate splits (`split_batches=True`), or one driven by a
            rank-aware batch sampler.
    """
    if (
        not dist.is_initialized()
        or dist.get_world_size() == 1
        or (state.sp_size == 1 and not evaluation)
    ):
        return dataloader  # nothing to re-point: accelerate's own sharding is right
    if isinstance(dataloader, DataLoaderDispatcher):
        raise NotImplementedError(
            "hf_upipe cannot shard batches dispatched from rank 0: set dispatch_batches=False "
            "(DataLoaderConfiguration / TrainingArguments accelerator_config)."
        )
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates = (
        batch_sampler,
        getattr(batch_sampler, "batch_sampler", None),
        getattr(dataloader, "dataset", None),
    )
    shard = next(
        (c for c in candidates if isinstance(c, (BatchSamplerShard, IterableDatasetShard))), None
    )
    if shard is None:
        raise NotImplementedError(
            f"hf_upipe could not find accelerate's batch sharding in a {type(dataloader).__name__}: pass the "
            "dataloader through accelerator.prepare (UPipePlugin.prepare does)."
        )
    if (
        getattr(shard, "upipe_replica", None) is None
    ):  # not re-pointed yet (this function is idempotent)
        if getattr(shard, "split_batches", False):
            raise NotImplementedError(
                "hf_upipe gives every rank of an SP group whole batches: set "
                "split_batches=False (DataLoaderConfiguration / TrainingArguments "
                "accelerator_config)."
            )
        if (
            isinstance(shard, BatchSamplerShard) and shard.num_processes == 1
        ):  # a rank-aware batch sampler
            if state.sp_size == 1 and not evaluation:
                return dataloader
            raise NotImplementedError(
                f"The batch sampler {type(shard.batch_sampler).__name__} is already "
                "rank-aware (it shards batches itself): hf_upipe cannot re-point it to the SP "
                "groups; use the default sampling strategy."
            )
        shard.num_processes, shard.process_index = state.dp_size, state.dp_rank
        shard.upipe_replica = (state.dp_rank, state.dp_size)
    if evaluation:
        if isinstance(shard, BatchSamplerShard):
            shard.even_batches = False
            if not isinstance(shard.batch_sampler, _RecordingBatchSampler):
                shard.batch_sampler = _RecordingBatchSampler(shard.batch_sampler)
        else:
            shard.__class__ = _ExactIterableShard
    return dataloader


def _recorder(dataloader):
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    for candidate in (
        batch_sampler,
        getattr(batch_sampler, "batch_sampler", None),
        getattr(dataloader, "dataset", None),
    ):
        if isinstance(candidate, (_RecordingBatchSampler, _ExactIterableShard)):
            return candidate
    return None


def eval_rounds(dataloader, dp_size: int) -> list[int]:
    """Examples per round of the last full pass over an evaluation loader of `share_batches_within_sp`.

    Raises:
        RuntimeError: the loader was not prepared with `evaluation=True` (nothing was recorded).
    """
    recorder = _recorder(dataloader)
    if isinstance(recorder, _ExactIterableShard):
        return list(getattr(recorder, "round_sizes", []))
    if isinstance(recorder, _RecordingBatchSampler):
        sizes = recorder.sizes
        if getattr(recorder, "drop_last", False):  # accelerate yields complete rounds only
            sizes = sizes[: len(sizes) // dp_size * dp_size]
        return [
            sum(sizes[g * dp_size : (g + 1) * dp_size])
            for g in range(math.ceil(len(sizes) / dp_size))
        ]
    raise RuntimeError(
        "eval_rounds needs a loader prepared by share_batches_within_sp(..., evaluation=True)."
    )
