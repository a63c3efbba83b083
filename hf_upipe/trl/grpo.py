"""`UPipeGRPOTrainer`: TRL's `GRPOTrainer` with hf_upipe's sequence parallelism, on the runtime `UPipeTrainer` uses.

Entry points:
- `UPipeGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), ..., upipe_config=UPipeConfig(...))`: one changed
  import (`from hf_upipe.trl import UPipeGRPOTrainer as GRPOTrainer`); the `GRPOConfig` is kept;
- `grpo_config_errors(args, *, tools=None, environment_factory=None, processing_class=None)`: what the SP path
  does not handle, one NotImplementedError per setting naming the reason and the fix; it reads only the
  arguments, so every rank finds the same errors and the trainer raises the first at construction, before any
  collective.

Composition: `class UPipeGRPOTrainer(UPipeTRLTrainer, GRPOTrainer)` (`hf_upipe.trl.base`; through a shim that
passes `reward_funcs` by keyword). TRL does everything GRPO: the repeated-prompt sampler, tokenization, rewards and
advantages, the buffer of generation batches (`steps_per_generation`, `num_iterations`), the loss of every loss
type, its clipping, KL and entropy terms and metrics. `UPipeTrainer` does the SP setup (one `UPipeRuntime.setup`),
re-points the loaders to the SP groups (the ranks of a group get the same prompts), the step context and
checkpoints. Three methods change what TRL's code runs on:
1. generation (`_generate_single_turn`): every rank of an SP group calls `hf_upipe.generate` on the group's
   left-padded prompts (each rank prefills its shard of every prompt; the draws are taken on SP rank 0 and
   broadcast), so the group holds the same completions; then SP rank 0's random state is copied to the group, so
   TRL's later draws (the shuffle of the generation batch) agree too. A `rollout_func` runs on SP rank 0 and its
   result is broadcast to the group;
2. scoring (`_get_per_token_logps_and_entropies`: the policy with gradient, the old policy when
   `num_iterations > 1` or generation and optimisation steps are misaligned, the reference when `beta > 0`): the
   prompt + completion rows are rearranged into right-padded rows (`hf_upipe.trl.grpo_shards`), cut by
   `hf_upipe.shard_batch`, run through TRL's fused LM head on each shard (per-token log-probabilities and
   entropies, never the [tokens, vocab] logits), and gathered over the SP group into TRL's [B, C] layout by an
   autograd function whose backward keeps this rank's slice (times P: the gradient convention of
   `hf_upipe.ops.reduce.sum_over_group`). TRL's loss code then runs unchanged on full-length tensors: every
   token-level reduction is TRL's;
3. data-parallel bookkeeping (`hf_upipe.trl.grpo_replicas.replica_view`): while TRL generates, scores and computes
   the loss, its accelerator has the dp_size SP groups as its processes (reward gathering and the advantage slice,
   metrics, `num_items_in_batch`).

`generation_batch_size` is recomputed over the data-parallel replicas (per_device_train_batch_size x dp_size x
steps_per_generation): TRL's `GRPOConfig` counts every process, and the P ranks of an SP group share their rows.

Refused at construction, on every rank, before any collective (`grpo_config_errors`): vLLM (server and colocate),
continuous batching, `min_p`, `repetition_penalty`, `generation_kwargs`, Liger, DeepSpeed, FSDP, `sync_ref_model`,
selective checkpointing, evaluation, label smoothing, tools and environments, a processor (vision); after the
setup: a processor TRL loaded, FSDP or DeepSpeed from an accelerate config, an MoE router auxiliary loss, a ring
(`ring_size > 1`), prompt-learning PEFT. `evaluate()` and `predict()` raise.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import pad

from hf_upipe.config import UPipeConfig
from hf_upipe.data import shard_batch
from hf_upipe.generation import generate
from hf_upipe.prepare import prepare_model
from hf_upipe.training.parallelism import Launch
from hf_upipe.trl.base import UPipeTRLTrainer, checkpointing_off
from hf_upipe.trl.grpo_replicas import replica_view
from hf_upipe.trl.grpo_shards import completion_rows, gather_sequence

logger = logging.getLogger(__name__)

__all__ = ["GRPO_TRAINER_INTERNALS", "UPipeGRPOTrainer", "grpo_config_errors"]

# trl.GRPOTrainer methods the composition overrides or wraps (trl 1.16), with their parameters
GRPO_TRAINER_INTERNALS = {
    "__init__": ("self", "model", "reward_funcs", "args", "train_dataset"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
    ),
    "_generate_and_score_completions": ("self", "inputs"),
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "log": ("self", "logs", "start_time"),
    "_save_checkpoint": ("self", "model", "trial"),
}


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


class _GRPOKeywordInit(GRPOTrainer):
    """Calls `GRPOTrainer.__init__` with `reward_funcs` by keyword: `UPipeTrainer` passes (model, args)
    positionally, where `GRPOTrainer` takes (model, reward_funcs, args)."""

    def __init__(self, model, args=None, *, reward_funcs=None, **kwargs):
        GRPOTrainer.__init__(self, model, reward_funcs=reward_funcs, args=args, **kwargs)


def _replica_args(args: GRPOConfig, launch: Launch) -> GRPOConfig:
    """A copy of `args` whose `generation_batch_size` counts the data-parallel replicas of `launch` (`launch.dp`),
    not every process (`steps_per_generation` kept). An SP degree that does not resolve or divide the launch is left
    to `UPipeTrainer`'s checks, which name it."""
    world, sp, dp = launch.world, launch.sp, launch.dp
    if sp is None or sp <= 1 or world % sp:
        return args
    args = copy.copy(args)
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % args.num_generations:
        raise ValueError(
            f"GRPOConfig: the generation batch over the {dp} data-parallel replicas (SP {sp} x "
            f"{dp} on {world} processes) is per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {dp} x steps_per_generation "
            f"{args.steps_per_generation} = {args.generation_batch_size} completions, not a multiple of "
            f"num_generations {args.num_generations}: raise per_device_train_batch_size or steps_per_generation."
        )
    return args


class UPipeGRPOTrainer(UPipeTRLTrainer, _GRPOKeywordInit):
    """`trl.GRPOTrainer` (its loss types, clipping, KL and entropy terms) with UPipe sequence parallelism: every
    prompt + completion sharded, the per-token log-probabilities gathered over the SP group before TRL's loss
    (module docstring).

    Args:
        model, reward_funcs, args, ...: as for `trl.GRPOTrainer` (a `GRPOConfig`, `peft_config`, ...), by
            keyword after `reward_funcs`.
        upipe_config: the sequence-parallel settings (see `UPipeTrainer`); default `UPipeConfig()`.

    Raises:
        NotImplementedError at construction, on every rank, for the settings `grpo_config_errors` names (and,
            after the setup, an MoE router auxiliary loss, a ring, prompt-learning PEFT); the errors of
            `UPipeTrainer`.
    """

    loss_is_scaled_for_ga = True  # TRL's GRPO loss is scaled for gradient accumulation itself
    args_class = GRPOConfig
    args_named = "a GRPOConfig"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        *,
        upipe_config: UPipeConfig | None = None,
        **kwargs,
    ):
        super().__init__(
            model, args, reward_funcs=reward_funcs, upipe_config=upipe_config, **kwargs
        )
        if self.ref_model is not None:  # the reference runs under the same SP
            prepare_model(self.accelerator.unwrap_model(self.ref_model), self.upipe.config)
        if self.rollout_func is not None:
            self.rollout_func = self._on_sp_rank_0(self.rollout_func)
        # TRL seeds each process with seed + process_index: the ranks of an SP group are one process of TRL's
        # (the same draws, the same shuffles), the SP groups its processes
        from accelerate.utils import set_seed

        set_seed(self.args.seed + self.upipe.state.dp_rank)
        logger.info(
            "UPipeGRPOTrainer: each SP group of %d ranks generates with hf_upipe.generate and scores its "
            "completions on sequence shards (TRL's fused LM head); the per-token log-probabilities are gathered "
            "over the group before TRL's loss.",
            self.upipe.state.sp_size,
        )

    def _config_errors(self, args: GRPOConfig, kwargs: dict) -> list[Exception]:
        return grpo_config_errors(
            args,
            tools=kwargs.get("tools"),
            environment_factory=kwargs.get("environment_factory"),
            processing_class=kwargs.get("processing_class"),
        )

    def _launch_args(self, args: GRPOConfig | None, launch: Launch) -> GRPOConfig | None:
        return args if args is None else _replica_args(args, launch)

    def _refuse_after_setup(self) -> None:
        """What only the setup reveals; the same on every rank (same model, data and settings)."""
        if self._is_vlm:  # a processor TRL loaded from the model's name
            raise NotImplementedError(
                "UPipeGRPOTrainer trains causal language models on text: a processor (vision-language model) "
                "is not supported under hf_upipe's sequence parallelism; pass a tokenizer."
            )
        self._refuse_aux_loss("UPipeGRPOTrainer does not shard it")
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:  # also from an accelerate config
            raise NotImplementedError(
                "UPipeGRPOTrainer is verified with DDP only: FSDP and DeepSpeed (from the accelerate config) "
                "would shard the weights hf_upipe.generate reads whole, and their data-parallel groups stop "
                "generating at different steps; launch without an FSDP or DeepSpeed config."
            )
        self._refuse_accelerate_parallelism()
        if self.upipe.state.ring_size > 1:
            raise NotImplementedError(
                f"UPipeGRPOTrainer gathers contiguous sequence shards; a ring (ring_size="
                f"{self.upipe.state.ring_size}) orders each rank's tokens otherwise: use ring_size=1."
            )
        self._refuse_prompt_learning()

    @property
    def _sp(self) -> bool:
        return self.upipe.state.sp_size > 1

    # ---- data: TRL's generation batches (lists of rows), not UPipeTrainer's collated batches -----------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's generation batches as TRL's loader yields them (no item count: TRL normalises itself)."""
        return self._next_batches(epoch_iterator, num_batches), None

    def _generate_and_score_completions(self, inputs):
        """TRL's, with the data-parallel replicas as its processes; the generated tokens counted for
        `tokens_per_second`."""
        from trl.trainer import grpo_trainer

        before = self.state.num_input_tokens_seen
        trl_off = grpo_trainer.disable_gradient_checkpointing
        # TRL 1.16 turns checkpointing off for its no-grad passes by transformers' deprecated names, which warn at
        # every generation; the same switch by transformers 5's names (`checkpointing_off`)
        grpo_trainer.disable_gradient_checkpointing = checkpointing_off
        try:
            with replica_view(self, self.upipe.state):
                output = super()._generate_and_score_completions(inputs)
        finally:
            grpo_trainer.disable_gradient_checkpointing = trl_off
        # TRL's count is over the data-parallel replicas: the same on every rank
        if self.model.training:
            self._stats["tokens"] += float(self.state.num_input_tokens_seen - before)
        return output

    # ---- generation ------------------------------------------------------------------------------------------
    def _on_sp_rank_0(self, rollout_func):
        """`rollout_func` called on SP rank 0 only, its result broadcast to the SP group."""
        state = self.upipe.state

        def rollout(prompts, trainer):
            if not self._sp:
                return rollout_func(prompts, trainer)
            box = [rollout_func(prompts, trainer) if state.sp_rank == 0 else None]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(state.sp_group, 0), group=state.sp_group
            )
            return box[0]

        return rollout

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """The completions of the SP group's prompts through `hf_upipe.generate` (module docstring); TRL's own
        path without SP."""
        if not self._sp:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        device = self.args.device
        pad_id = self._tokenizer.pad_token_id
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        ids = pad(prompts, pad_id, padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        mask = pad(
            [torch.ones_like(t) for t in prompts],
            0,
            padding_side="left",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                checkpointing_off(model, self.args.gradient_checkpointing_kwargs),
            ):
                out = generate(
                    model,
                    ids.to(device),  # [B, L] left-padded
                    attention_mask=mask.to(device),
                    max_new_tokens=self.max_completion_length,
                    do_sample=True,
                    temperature=self.temperature,
                    top_k=self.top_k or None,
                    top_p=self.top_p,
                    eos_token_id=self.eos_token_ids,
                    pad_token_id=pad_id,
                )
        finally:
            model.train(was_training)
        self._share_random_state()
        return _completions_until_eos(out[:, ids.shape[1] :], self.eos_token_ids), None

    def _share_random_state(self) -> None:
        """Copy SP rank 0's random state (CPU, and the current accelerator's) to the SP group: only rank 0 drew."""
        state = self.upipe.state
        src = dist.get_global_rank(state.sp_group, 0)
        cpu = torch.get_rng_state()  # uint8 [n]
        dist.broadcast(cpu, src=src, group=state.sp_group)
        torch.set_rng_state(cpu)
        if self.args.device.type == "cuda":
            gpu = torch.cuda.get_rng_state(self.args.device).to(self.args.device)
            dist.broadcast(gpu, src=src, group=state.sp_group)
            torch.cuda.set_rng_state(gpu.cpu(), self.args.device)

    # ---- scoring ---------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Per-token log-probabilities [B, C] (and entropies [B, C]) of the completions, computed on sequence
        shards and gathered over the SP group (module docstring, item 2); TRL's own without SP."""
        if not self._sp:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        if any(v is not None for v in multimodal.values()) or compute_aux_loss:
            raise NotImplementedError(
                "UPipeGRPOTrainer scores text only, without an MoE auxiliary loss."
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            lp, ent = self._shard_scores(
                model, input_ids[rows], attention_mask[rows], logits_to_keep, compute_entropy
            )
            logps.append(lp)
            entropies.append(ent)
        entropy = torch.cat(entropies) if compute_entropy else None
        return torch.cat(logps), entropy, None

    def _shard_scores(self, model, input_ids, attention_mask, completion_length, entropy):
        """([b, C] log-probabilities, [b, C] entropies or None) of b rows, through this rank's shard."""
        state = self.upipe.state
        rows = completion_rows(
            input_ids, attention_mask, completion_length, self.upipe.pad_token_id
        )
        batch = {
            "input_ids": rows.input_ids,  # [b, T]
            "attention_mask": rows.attention_mask,
            "labels": rows.labels,
        }
        shard = shard_batch(
            batch, state.sp_rank, state.sp_size, pad_token_id=self.upipe.pad_token_id
        )
        inputs = {
            k: shard[k] for k in ("input_ids", "attention_mask", "position_ids") if k in shard
        }
        # hf_upipe draws one number per training forward under SP (`hf_upipe.adapters.hooks`: each rank's
        # stream); TRL's forward draws none without dropout, so the draw is kept out of TRL's generator
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        with self.accelerator.autocast(), torch.random.fork_rng(devices=devices):
            outputs = model(
                **inputs, shift_labels=shard["shift_labels"], use_cache=False, fused_lm_head=True
            )
        logps = rows.pick(gather_sequence(outputs.log_probs, state.sp_group, state.sp_rank))
        if not entropy:
            return logps, None
        return logps, rows.pick(gather_sequence(outputs.entropy, state.sp_group, state.sp_rank))

    # ---- loss ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's GRPO loss of the micro-batch (the same on every rank of an SP group), its metrics over the
        data-parallel replicas."""
        if return_outputs:
            raise NotImplementedError(
                "UPipeGRPOTrainer does not return outputs (as TRL's GRPOTrainer)."
            )
        with replica_view(self, self.upipe.state):
            return GRPOTrainer.compute_loss(self, model, inputs)

    # ---- evaluation: refused ---------------------------------------------------------------------------------
    def evaluate(self, *args, **kwargs):
        raise NotImplementedError(
            "UPipeGRPOTrainer does not evaluate: GRPO evaluation is not implemented under hf_upipe's sequence "
            "parallelism (train with eval_strategy='no')."
        )

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            "UPipeGRPOTrainer does not predict: the logits are never built under sequence parallelism."
        )


def _completions_until_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> list[list[int]]:
    """[B, n] generated tokens -> each row's tokens up to and including its first eos (TRL's rule)."""
    device = completion_ids.device
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=device))  # [B, n]
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    found = is_eos.any(dim=1)
    eos_idx[found] = is_eos.int().argmax(dim=1)[found]
    positions = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)  # [B, n]
    keep = positions <= eos_idx[:, None]
    return [c[m].tolist() for c, m in zip(completion_ids.cpu(), keep.cpu(), strict=True)]
