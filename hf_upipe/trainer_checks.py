"""The checks `UPipeTrainer` runs at construction, on every rank, before training.

Entry points:
- `early_checks(args, config, parallelism, world, deepspeed)`: before `Trainer.__init__` (before transformers
  creates the output folder and accelerate its groups or DeepSpeed its SP): a writable output_dir and accelerate's
  `ParallelismConfig`, agreed over all ranks; returns the arguments transformers gets.
- `check_trainer_options(args, compute_loss_func)`: the Trainer options the loss computed here cannot honour.
- `check_metrics_options(args, world)`: the metric options the multi-process evaluation does not offer.
"""

from __future__ import annotations

import copy
import os

from hf_upipe.config import UPipeConfig
from hf_upipe.integrations.parallelism import (
    accelerate_view,
    parallelism_errors,
    with_parallelism_sp,
)
from hf_upipe.runtime_checks import agree_on_errors, output_dir_errors

__all__ = ["check_metrics_options", "check_trainer_options", "early_checks"]


def early_checks(args, config: UPipeConfig, parallelism, world: int, deepspeed: bool):
    """The checks that must pass before `Trainer.__init__`, on every rank (one all_gather_object): a writable
    output_dir, and accelerate's `ParallelismConfig` (`hf_upipe.integrations.parallelism`). Returns the
    arguments transformers gets: with a parallelism config, a copy whose `parallelism_config` has no SP (the
    SP ranks folded into data parallelism), so neither transformers nor accelerate applies its own SP."""
    errors = (
        output_dir_errors(args.output_dir)
        if args is not None and args.save_strategy != "no"
        else []
    )
    errors += parallelism_errors(config, parallelism, world, deepspeed=deepspeed)
    sp = None
    try:
        sp = with_parallelism_sp(config, parallelism).resolve_sp_size(world)
    except ValueError as err:
        errors.append(err)
    agree_on_errors(errors, world)
    if parallelism is None:
        return args
    if args is None:  # what transformers' Trainer uses by default
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="trainer_output")
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    args = copy.copy(args)
    args.parallelism_config = accelerate_view(parallelism, sp, world, fsdp=fsdp)
    return args


def check_trainer_options(args, compute_loss_func) -> None:
    """Refuse label smoothing and a `compute_loss_func`: UPipeTrainer computes the causal-LM loss itself (the same
    on every rank: the arguments are)."""
    if args.label_smoothing_factor:
        raise NotImplementedError(
            "UPipeTrainer computes the causal-LM loss itself; label_smoothing_factor="
            f"{args.label_smoothing_factor} is not supported (set it to 0)."
        )
    if compute_loss_func is not None:
        raise NotImplementedError(
            "UPipeTrainer computes the token-weighted causal-LM loss itself; drop "
            "compute_loss_func (or use transformers.Trainer without sequence parallelism)."
        )


def check_metrics_options(args, world: int) -> None:
    """Refuse the metric options the multi-process evaluation does not offer (the same on every rank)."""
    if world > 1 and (args.batch_eval_metrics or args.include_for_metrics):
        raise NotImplementedError(
            "UPipeTrainer computes metrics on the whole evaluation set with more than one process: "
            f"batch_eval_metrics={args.batch_eval_metrics} and include_for_metrics="
            f"{args.include_for_metrics} are not supported (set batch_eval_metrics=False, "
            "include_for_metrics=[])."
        )
