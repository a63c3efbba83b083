"""`UPipePlugin`: UPipe sequence parallelism for a custom training loop under `accelerate launch`.

Entry points:
- `UPipePlugin(...)`: the settings (an `hf_upipe.UPipeConfig`: help text, `UPIPE_*` environment fallbacks,
  validation that names the fix), plus `prepare(accelerator, model, optimizer, dataloader, ...)`, which returns the
  prepared objects and the run's `hf_upipe.training.runtime.UPipeRuntime` (the same object `UPipeTrainer` uses): the
  loss
  of a shard, token counts, gradient-accumulation windows, the offload context of a step, exact evaluation.

The flow (accelerate's own FSDP2, DDP or DeepSpeed does the data-parallel part; params are sharded over ALL ranks
by FSDP2 and ZeRO-3; under DeepSpeed, windows of one batch: `docs/deepspeed.md`):

    accelerator = Accelerator()                            # FSDP2 / DDP / CPU from the accelerate config
    plugin = UPipePlugin(heads_per_chunk=1, tiled_mlp=True)  # or UPIPE_* variables
    model, optimizer, loader, upipe = plugin.prepare(accelerator, model, optimizer, loader)
    for shards in upipe.windows(loader, gradient_accumulation_steps):   # each shard: this rank's piece
        n = upipe.count(shards)                            # label tokens of the window, all ranks, counted once
        for shard in shards:
            with upipe.step(model):                        # offloads checkpointed inputs if configured
                accelerator.backward(upipe.loss(model, shard, n))
        optimizer.step(); optimizer.zero_grad()
    eval_loss = upipe.evaluate(model, eval_loader)         # exact token mean; eval_loader from accelerator.prepare

`prepare` does, in order (`UPipeRuntime.setup`): the checks of the settings against the launch and the model, on
every rank, before any other collective (sp_size, heads, kv heads, heads_per_chunk, kernel, checkpointing for
offload/auto); auto settings; `init_sequence_parallel` (SP groups of `sp_size` neighbouring ranks, data parallel
across them); `prepare_model` (fused block, tiled MLP); then `accelerator.prepare(model, optimizer, loader,
*others)` (with model_offload='cpu', accelerate's FSDP2 plugin gets the host-offload policy first:
`hf_upipe.training.model_offload`), re-points the loaders' sharding from all processes to the SP groups, and
wraps the training loader so it yields `shard_batch` shards. The plugin itself stays plain settings: nothing is
stored on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.utils.data import DataLoader

from hf_upipe.allocator import arrange_allocator
from hf_upipe.config import UPipeConfig
from hf_upipe.data import ShardedDataLoader
from hf_upipe.training.loaders import share_batches_within_sp
from hf_upipe.training.model_offload import (
    apply_model_offload,
    check_cpu_collectives,
    check_model_offload,
)
from hf_upipe.training.parallelism import find_parallelism, resolve_launch
from hf_upipe.training.runtime import UPipeRuntime, activation_checkpointing

__all__ = ["UPipePlugin"]


@dataclass
class UPipePlugin(UPipeConfig):
    """UPipe settings for `accelerate launch` scripts (all fields of `hf_upipe.UPipeConfig`), and `prepare`."""

    def __post_init__(self):
        super().__post_init__()
        arrange_allocator(
            self.allocator
        )  # built before the model goes to the GPU: the mode can still be set

    def prepare(
        self,
        accelerator,
        model,
        optimizer=None,
        dataloader=None,
        *others,
        pad_token_id: int = 0,
        output_dir: str | None = None,
        checkpointing_fix: str | None = None,
    ):
        """Set up SP and hand everything to `accelerator.prepare` (see the module docstring).

        Args:
            accelerator: the `accelerate.Accelerator`.
            model: the transformers or PEFT model (activation checkpointing already enabled, if wanted).
            optimizer, dataloader, *others: passed to `accelerator.prepare`; data loaders among `others` are
                re-pointed to the SP groups too (pass them to `UPipeRuntime.evaluate` as they are).
            pad_token_id: the id the sequence is padded with to a multiple of sp_size.
            output_dir: the folder checkpoints will be written to, if any: checked writable on every rank now,
                not at the first save.
            checkpointing_fix: how your script turns activation checkpointing on, for errors that need it (a
                script with a flag says "add --checkpointing"); default: the transformers call.

        Returns:
            (model, optimizer, dataloader yielding shards, *others, UPipeRuntime), with None for what was not given.

        Raises:
            ValueError / NotImplementedError on every rank before any collective: an accelerator that set up
            fewer processes than were launched (CPU without `cpu=True`), sp_size not dividing the number
            of processes, an accelerate `ParallelismConfig` hf_upipe cannot honour (its sp_size is the SP degree
            when the plugin gives none; refused: DeepSpeed with its sp_size, cp_size or tp_size > 1, sizes that
            disagree with sp_size or do not make the number of processes; `hf_upipe.training.parallelism`),
            offload or auto without activation checkpointing (call `model.activation_checkpointing_enable()`
            first), a kernel that cannot run here, heads that do not split, an output_dir that cannot be written,
            an FSDP config accelerate cannot honour, model_offload='cpu' without FSDP2, a DeepSpeed config with
            gradient_accumulation_steps > 1 (its engine would divide the window's token-mean loss again:
            docs/deepspeed.md).
        """
        wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if wants_fsdp and str(accelerator.distributed_type) != "DistributedType.FSDP":
            raise ValueError(
                f"The accelerate config asks for FSDP but accelerate set up "
                f"{accelerator.distributed_type} (accelerate runs FSDP on accelerators only): on CPU "
                "use a DDP config such as accelerate_configs/cpu_2proc.yaml."
            )
        # fewer processes than the launch started (torchrun / accelerate launch) would leave ranks unsynchronised;
        # the same on every rank: raised before any collective
        launched = _launched_processes()
        if accelerator.num_processes < launched:
            raise ValueError(
                f"{launched} processes were launched but accelerate set up {accelerator.num_processes} "
                f"({accelerator.distributed_type}), so it would not synchronise them: on CPU create the "
                "Accelerator with cpu=True (accelerate launch with accelerate_configs/cpu_2proc.yaml does)."
            )
        deepspeed = str(accelerator.distributed_type) == "DistributedType.DEEPSPEED"
        if deepspeed:  # the same config on every rank: the same error, before any collective
            _deepspeed_accumulation_check(accelerator)
        fsdp = str(accelerator.distributed_type) == "DistributedType.FSDP"
        fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None) if fsdp else None
        check_model_offload(
            self,
            fsdp_version=getattr(fsdp_plugin, "fsdp_version", 1) if fsdp else None,
            deepspeed=deepspeed,
        )
        check_cpu_collectives(self)
        checkpointing = activation_checkpointing(model)
        parallelism = find_parallelism(getattr(accelerator, "parallelism_config", None))
        launch = resolve_launch(self, parallelism, accelerator.num_processes, deepspeed=deepspeed)
        upipe = UPipeRuntime.setup(
            launch,
            model,
            device=accelerator.device,
            checkpointing=checkpointing,
            checkpointing_fix=checkpointing_fix
            or "call "
            "model.activation_checkpointing_enable() (older transformers: gradient_checkpointing_enable()) before "
            "UPipePlugin.prepare",
            output_dir=output_dir,
            pad_token_id=pad_token_id,
        )
        apply_model_offload(
            fsdp_plugin, upipe.config
        )  # before accelerator.prepare shards the model
        given = [x for x in (model, optimizer, dataloader, *others) if x is not None]
        prepared = (
            list(accelerator.prepare(*given)) if len(given) > 1 else [accelerator.prepare(*given)]
        )
        out = [
            prepared.pop(0) if x is not None else None
            for x in (model, optimizer, dataloader, *others)
        ]
        for i in range(3, len(out)):
            if isinstance(out[i], DataLoader):
                out[i] = share_batches_within_sp(out[i], upipe.state)
        if dataloader is not None:
            loader = share_batches_within_sp(out[2], upipe.state)
            out[2] = ShardedDataLoader(
                loader, upipe.state, pad_token_id=pad_token_id, check_same_batch=True
            )
        return (*out, upipe)


def _launched_processes() -> int:
    """The process group's size if one is up, else the launcher's WORLD_SIZE (1 without a launcher)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _deepspeed_accumulation_check(accelerator) -> None:
    """Refuse a DeepSpeed config with gradient_accumulation_steps > 1: its engine divides every loss by it, while
    `UPipeRuntime.loss` is already normalised by the label tokens of the whole window."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    steps = (getattr(plugin, "deepspeed_config", None) or {}).get("gradient_accumulation_steps", 1)
    if steps == "auto":  # filled in from the Accelerator by accelerator.prepare
        steps = accelerator.gradient_accumulation_steps
    if int(steps) != 1:
        raise ValueError(
            f"The DeepSpeed config has gradient_accumulation_steps={steps}: its engine divides each loss by "
            f"{steps} and steps the optimizer on its own count, while UPipeRuntime.loss is already the token mean "
            "of the whole window, so the update would be wrong. Set gradient_accumulation_steps: 1 in the "
            "DeepSpeed config and use windows of 1 batch (a larger per-device batch instead), or use UPipeTrainer."
        )
