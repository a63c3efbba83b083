"""What a `DPOConfig` asks that `UPipeDPOTrainer` does not handle under sequence parallelism.

Entry point:
- `dpo_config_errors(args, *, compute_metrics=None)`: one NotImplementedError per such setting, each naming the
  setting, the reason and the fix (empty when none). It reads only the arguments, so every rank finds the same
  errors without communicating, and `UPipeDPOTrainer` raises the first before TRL or hf_upipe run any collective.
"""

from __future__ import annotations

from trl import DPOConfig

from hf_upipe.trl.dpo_losses import DPO_LOSS_TYPES

__all__ = ["dpo_config_errors"]


def _no(setting: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"DPOConfig({setting}): {why}")


def dpo_config_errors(args: DPOConfig, *, compute_metrics=None) -> list[Exception]:
    """The DPOConfig settings UPipeDPOTrainer does not handle, each with the reason and the fix (empty when none).

    Depends only on the arguments, so every rank finds the same errors without communicating."""
    errors: list[Exception] = []
    loss_types = (
        list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    )
    unknown = [t for t in loss_types if t not in DPO_LOSS_TYPES]
    if unknown:
        errors.append(
            _no(
                f"loss_type={args.loss_type!r}",
                f"{unknown} is not one of the loss types UPipeDPOTrainer computes under sequence parallelism "
                f"(TRL 1.16's: {list(DPO_LOSS_TYPES)}).",
            )
        )
    checks = _loss_checks(args) + _setup_checks(args, compute_metrics)
    errors += [_no(setting, why) for bad, setting, why in checks if bad]
    return errors


def _loss_checks(args: DPOConfig) -> list[tuple[bool, str, str]]:
    """(refused?, the setting, why and the fix) for what changes the loss or the reference log-probs."""
    return [
        (
            args.ld_alpha is not None,
            f"ld_alpha={args.ld_alpha}",
            "LD-DPO splits each completion at the shorter one's length (a position in the whole completion, "
            "which a shard does not see: it would need the shared/tail token masks cut from the whole batch "
            "beside the labels); set ld_alpha=None.",
        ),
        (
            args.use_weighting,
            "use_weighting=True",
            "WPO weights need the fused head's log-sum of squared probabilities per token, summed over the SP "
            "group beside the log-probabilities (not implemented); set use_weighting=False.",
        ),
    ]


def _setup_checks(args: DPOConfig, compute_metrics) -> list[tuple[bool, str, str]]:
    """(refused?, the setting, why and the fix) for the data layout, kernels, offload, evaluation."""
    return [
        (
            args.use_liger_kernel,
            "use_liger_kernel=True",
            "Liger's kernels replace the modules hf_upipe's fused attention and tiled MLP adapt; set it to False.",
        ),
        (
            args.activation_offloading,
            "activation_offloading=True",
            "TRL's offload would run beside hf_upipe's own; set it to False and use "
            "UPipeConfig(offload='cpu') (with gradient_checkpointing=True).",
        ),
        (
            bool(args.deepspeed),
            "deepspeed=...",
            "DeepSpeed is verified with UPipeTrainer and UPipePlugin, not yet with the TRL trainers (the "
            "reference model's ZeRO-3 placement); use FSDP2 or DDP (accelerate config), or UPipeTrainer.",
        ),
        (
            args.sync_ref_model,
            "sync_ref_model=True",
            "is not verified under sequence parallelism; set sync_ref_model=False.",
        ),
        (
            bool((args.gradient_checkpointing_kwargs or {}).get("selective")),
            "gradient_checkpointing_kwargs={'selective': True}",
            "TRL's selective checkpointing is not verified with hf_upipe's fused attention; drop 'selective'.",
        ),
        (
            args.eval_strategy != "no" or compute_metrics is not None,
            f"eval_strategy={str(getattr(args.eval_strategy, 'value', args.eval_strategy))!r}"
            + (", compute_metrics" if compute_metrics is not None else ""),
            "evaluation is not implemented for DPO under sequence parallelism; set eval_strategy='no' and "
            "drop compute_metrics.",
        ),
        (
            bool(args.label_smoothing_factor),
            f"label_smoothing_factor={args.label_smoothing_factor}",
            "is a causal-LM setting the DPO loss does not use; set it to 0.",
        ),
    ]
