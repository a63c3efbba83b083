"""Feed a custom training loop this rank's sequence shards: a loader wrapper and the sampler that goes with it.

Entry points:
- `ShardedDataLoader(dataloader, state, *, pad_token_id=0)`: wraps a loader that yields the SAME batch on every
  rank of an SP group and yields `hf_upipe.data.shard_batch(batch, state.sp_rank, state.sp_size)`.
- `sampler_kwargs(state)`: `dict(num_replicas=state.dp_size, rank=state.dp_rank)` for a `DistributedSampler`, so
  ranks of one SP group draw the same samples and different SP groups draw different ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_upipe.data import shard_batch
from hf_upipe.distributed import SequenceParallelState

__all__ = ["ShardedDataLoader", "sampler_kwargs"]


def sampler_kwargs(state: SequenceParallelState) -> dict:
    """`DistributedSampler` arguments that give every rank of one SP group the same samples.

    Args:
        state: from `init_sequence_parallel`.

    Returns:
        `dict(num_replicas=state.dp_size, rank=state.dp_rank)`: one replica per SP group, not per rank.
    """
    return {"num_replicas": state.dp_size, "rank": state.dp_rank}


def _collective_device(group) -> torch.device:
    """CPU for gloo (also "cpu:gloo,cuda:nccl"), the current accelerator for NCCL-like backends."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or torch.accelerator.current_accelerator() is None:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _checksum(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 [4]: B, S, and two position-weighted sums of the token ids (order-sensitive, overflow-free)."""
    flat = ids.reshape(-1).to(device=device, dtype=torch.long)  # [B*S]
    prime = 2_147_483_647
    weights = (torch.arange(flat.numel(), device=device) * 1_000_003 + 12_345) % prime + 1  # [B*S]
    return torch.stack(
        [
            torch.tensor(ids.shape[0], device=device),
            torch.tensor(ids.shape[1], device=device),
            ((flat % prime) * weights % prime).sum(),
            flat.sum(),
        ]
    )


class ShardedDataLoader:
    """Yield this rank's sequence shard of every batch of a loader that gives all SP ranks the same batch.

    Build the wrapped loader so that every rank of one SP group gets the same batches and different SP groups
    get different ones: `DistributedSampler(dataset, **sampler_kwargs(state), seed=...)` (NOT the world size and
    rank, which `DistributedSampler` defaults to), the same seed, batch size and collator on every rank. The
    number of batches per epoch is then the same as plain data parallelism over `state.dp_size` replicas.

    Args:
        dataloader: any iterable of collated batch dicts (`input_ids` [B, S], ...), usually a torch DataLoader.
        state: this rank's `SequenceParallelState`.
        pad_token_id: see `shard_batch`.
        ignore_index: see `shard_batch`.
        check_same_batch: on the first batch of each pass, all-gather a checksum of `input_ids` over
            `state.sp_group` and raise the same ValueError on every rank if the SP ranks got different batches
            (one tiny collective per epoch; every rank must iterate). Skipped when sp_size is 1.
    """

    sampler_kwargs = staticmethod(sampler_kwargs)

    def __init__(
        self,
        dataloader,
        state: SequenceParallelState,
        *,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        check_same_batch: bool = True,
    ):
        self.dataloader = dataloader
        self.state = state
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index
        self.check_same_batch = check_same_batch

    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader's sampler (or loader) `set_epoch`, as `DistributedSampler` needs."""
        for obj in (getattr(self.dataloader, "sampler", None), self.dataloader):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def __iter__(self):
        state = self.state
        for i, batch in enumerate(self.dataloader):
            if i == 0 and self.check_same_batch and state.sp_size > 1:
                self._verify_same_batch(batch["input_ids"])
            yield shard_batch(
                batch,
                state.sp_rank,
                state.sp_size,
                pad_token_id=self.pad_token_id,
                ignore_index=self.ignore_index,
            )

    def _verify_same_batch(self, ids: torch.Tensor) -> None:
        group = self.state.sp_group
        device = _collective_device(group)
        mine = _checksum(ids, device)
        every = [torch.empty_like(mine) for _ in range(self.state.sp_size)]
        dist.all_gather(every, mine, group=group)  # [P] x [4]
        rows = [tuple(t.tolist()) for t in every]
        if len(set(rows)) > 1:
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            raise ValueError(
                f"The {self.state.sp_size} ranks of this sequence-parallel group loaded different batches (SP ranks "
                f"{differ} differ from SP rank 0; shapes {[row[:2] for row in rows]}). ShardedDataLoader needs the "
                "same batch on every rank of an SP group: build the sampler with "
                f"DistributedSampler(dataset, **sampler_kwargs(state)) (num_replicas={self.state.dp_size}, "
                f"rank={self.state.dp_rank}), not the world size and rank, with the same seed on every rank."
            )
