"""`UPipeSFTTrainer`: TRL's `SFTTrainer` with hf_upipe's sequence parallelism, on the runtime `UPipeTrainer` uses.

A TRL user changes one import (`from hf_upipe.trl import UPipeSFTTrainer as SFTTrainer`) and keeps their
`SFTConfig`; the sequence-parallel settings come as `upipe_config=UPipeConfig(...)` (default: every process of a
node shares a sequence; `UPIPE_*` environment variables apply).

Composition: `class UPipeSFTTrainer(UPipeTRLTrainer, SFTTrainer)` (`hf_upipe.trl.base`: the constructor prelude of the
three TRL trainers). The method resolution order is UPipeSFTTrainer -> UPipeTRLTrainer -> UPipeTrainer ->
SFTTrainer -> transformers.Trainer, so:
- TRL builds everything that is data: model loading from a name, `peft_config`, the pad/eos tokens, tokenization,
  prompt-completion `completion_mask` -> `labels` (`completion_only_loss`), packing (`bfd`: documents of one row
  told apart by restarting `position_ids`, which `hf_upipe.shard_batch` turns into `upipe_cu_seqlens`), the
  chat template's `{% generation %}` assistant mask -> `labels` (`assistant_only_loss`), its
  collator (padding-free rows with `position_ids`/`cu_seq_lens_*`/`seq_idx`, or right-padded rows);
- UPipeTrainer does everything that is SP: one `UPipeRuntime.setup`, the loaders' sharding re-pointed to the SP
  groups, every micro-batch cut by `shard_batch`, the token-weighted loss over the whole optimizer step through the
  tiled lm_head + cross-entropy (TRL's fused LM head / chunked log-probs is not called in training; one log line
  says so), the exact eval loss, the atomic checkpoints;
- TRL's `log` still merges its metrics: `num_tokens` is counted on the full batches (the same count as TRL's: the
  attention mask's ones, or the padding-free row's length) and summed over the data-parallel replicas, so it equals
  one process. `mean_token_accuracy` and `entropy` come from the loss's own tiles (`hf_upipe.ops.tiled_loss.
  TokenStats`: argmax hits and summed entropy of each shard's label tokens, no extra logits): per micro-batch the
  shard sums and label-token counts are summed over every rank (the SP shards make the sequence, the replicas the
  global batch), as TRL sums `gather_for_metrics` over the processes, then divided; `log` averages them as TRL
  does. The exact eval loop sums the same statistics per round (each round is one process's eval batch), so
  `eval_entropy`, `eval_mean_token_accuracy` and `eval_num_tokens` are TRL's too.

Refused at construction, on every rank, before any collective (`sft_config_errors`): `loss_type='dft'`,
`use_liger_kernel`, `activation_offloading` (use
`UPipeConfig(offload='cpu')`), selective activation checkpointing, `label_smoothing_factor`, `compute_loss_func`;
after TRL's setup: vision datasets and an MoE router auxiliary loss (the runtime's loss has no aux term).
`SFTConfig(parallelism_config=...)` and the accelerate config's `parallelism_config_*` keys are read as by
`UPipeTrainer` (`hf_upipe.training.parallelism`): the SP degree is honoured, DeepSpeed's or accelerate's own
sequence parallelism, context parallelism and disagreeing degrees are refused before TRL runs.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from trl import SFTConfig, SFTTrainer

from hf_upipe.config import UPipeConfig
from hf_upipe.ops.tiled_loss import TokenStats
from hf_upipe.trl.base import UPipeTRLTrainer, accelerator_parallelism_error

logger = logging.getLogger(__name__)

__all__ = [
    "SFT_TRAINER_INTERNALS",
    "UPipeSFTTrainer",
    "accelerator_parallelism_error",  # hf_upipe.trl.base's, importable here as before
    "sft_config_errors",
]

# trl.SFTTrainer methods UPipeSFTTrainer's composition runs through (UPipeTrainer's overrides call them via super()),
# with the parameters they were written against (trl 1.16); tests/test_trl.py fails when trl changes one.
SFT_TRAINER_INTERNALS = {
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "prediction_step": ("self", "model", "inputs", "prediction_loss_only", "ignore_keys"),
    "log": ("self", "logs", "start_time"),
    "_save_checkpoint": ("self", "model", "trial"),
    "evaluate": ("self", "eval_dataset", "ignore_keys", "metric_key_prefix"),
}


def sft_config_errors(args: SFTConfig, compute_loss_func=None) -> list[Exception]:
    """The SFTConfig settings UPipeSFTTrainer does not handle, each with the reason and the fix (empty when none).

    Depends only on the arguments, so every rank finds the same errors without communicating."""
    errors: list[Exception] = []
    if args.loss_type != "nll":
        errors.append(
            NotImplementedError(
                f"SFTConfig(loss_type={args.loss_type!r}): UPipeSFTTrainer computes the "
                "token-mean negative log-likelihood "
                "with hf_upipe's tiled loss; the DFT weighting is not implemented under sequence parallelism. Use "
                "loss_type='nll'."
            )
        )
    if args.deepspeed:
        errors.append(
            NotImplementedError(
                "SFTConfig(deepspeed=...): DeepSpeed is verified with UPipeTrainer and UPipePlugin, not yet with "
                "UPipeSFTTrainer; use an FSDP2 or DDP accelerate config, or UPipeTrainer with your tokenized data."
            )
        )
    if args.use_liger_kernel:
        errors.append(
            NotImplementedError(
                "SFTConfig(use_liger_kernel=True): Liger's kernels replace the modules hf_upipe's fused attention and "
                "tiled MLP adapt; set use_liger_kernel=False (hf_upipe's tiled loss and tiled MLP save the memory)."
            )
        )
    if args.activation_offloading:
        errors.append(
            NotImplementedError(
                "SFTConfig(activation_offloading=True): TRL's offload would run beside hf_upipe's own; set it to False "
                "and use UPipeConfig(offload='cpu') (with activation_checkpointing=True)."
            )
        )
    if (args.gradient_checkpointing_kwargs or {}).get("selective"):
        errors.append(
            NotImplementedError(
                "gradient_checkpointing_kwargs={'selective': True} (TRL's selective "
                "checkpointing) is not verified with "
                "hf_upipe's fused attention; drop 'selective' (full activation checkpointing works)."
            )
        )
    if args.label_smoothing_factor:
        errors.append(
            NotImplementedError(
                f"label_smoothing_factor={args.label_smoothing_factor}: UPipeSFTTrainer computes "
                "the causal-LM loss with "
                "hf_upipe's tiled loss, which has no label smoothing; set it to 0."
            )
        )
    if compute_loss_func is not None:
        errors.append(
            NotImplementedError(
                "compute_loss_func needs the full logits, which hf_upipe never builds under sequence parallelism; drop "
                "it (the loss is the token-mean negative log-likelihood)."
            )
        )
    return errors


class UPipeSFTTrainer(UPipeTRLTrainer, SFTTrainer):
    """`trl.SFTTrainer` with UPipe sequence parallelism, an exact token-weighted loss and the tiled loss.

    Args:
        model, args, ...: as for `trl.SFTTrainer` (an `SFTConfig`, `peft_config`, `formatting_func`...).
        upipe_config: the sequence-parallel settings (see `UPipeTrainer`); default `UPipeConfig()`.

    Raises:
        NotImplementedError at construction, on every rank, for the settings `sft_config_errors` names (and, after
            TRL's setup, vision datasets and an MoE router auxiliary loss); the errors of `UPipeTrainer`.
    """

    args_class = SFTConfig
    args_named = "an SFTConfig"

    def __init__(
        self,
        model,
        args: SFTConfig | None = None,
        *pargs,
        upipe_config: UPipeConfig | None = None,
        **kwargs,
    ):
        super().__init__(model, args, *pargs, upipe_config=upipe_config, **kwargs)
        logger.info(
            "UPipeSFTTrainer: TRL's fused LM head (chunked log-probabilities) is replaced by hf_upipe's %s "
            "loss (token mean over the optimizer step); mean_token_accuracy and entropy come from its tiles.",
            "tiled" if self.upipe.config.tiled_loss else "untiled",
        )

    def _config_errors(self, args: SFTConfig, kwargs: dict) -> list[Exception]:
        return sft_config_errors(args, kwargs.get("compute_loss_func"))

    def _refuse_after_setup(self) -> None:
        """What only TRL's setup reveals; the same on every rank (same model, data and settings)."""
        self._refuse_vision_dataset()
        self._refuse_aux_loss("hf_upipe's loss has no auxiliary term")
        self._refuse_accelerate_parallelism()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """UPipeTrainer's (shards, label tokens of the step); also TRL's `num_tokens`, counted on the full batches
        and summed over the data-parallel replicas (SP rank 0 of each group counts)."""
        before = self._stats["tokens"]
        shards, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._total_train_tokens += int(self._stats["tokens"] - before)
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return shards, count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """UPipeTrainer's loss of a shard, and TRL's `entropy` / `mean_token_accuracy` of the micro-batch over
        every rank (module docstring). Unsharded inputs take TRL's own `compute_loss`."""
        if "shift_labels" not in inputs or "num_label_tokens" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        stats = TokenStats(device=inputs["shift_labels"].device)
        result = self.upipe.loss(
            model,
            inputs,
            num_items_in_batch,
            return_outputs=return_outputs,
            token_stats=stats,
        )
        self._log_token_stats(inputs["shift_labels"], stats)
        return result

    _eval_token_stats = True

    def _record_eval_sums(self, sums) -> None:
        """TRL's eval metrics from the exact eval loop's rounds: one ratio per round, as TRL appends one per eval
        batch, and `num_tokens` as TRL sets it in evaluation (the training tokens so far)."""
        metrics = self._metrics["eval"]
        for n, entropy, correct in zip(sums.tokens, sums.entropy, sums.correct):
            metrics["entropy"].append(entropy / n if n > 0 else 0.0)
            metrics["mean_token_accuracy"].append(correct / n if n > 0 else 0.0)
        metrics["num_tokens"] = [self._total_train_tokens]

    def _log_token_stats(self, shift_labels: torch.Tensor, stats: TokenStats) -> None:
        """Sum (label tokens, entropy, argmax hits) over all ranks, then append TRL's two ratios."""
        valid = (shift_labels != -100).sum().to(torch.float64)
        sums = torch.stack([valid, stats.entropy_sum, stats.correct])  # [3] float64
        if self.upipe.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        n, entropy, correct = sums.tolist()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["entropy"].append(entropy / n if n > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / n if n > 0 else 0.0)
