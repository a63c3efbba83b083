"""`UPipeRuntime`: the sequence-parallel setup and loss of one run, shared by `UPipeTrainer` and `UPipePlugin`.

Entry points:
- `UPipeRuntime.setup(config, model, *, world_size, device, checkpointing, checkpointing_fix, output_dir=None)`:
  check the settings against the launch and the model, apply auto settings, build the SP groups and install the
  fused block / tiled MLP; returns the runtime. The settings object is never changed: `runtime.config` is the
  configuration in force (a copy, with the planner's choices under `auto=True`), `runtime.state` the
  `SequenceParallelState`, `runtime.plan` the planner's answer (auto) or None.
- `runtime.shard(batch)`: a collated batch -> this rank's shard (`hf_upipe.shard_batch`).
- `runtime.count(shards)`: label tokens of these shards' batches over all ranks, each counted once.
- `runtime.loss(model, shard, num_items)`: the token-weighted loss of a shard, ready for backward.
- `runtime.step(model)`: context for one forward + backward (offloads checkpointed inputs when configured).
- `runtime.windows(loader, steps)`: shards grouped into gradient-accumulation windows (one batch each under
  DeepSpeed, whose engine steps at every backward).
- `runtime.evaluate(model, loader)`: the exact eval loss (token mean over the whole eval set) of an
  accelerate-prepared loader; `runtime.eval_sums(...)`: its per-round sums (what `UPipeTrainer` reports from);
  both in `hf_upipe.runtime_eval`.
- `NO_SP`: the state of a run without sequence parallelism. Re-exported from `hf_upipe.runtime_checks`:
  `activation_checkpointing(model)`, `output_dir_errors(path)`, `shared_settings(config)` and
  `agree_on_errors(errors, world, settings)`; from `hf_upipe.runtime_eval`: `EvalSums`.

The flow of `setup` (every rank, the same arguments):
1. `hf_upipe.runtime_checks.check_setup`: the checks that need only the settings, the launch and the model, shared
   in one all_gather_object over all ranks; every rank raises the same error before any other collective;
2. `auto=True`: the planner's settings (rank 0 plans in a child process and broadcasts) in a copy of the config;
3. `init_sequence_parallel`, then `prepare_model` (fused block, tiled MLP).

The loss: N = label tokens of the whole optimizer step (all gradient-accumulation micro-batches, all SP and DP
ranks, counted once); rank r's loss = W x (its shard's summed token loss) / max(N, 1). DDP and FSDP average the
gradients over the W ranks, so the update is that of the token mean over N, exactly; a step without label tokens
gives a zero loss and zero gradients, as transformers' Trainer does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hf_upipe.auto_settings import apply_auto_settings
from hf_upipe.config import UPipeConfig
from hf_upipe.data import shard_batch
from hf_upipe.distributed import (
    SequenceParallelState,
    init_sequence_parallel,
    set_sequence_parallel_state,
)
from hf_upipe.integrations.loss import shard_loss_sum
from hf_upipe.integrations.parallelism import ParallelismSizes
from hf_upipe.integrations.prepare import prepare_model
from hf_upipe.memory.allocator import arrange_allocator
from hf_upipe.memory.offload import offload_checkpoints
from hf_upipe.runtime_checks import (
    activation_checkpointing,
    agree_on_errors,
    check_setup,
    geometry_errors,
    model_heads,
    output_dir_errors,
    shared_settings,
)
from hf_upipe.runtime_eval import EvalSums, eval_sums, evaluate

__all__ = [
    "EvalSums",
    "NO_SP",
    "UPipeRuntime",
    "activation_checkpointing",
    "agree_on_errors",
    "output_dir_errors",
    "shared_settings",
]

NO_SP = SequenceParallelState(
    sp_group=None, sp_size=1, sp_rank=0, dp_group=None, dp_size=1, dp_rank=0
)

_NOT_INPUTS = ("shift_labels", "num_label_tokens")


def _shard_error(shard: dict, what: str) -> ValueError | None:
    """A shard without what `UPipeRuntime.shard` adds for the loss, named (or None)."""
    missing = [k for k in _NOT_INPUTS if k not in shard]
    if not missing:
        return None
    return ValueError(
        f"UPipeRuntime.{what}() got a shard without {missing} (its keys: {sorted(shard)}): pass the "
        "shards UPipeRuntime.shard(batch) returns, from batches with 'labels' (or 'shift_labels')."
    )


def _check_shard(shard: dict, what: str) -> None:
    """`_shard_error` raised (on this rank, before a collective)."""
    err = _shard_error(shard, what)
    if err is not None:
        raise err


class UPipeRuntime:
    """Sequence-parallel setup, sharding and loss of one run (see the module docstring); build it with `setup`."""

    def __init__(
        self,
        config: UPipeConfig,
        state: SequenceParallelState,
        *,
        world_size: int,
        device,
        plan=None,
        pad_token_id: int = 0,
        deepspeed: bool = False,
    ):
        self.config, self.state, self.plan, self.deepspeed = config, state, plan, deepspeed
        self.world_size, self.device, self.pad_token_id = (
            world_size,
            torch.device(device),
            pad_token_id,
        )

    @classmethod
    def setup(
        cls,
        config: UPipeConfig,
        model,
        *,
        world_size: int,
        device,
        checkpointing: bool,
        checkpointing_fix: str,
        output_dir: str | None = None,
        pad_token_id: int = 0,
        parallelism: ParallelismSizes | None = None,
        deepspeed: bool = False,
    ) -> UPipeRuntime:
        """Check, plan (auto), build the SP groups and prepare `model` (module docstring).

        Args:
            config: the settings (not modified).
            model: the transformers or PEFT model, before accelerate/DDP/FSDP wrap it.
            world_size: processes of the launch; device: this rank's device.
            checkpointing: whether activation checkpointing is on; `checkpointing_fix`: how the caller's user turns
                it on (named in errors).
            output_dir: a folder checkpoints will be written to (checked writable), or None.
            pad_token_id: the pad id `shard` pads the sequence with.
            parallelism: the sizes of accelerate's `ParallelismConfig` in this run, if any
                (`hf_upipe.integrations.parallelism`): its sp_size is the SP degree when `config` gives none, and
                what hf_upipe cannot honour in it is refused; `deepspeed`: whether the DeepSpeed engine runs.

        Raises:
            ValueError / NotImplementedError on every rank before any collective but the one that shares them.
        """
        arrange_allocator(config.allocator)  # before prepare_model puts anything on the GPU
        config, sp = check_setup(
            config,
            model,
            world_size=world_size,
            device=device,
            checkpointing=checkpointing,
            checkpointing_fix=checkpointing_fix,
            output_dir=output_dir,
            parallelism=parallelism,
            deepspeed=deepspeed,
        )
        plan = None
        if config.auto:
            config, plan = apply_auto_settings(config, model, world_size=world_size)
            # the broadcast choice is the same on every rank, so is this check: no agreement needed
            agree_on_errors(geometry_errors(config, model_heads(model), sp, world_size), 1)
        if world_size > 1:
            state = init_sequence_parallel(sp, **config.init_kwargs())
        else:
            state = NO_SP
            set_sequence_parallel_state(None)
        prepare_model(model, config)
        return cls(
            config,
            state,
            world_size=world_size,
            device=device,
            plan=plan,
            pad_token_id=pad_token_id,
            deepspeed=deepspeed,
        )

    # ---- data and loss -----------------------------------------------------------------------------------------
    def shard(self, batch: dict) -> dict:
        """A full collated batch (`labels` or `shift_labels` required) -> this rank's shard."""
        if batch.get("labels") is None and batch.get("shift_labels") is None:
            raise ValueError(
                "hf_upipe needs 'labels' (or 'shift_labels') in every batch: use a language-modeling "
                "collator, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False); got "
                f"{sorted(batch)}."
            )
        return shard_batch(
            batch, self.state.sp_rank, self.state.sp_size, pad_token_id=self.pad_token_id
        )

    def world_sum(self, *values) -> list[float]:
        """Sum small numbers over all ranks in one all_reduce (float64: exact for token counts)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def own_count(self, shard: dict) -> float:
        """The batch's label tokens, contributed by SP rank 0 only, so a world sum counts each once."""
        _check_shard(shard, "count")
        return float(shard["num_label_tokens"]) if self.state.sp_rank == 0 else 0.0

    def count(self, shards: list[dict]) -> float:
        """Label tokens of these shards' batches over all ranks, each counted once (one all_reduce).

        A shard without labels raises on every rank: at once without other ranks; else after the all_reduce, which
        carries whether any rank got one, so that a rank whose shards are fine is told too instead of waiting."""
        errors = [e for e in (_shard_error(s, "count") for s in shards) if e is not None]
        if errors and (self.world_size == 1 or not dist.is_initialized()):
            raise errors[0]
        own = 0.0 if errors else sum(self.own_count(s) for s in shards)
        total, failed = self.world_sum(own, bool(errors))
        if failed:
            raise (
                errors[0]
                if errors
                else ValueError(
                    f"UPipeRuntime.count() got a shard without labels on {int(failed)} of {self.world_size} ranks "
                    "(this rank's are fine): pass every rank the shards UPipeRuntime.shard(batch) returns, from "
                    "batches with 'labels' (or 'shift_labels')."
                )
            )
        return total

    def loss_sum(self, model, shard: dict, token_stats=None):
        """(summed token loss of the shard, fp32 scalar; the model's outputs). `token_stats`: an
        `hf_upipe.ops.tiled_loss.TokenStats` that receives the shard's entropy and argmax hits, or None."""
        _check_shard(shard, "loss")
        inputs = {k: v for k, v in shard.items() if k not in _NOT_INPUTS}
        return shard_loss_sum(
            model,
            inputs,
            shard["shift_labels"],
            tiled=self.config.tiled_loss,
            chunk_tokens=self.config.loss_chunk_tokens,
            token_stats=token_stats,
        )

    def loss(
        self,
        model,
        shard: dict,
        num_items: float | None = None,
        *,
        return_outputs: bool = False,
        token_stats=None,
    ):
        """W x (this shard's summed token loss) / max(num_items, 1), ready for backward (module docstring).

        `num_items`: label tokens of the optimizer step over all ranks (`count`); default `count([shard])`.
        `token_stats`: as for `loss_sum`.
        """
        if num_items is None:
            num_items = self.count([shard])
        loss_sum, outputs = self.loss_sum(model, shard, token_stats)
        loss = loss_sum * (self.world_size / max(float(num_items), 1.0))
        return (loss, outputs) if return_outputs else loss

    def step(self, model):
        """Context manager for one forward + backward: offloads checkpointed inputs when `offload` is set."""
        cfg = self.config
        if cfg.offload == "none":
            return contextlib.nullcontext()
        return offload_checkpoints(
            model, cfg.offload, path=cfg.offload_path, min_bytes=cfg.offload_min_bytes
        )

    def windows(self, loader, steps: int):
        """Group a loader's shards into gradient-accumulation windows of `steps` (the last may be shorter).

        Raises (every rank, before any batch): ValueError for `steps` > 1 under DeepSpeed, whose engine steps the
        optimizer at every `accelerator.backward` of a loop without `accelerator.accumulate`."""
        if self.deepspeed and steps > 1:
            raise ValueError(
                f"windows of {steps} batches under DeepSpeed: accelerator.backward runs the DeepSpeed engine's "
                f"optimizer step at every call, so each window would take {steps} optimizer steps instead of one. "
                "Use windows of 1 batch (raise the per-device batch size instead), or UPipeTrainer, which runs "
                "DeepSpeed's gradient accumulation exactly."
            )
        window = []
        for shard in loader:
            window.append(shard)
            if len(window) == steps:
                yield window
                window = []
        if window:
            yield window

    # ---- evaluation (hf_upipe.runtime_eval) --------------------------------------------------------------------
    def eval_sums(
        self,
        model,
        loader,
        *,
        shards=None,
        context=contextlib.nullcontext,
        token_stats: bool = False,
        forward=None,
    ) -> EvalSums:
        """Per-round loss sums of an evaluation pass over an accelerate-prepared `loader` (no repeated examples):
        `hf_upipe.runtime_eval.eval_sums` with this runtime, which documents the arguments."""
        return eval_sums(
            self,
            model,
            loader,
            shards=shards,
            context=context,
            token_stats=token_stats,
            forward=forward,
        )

    def evaluate(self, model, loader) -> float:
        """The exact eval loss of `loader` (accelerate-prepared, as given to `UPipePlugin.prepare` or
        `accelerator.prepare`): the token mean over every label token of the eval set, the same on every rank."""
        return evaluate(self, model, loader)
