"""`UPipeTrainer`: transformers' Trainer with sequence parallelism, an exact token-weighted loss and a tiled loss.

Entry points:
- `UPipeTrainer(model, args, ..., upipe_config=UPipeConfig(...))`: a `transformers.Trainer` subclass; everything
  else of the Trainer (callbacks, logging, lr schedules, gradient accumulation, activation checkpointing, PEFT,
  checkpoints and `resume_from_checkpoint`) keeps working.

What it does, with W processes and `sp_size` P (W = P x dp_size):
1. setup: `init_sequence_parallel(P, ...)` (SP groups of P neighbouring ranks, DP across them),
   `prepare_model` (the fused UPipe block where the architecture is known, `attn_implementation="upipe"`) and,
   when configured, the tiled MLP; each training step runs inside `offload_checkpoints` (offload 'cpu'/'disk');
2. data: the Trainer's own dataloaders, with accelerate's batch sharding re-pointed from W processes to the
   dp_size SP groups (as the Trainer itself does for its `BatchRebalanceSampler`), so sampler seeding, epochs,
   `skip_first_batches` on resume and eval remainders work unchanged. Each full batch is cut by
   `hf_upipe.shard_batch` (right padding to a multiple of P, global position_ids, labels shifted over the whole
   sequence, documents of packed rows kept apart);
3. loss (training): N = label tokens of the whole optimizer step (all gradient-accumulation micro-batches, all SP
   and DP ranks, counted once), rank r's loss = W x (sum of its shard's token losses) / N. DDP/FSDP average the
   gradients over W ranks, so the update is that of the mean over the N tokens, exactly, whatever P, dp_size and
   the accumulation steps; the logged loss (the Trainer's mean over ranks) is that mean too. With
   `tiled_loss` (default) the [tokens, vocab] logits never exist;
4. eval: per batch, the same token mean over the batches of all DP groups, equal on every rank (what the Trainer
   reports for DDP without SP); `eval_loss` averages it over batches like the Trainer. Only the loss is computed:
   full-sequence logits are never gathered, so `compute_metrics`/`predict` logits raise under SP;
5. checkpoints: written into a hidden staging folder and renamed to `checkpoint-N` once every rank has written its
   part, so an interrupted save never leaves a partial `checkpoint-N` for `resume_from_checkpoint=True` to pick
   (shared filesystem assumed, as by the Trainer). PEFT models save plain PEFT adapters, others plain
   transformers checkpoints (rank 0 writes, through the Trainer's own `save_model`);
6. logs: `tokens_per_second` (real tokens of all ranks since the last log) and `peak_memory_gib` (the largest
   per-rank peak: device allocations on CUDA, process peak RSS on CPU) on every training log line.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import sys
import time

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_upipe.config import UPipeConfig
from hf_upipe.data import shard_batch
from hf_upipe.distributed import init_sequence_parallel, set_sequence_parallel_state
from hf_upipe.integrations.accelerate import NO_SP, share_batches_within_sp, world_sum
from hf_upipe.integrations.fused import prepare_model
from hf_upipe.integrations.loss import shard_loss_sum
from hf_upipe.memory.offload import offload_checkpoints
from hf_upipe.planning.auto import apply_auto_settings

logger = logging.getLogger(__name__)

__all__ = ["UPipeTrainer"]


def _peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: device allocations (reset after reading) on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


class UPipeTrainer(Trainer):
    """A `transformers.Trainer` for long sequences: UPipe sequence parallelism, exact loss, tiled loss.

    Args:
        model, args, ...: as for `transformers.Trainer` (everything is passed on).
        upipe_config: the sequence-parallel settings; default `UPipeConfig()` (all processes of a node share a
            sequence; `UPIPE_*` environment variables apply).

    The data collator must produce `labels` (or `shift_labels`), e.g. `DataCollatorForLanguageModeling(tokenizer,
    mlm=False)` with right padding, `default_data_collator` on pre-tokenized rows, or
    `DataCollatorWithFlattening` for packed rows. The loss is always normalised by the label tokens of the whole
    optimizer step across all ranks (the Trainer's `average_tokens_across_devices=True` semantics).

    Raises:
        ValueError / NotImplementedError at construction, on every rank, before any collective: an sp_size that
            does not divide the number of processes, label smoothing or `compute_loss_func` (the loss is
            computed here), `compute_metrics` under SP.
    """

    def __init__(self, model=None, args=None, *pargs, upipe_config: UPipeConfig | None = None, **kwargs):
        super().__init__(model, args, *pargs, **kwargs)
        self.upipe_config = upipe_config if upipe_config is not None else UPipeConfig()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.upipe_config.auto:
            if not self.args.gradient_checkpointing:
                raise ValueError("auto=True plans with activation checkpointing on every layer: set "
                                 "TrainingArguments(gradient_checkpointing=True).")
            self.upipe_plan = apply_auto_settings(self.upipe_config, self.model, world_size=world)
        sp_size = self.upipe_config.resolve_sp_size(world)
        if self.args.label_smoothing_factor:
            raise NotImplementedError("UPipeTrainer computes the causal-LM loss itself; label_smoothing_factor="
                                      f"{self.args.label_smoothing_factor} is not supported (set it to 0).")
        if self.compute_loss_func is not None:
            raise NotImplementedError("UPipeTrainer computes the token-weighted causal-LM loss itself; drop "
                                      "compute_loss_func (or use transformers.Trainer without sequence parallelism).")
        if self.compute_metrics is not None and sp_size > 1:
            raise NotImplementedError("compute_metrics needs full-sequence logits, which UPipeTrainer never "
                                      "materialises under sequence parallelism (sp_size > 1); drop compute_metrics "
                                      "(eval_loss is still reported).")
        if self.upipe_config.offload != "none" and not self.args.gradient_checkpointing:
            raise ValueError(f"offload={self.upipe_config.offload!r} offloads what activation checkpointing keeps: set "
                             "TrainingArguments(gradient_checkpointing=True), or offload='none'.")
        if not self.args.average_tokens_across_devices:
            logger.warning("UPipeTrainer normalises the loss by the label tokens of all ranks "
                           "(average_tokens_across_devices=True semantics); the False setting is not used.")
        if world > 1:
            self.sp_state = init_sequence_parallel(sp_size, **self.upipe_config.init_kwargs())
        else:
            self.sp_state = NO_SP
            set_sequence_parallel_state(None)
        if self.model is not None:
            self._prepare_upipe_model(self.model)
        self.gather_function = self._gather_over_dp
        self.loss_is_scaled_for_ga = True
        self._stats = {"tokens": 0, "since": None}

    # ---- setup -------------------------------------------------------------------------------------------------
    def _prepare_upipe_model(self, model):
        return prepare_model(model, self.upipe_config)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, with checkpointed layer inputs offloaded for its forward and backward."""
        cfg = self.upipe_config
        with offload_checkpoints(self.model, cfg.offload, path=cfg.offload_path, min_bytes=cfg.offload_min_bytes):
            return super().training_step(model, inputs, num_items_in_batch)

    def call_model_init(self, trial=None):
        return self._prepare_upipe_model(super().call_model_init(trial))

    def _get_dataloader(self, *pargs, **kwargs):
        return share_batches_within_sp(super()._get_dataloader(*pargs, **kwargs), self.sp_state)

    # ---- data --------------------------------------------------------------------------------------------------
    def _shard(self, batch: dict) -> dict:
        """The full collated batch -> this rank's shard (`hf_upipe.shard_batch`)."""
        if batch.get("labels") is None and batch.get("shift_labels") is None:
            raise ValueError("UPipeTrainer needs 'labels' (or 'shift_labels') in every batch: use a language-modeling "
                             "collator, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False); got "
                             f"{sorted(batch)}.")
        pad = getattr(self.processing_class, "pad_token_id", None)
        return shard_batch(batch, self.sp_state.sp_rank, self.sp_state.sp_size,
                           pad_token_id=0 if pad is None else pad)

    def _world_sum(self, *values: torch.Tensor | int) -> list[float]:
        return world_sum(*values, device=self.args.device)

    def _own_count(self, shard: dict) -> float:
        """The whole batch's label tokens, contributed by SP rank 0 only, so a world sum counts each once."""
        return float(shard["num_label_tokens"]) if self.sp_state.sp_rank == 0 else 0.0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Collect the step's full batches, shard them, and count the step's label tokens over all ranks."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if self._stats["since"] is None:
            self._stats["since"] = time.perf_counter()
        if not batches:
            return [], None
        shards = [self._shard(b) for b in batches]
        labels, tokens = self._world_sum(sum(self._own_count(s) for s in shards),
                                         sum(self._real_tokens(b) for b in batches))
        self._stats["tokens"] += tokens
        return shards, torch.tensor(labels, dtype=torch.float64, device=device)

    def _real_tokens(self, batch: dict) -> float:
        if self.sp_state.sp_rank != 0:
            return 0.0
        mask = batch.get("attention_mask")
        return float(mask.sum()) if mask is not None else float(batch["input_ids"].numel())

    # ---- loss --------------------------------------------------------------------------------------------------
    def _loss_sum(self, model, shard: dict):
        inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
        cfg = self.upipe_config
        return shard_loss_sum(model, inputs, shard["shift_labels"], tiled=cfg.tiled_loss,
                              chunk_tokens=cfg.loss_chunk_tokens)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training loss of this rank's shard: W x (its token-loss sum) / (label tokens of the whole step)."""
        if num_items_in_batch is None:  # called outside the training loop: normalise by this batch alone
            num_items_in_batch = self._world_sum(self._own_count(inputs))[0]
        loss_sum, outputs = self._loss_sum(model, inputs)
        world = dist.get_world_size() if dist.is_initialized() else 1
        loss = loss_sum * (world / float(num_items_in_batch))
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval loss of one batch: the token mean over the batches of all DP groups (same value on every rank)."""
        if not prediction_loss_only:
            raise NotImplementedError("UPipeTrainer evaluates the loss only: full-sequence logits are never "
                                      "materialised (use evaluate() without compute_metrics, not predict()).")
        shard = self._prepare_inputs(self._shard(inputs))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss_sum, _ = self._loss_sum(model, shard)
        total, count = self._world_sum(loss_sum.item(), self._own_count(shard))
        loss = torch.tensor(total / count if count else float("nan"), device=self.args.device)
        return loss, None, None

    def _gather_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """`gather_for_metrics` over the data-parallel replicas only (SP ranks hold the same values)."""
        group, size = self.sp_state.dp_group, self.sp_state.dp_size
        if size > 1:
            out = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(out, tensor.contiguous(), group=group)
            tensor = torch.cat(out)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            tensor = tensor[: state.remainder]
        return tensor

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, self._staging) if getattr(self, "_staging", None) else run_dir

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written into `<run_dir>/.staging-checkpoint-N/` and then renamed."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        run_dir = super()._get_output_dir(trial)
        staging_root = os.path.join(run_dir, f".staging-{name}")
        if self.args.should_save and os.path.exists(staging_root):
            shutil.rmtree(staging_root)  # left by an interrupted save
        self._barrier()
        self._staging = f".staging-{name}"
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        self._barrier()  # every rank has written its files (RNG states, sharded optimizer states)
        final = os.path.join(run_dir, name)
        best = self.state.best_model_checkpoint
        if best and best.startswith(staging_root):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(best, staging_root))
        if self.args.should_save:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(os.path.join(staging_root, name), final)
            shutil.rmtree(staging_root)
            if best != self.state.best_model_checkpoint:
                self.state.save_to_json(os.path.join(final, "trainer_state.json"))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self._barrier()

    # ---- logging -----------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `tokens_per_second` and `peak_memory_gib` to training log lines (one all_reduce per log)."""
        if "loss" in logs and not any(k.startswith("eval_") for k in logs) and self._stats["since"] is not None:
            peak = torch.tensor([float(_peak_memory_bytes(self.args.device))], device=self.args.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            now = time.perf_counter()
            rate = self._stats["tokens"] / max(now - self._stats["since"], 1e-9)
            logs = {**logs, "tokens_per_second": round(rate, 1),
                    "peak_memory_gib": round(peak.item() / 2**30, 3)}
            self._stats = {"tokens": 0, "since": now}
        super().log(logs, start_time)
