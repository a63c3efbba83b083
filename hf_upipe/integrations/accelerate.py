"""`UPipePlugin`: UPipe sequence parallelism for a custom training loop under `accelerate launch`.

Entry points:
- `UPipePlugin(...)`: the settings (an `hf_upipe.UPipeConfig`: help text, `UPIPE_*` environment fallbacks,
  validation that names the fix), plus `prepare(accelerator, model, optimizer, dataloader, ...)`.
- `UPipeLoss`: what `prepare` returns to compute the loss of a shard: `loss(model, shard, num_items)`, and
  `count(shards)` for the label tokens of a gradient-accumulation window.
- `share_batches_within_sp(dataloader, state)`: make an accelerate-prepared dataloader give every rank of an SP
  group the same batches (also used by `UPipeTrainer`).

The flow (accelerate's own FSDP2 or DDP does the data-parallel part; params are sharded over ALL ranks by FSDP2):

    accelerator = Accelerator()                            # FSDP2 / DDP / CPU from the accelerate config
    plugin = UPipePlugin(heads_per_chunk=1, tiled_mlp=True)  # or UPIPE_* variables
    model, optimizer, loader, loss = plugin.prepare(accelerator, model, optimizer, loader)
    for shards in plugin.windows(loader, gradient_accumulation_steps):   # each shard: this rank's piece
        n = loss.count(shards)                             # label tokens of the window, all ranks, counted once
        for shard in shards:
            with plugin.step(model):                       # offloads checkpointed inputs if configured
                accelerator.backward(loss(model, shard, n))
        optimizer.step(); optimizer.zero_grad()

`prepare` does, in order: `init_sequence_parallel` (SP groups of `sp_size` neighbouring ranks, data parallel
across them), `prepare_model(model, plugin)` (fused block, tiled MLP), `accelerator.prepare(model, optimizer,
loader, *others)`, re-points the loader's sharding from all processes to the SP groups, and wraps it so it yields
`shard_batch` shards. The loss of rank r is W x (its shard's token-loss sum) / (label tokens of the window over all
ranks): DDP and FSDP2 average gradients over the W ranks, so the update is the exact token mean.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

from hf_upipe.config import UPipeConfig
from hf_upipe.data import ShardedDataLoader
from hf_upipe.distributed import SequenceParallelState, init_sequence_parallel, set_sequence_parallel_state
from hf_upipe.integrations.fused import prepare_model
from hf_upipe.integrations.loss import shard_loss_sum
from hf_upipe.memory.offload import offload_checkpoints
from hf_upipe.planning.auto import apply_auto_settings

__all__ = ["UPipeLoss", "UPipePlugin", "share_batches_within_sp"]

NO_SP = SequenceParallelState(sp_group=None, sp_size=1, sp_rank=0, dp_group=None, dp_size=1, dp_rank=0)


def share_batches_within_sp(dataloader, state: SequenceParallelState):
    """Re-point an accelerate-prepared dataloader's sharding from all processes to the SP groups (in place).

    Returns:
        The same dataloader: rank r now gets the batches of data-parallel replica `state.dp_rank` of
        `state.dp_size`, so all ranks of one SP group get the same batches (seeding, epochs, resume skipping and
        eval remainders stay accelerate's).

    Raises:
        NotImplementedError: a dataloader accelerate dispatches from rank 0 (`dispatch_batches=True`), or one
            without accelerate's sharding.
    """
    if state.sp_size == 1 or not dist.is_initialized() or dist.get_world_size() == 1:
        return dataloader
    if isinstance(dataloader, DataLoaderDispatcher):
        raise NotImplementedError("hf_upipe cannot shard batches dispatched from rank 0: set dispatch_batches=False "
                                  "(DataLoaderConfiguration / TrainingArguments accelerator_config).")
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates = (batch_sampler, getattr(batch_sampler, "batch_sampler", None), getattr(dataloader, "dataset", None))
    for candidate in candidates:
        if isinstance(candidate, (BatchSamplerShard, IterableDatasetShard)):
            candidate.num_processes, candidate.process_index = state.dp_size, state.dp_rank
            return dataloader
    raise NotImplementedError(
        f"hf_upipe could not find accelerate's batch sharding in a {type(dataloader).__name__}: pass the "
        "dataloader through accelerator.prepare (UPipePlugin.prepare does)."
    )


def world_sum(*values, device) -> list[float]:
    """Sum small numbers over all ranks in one all_reduce (float64: exact for token counts)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


class UPipeLoss:
    """The token-weighted causal-LM loss of a shard (built by `UPipePlugin.prepare`)."""

    def __init__(self, state: SequenceParallelState, config: UPipeConfig, device: torch.device):
        self.state, self.config, self.device = state, config, device

    def count(self, shards: list[dict]) -> float:
        """Label tokens of these shards' batches over all ranks, each counted once (one all_reduce)."""
        own = sum(float(s["num_label_tokens"]) for s in shards) if self.state.sp_rank == 0 else 0.0
        return world_sum(own, device=self.device)[0]

    def __call__(self, model, shard: dict, num_items: float | None = None) -> torch.Tensor:
        """W x (this shard's summed token loss) / num_items (default: `count([shard])`), ready for backward."""
        if num_items is None:
            num_items = self.count([shard])
        inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
        loss_sum, _ = shard_loss_sum(model, inputs, shard["shift_labels"], tiled=self.config.tiled_loss,
                                     chunk_tokens=self.config.loss_chunk_tokens)
        world = dist.get_world_size() if dist.is_initialized() else 1
        return loss_sum * (world / max(float(num_items), 1.0))


@dataclass
class UPipePlugin(UPipeConfig):
    """UPipe settings for `accelerate launch` scripts (all fields of `hf_upipe.UPipeConfig`), and `prepare`."""

    def prepare(self, accelerator, model, optimizer=None, dataloader=None, *others, pad_token_id: int = 0):
        """Set up SP and hand everything to `accelerator.prepare` (see the module docstring).

        Returns:
            (model, optimizer, dataloader yielding shards, *others, UPipeLoss), with None for what was not given.

        Raises:
            ValueError on every rank before any collective: sp_size not dividing the number of processes, offload
            without activation checkpointing (call `model.gradient_checkpointing_enable()` first), bad settings.
        """
        world = accelerator.num_processes
        if self.auto:
            if not getattr(model, "is_gradient_checkpointing", False):
                raise ValueError("auto=True plans with activation checkpointing on every layer: call "
                                 "model.gradient_checkpointing_enable() before UPipePlugin.prepare.")
            self.upipe_plan = apply_auto_settings(self, model, world_size=world)
        sp_size = self.resolve_sp_size(world)
        wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if wants_fsdp and str(accelerator.distributed_type) != "DistributedType.FSDP":
            raise ValueError(f"The accelerate config asks for FSDP but accelerate set up "
                             f"{accelerator.distributed_type} (accelerate runs FSDP on accelerators only): on CPU "
                             "use a DDP config such as accelerate_configs/cpu_2proc.yaml.")
        if self.offload != "none" and not getattr(model, "is_gradient_checkpointing", False):
            raise ValueError(f"offload={self.offload!r} offloads what activation checkpointing keeps: call "
                             "model.gradient_checkpointing_enable() before UPipePlugin.prepare, or offload='none'.")
        if world > 1:
            self.state = init_sequence_parallel(sp_size, **self.init_kwargs())
        else:
            self.state = NO_SP
            set_sequence_parallel_state(None)
        prepare_model(model, self)
        given = [x for x in (model, optimizer, dataloader, *others) if x is not None]
        prepared = list(accelerator.prepare(*given)) if len(given) > 1 else [accelerator.prepare(*given)]
        out = [prepared.pop(0) if x is not None else None for x in (model, optimizer, dataloader, *others)]
        if dataloader is not None:
            loader = share_batches_within_sp(out[2], self.state)
            out[2] = ShardedDataLoader(loader, self.state, pad_token_id=pad_token_id, check_same_batch=True)
        return (*out, UPipeLoss(self.state, self, accelerator.device))

    @staticmethod
    def windows(loader, steps: int):
        """Group a loader's shards into gradient-accumulation windows of `steps` (the last may be shorter)."""
        window = []
        for shard in loader:
            window.append(shard)
            if len(window) == steps:
                yield window
                window = []
        if window:
            yield window

    def step(self, model):
        """Context manager for one forward + backward: offloads checkpointed inputs when `offload` is set."""
        if self.offload == "none":
            return contextlib.nullcontext()
        return offload_checkpoints(model, self.offload, path=self.offload_path, min_bytes=self.offload_min_bytes)
