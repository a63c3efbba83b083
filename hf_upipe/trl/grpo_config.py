"""What a `GRPOConfig` (and the trainer's arguments) ask that `UPipeGRPOTrainer` does not handle under SP.

Entry point:
- `grpo_config_errors(args, *, tools=None, environment_factory=None, processing_class=None)`: one
  NotImplementedError per such setting, each naming the setting, the reason and the fix (empty when none). It
  reads only the arguments, so every rank finds the same errors without communicating, and `UPipeGRPOTrainer`
  raises the first before TRL or hf_upipe run any collective.
"""

from __future__ import annotations

from trl import GRPOConfig

__all__ = ["grpo_config_errors"]


def _no(setting: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"GRPOConfig({setting}): {why}")


def grpo_config_errors(
    args: GRPOConfig, *, tools=None, environment_factory=None, processing_class=None
) -> list[Exception]:
    """The settings UPipeGRPOTrainer does not handle, each with the reason and the fix (empty when none).

    Depends only on the arguments, so every rank finds the same errors without communicating."""
    checks = _generation_checks(args) + _setup_checks(args)
    errors = [_no(setting, why) for bad, setting, why in checks if bad]
    if tools or environment_factory:
        errors.append(
            NotImplementedError(
                "UPipeGRPOTrainer(tools=... / environment_factory=...): multi-turn tool calling is not verified "
                "under sequence parallelism (the tool mask and the tool responses inserted between generations); "
                "train without tools, or with trl.GRPOTrainer."
            )
        )
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        errors.append(
            NotImplementedError(
                "UPipeGRPOTrainer trains causal language models on text: a processor (vision-language model) is "
                "not supported under hf_upipe's sequence parallelism; pass a tokenizer."
            )
        )
    return errors


def _generation_checks(args: GRPOConfig) -> list[tuple[bool, str, str]]:
    """(refused?, the setting, why and the fix) for the generation backends and sampling options."""
    return [
        (
            args.use_vllm,
            f"use_vllm=True, vllm_mode={args.vllm_mode!r}",
            "vLLM (server or colocate) is not verified with hf_upipe: its weight sync and importance-sampling "
            "correction would run beside the SP groups, and no vLLM runs here to test it. Set use_vllm=False: "
            "each SP group generates with hf_upipe.generate (sharded prefill, sampling on SP rank 0).",
        ),
        (
            args.use_transformers_continuous_batching,
            "use_transformers_continuous_batching=True",
            "continuous batching runs the whole model on one device, outside the SP groups; set it to False "
            "(hf_upipe.generate batches the prompts under SP).",
        ),
        (
            args.min_p is not None,
            f"min_p={args.min_p}",
            "hf_upipe.generate samples with temperature, top_k and top_p only; set min_p=None.",
        ),
        (
            args.repetition_penalty != 1.0,
            f"repetition_penalty={args.repetition_penalty}",
            "hf_upipe.generate has no repetition penalty; set repetition_penalty=1.0.",
        ),
        (
            bool(args.generation_kwargs),
            f"generation_kwargs={args.generation_kwargs!r}",
            "hf_upipe.generate takes GRPOConfig's temperature, top_k, top_p and max_completion_length only; "
            "set generation_kwargs=None.",
        ),
    ]


def _setup_checks(args: GRPOConfig) -> list[tuple[bool, str, str]]:
    """(refused?, the setting, why and the fix) for kernels, offload, sharding, evaluation."""
    return [
        (
            args.use_liger_kernel,
            "use_liger_kernel=True",
            "Liger's kernels replace the modules hf_upipe's fused attention and tiled MLP adapt; set it to False.",
        ),
        (
            bool(args.deepspeed),
            "deepspeed=...",
            "DeepSpeed is not verified with UPipeGRPOTrainer (generation and the reference model under ZeRO-3); "
            "use DDP (accelerate launch without a DeepSpeed or FSDP config).",
        ),
        (
            bool(args.fsdp),
            f"fsdp={args.fsdp!r}",
            "FSDP is not verified with UPipeGRPOTrainer (generation gathers no sharded weights, and the data-"
            "parallel groups stop generating at different steps); use DDP.",
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
            args.eval_strategy != "no",
            f"eval_strategy={str(getattr(args.eval_strategy, 'value', args.eval_strategy))!r}",
            "GRPO evaluation (generation and rewards on the eval set) is not implemented under sequence "
            "parallelism; set eval_strategy='no'.",
        ),
        (
            bool(args.label_smoothing_factor),
            f"label_smoothing_factor={args.label_smoothing_factor}",
            "is a causal-LM setting the GRPO loss does not use; set it to 0.",
        ),
    ]
