"""`UPipeDPOTrainer`: TRL's `DPOTrainer` with hf_upipe's sequence parallelism, on the runtime `UPipeTrainer` uses.

Entry points:
- `UPipeDPOTrainer(model, ref_model=None, args=DPOConfig(...), ..., upipe_config=UPipeConfig(...))`: one changed
  import (`from hf_upipe.trl import UPipeDPOTrainer as DPOTrainer`); the `DPOConfig` is kept;
- `dpo_config_errors(args, *, compute_metrics=None)`: what a `DPOConfig` asks that the SP path does not handle,
  one NotImplementedError per setting naming the reason and the fix; it reads only the arguments, so every rank
  finds the same errors and the trainer raises the first at construction, before any collective;
- `shard_preference_batch(batch, state, pad_token_id)`: one rank's shard of a collated preference batch.

Composition: `class UPipeDPOTrainer(UPipeTRLTrainer, DPOTrainer)` (`hf_upipe.trl.base`; through a shim that passes
`ref_model` by keyword):
TRL builds the data (prompt extraction, tokenization, its preference collator: rows [chosen..., rejected...] with a
`completion_mask`), the PEFT model, the reference model and its fused LM head (`trl.trainer.utils.
add_fused_lm_head`: per-token log-probabilities, entropy, mean logit and top-1 flag, tiled over tokens and
vocabulary, never the [tokens, vocab] logits). `UPipeTrainer` does everything sequence-parallel (one
`UPipeRuntime.setup`, the loaders re-pointed to the SP groups, the step context, checkpoints, log extras).

The loss of one micro-batch of 2B rows (B pairs), on each of the P ranks of an SP group:
1. labels = input_ids where `completion_mask` is 1, else -100; the batch is cut by `hf_upipe.shard_batch`, which
   shifts the labels over the whole sequence first (`shift_labels`), so each shard scores its own next tokens;
2. the policy, then the reference model (a separate model, or the PEFT model with its adapters disabled, in no_grad),
   run on the shard with `fused_lm_head=True` and `shift_labels`: per-token log-probabilities [2B, s], summed over
   the shard's completion tokens -> [2B];
3. `hf_upipe.ops.reduce.sum_over_group` sums them over the SP group (all_reduce in forward and in backward): every
   rank holds the sequences' log-probabilities, computes the same DPO loss (`hf_upipe.trl.dpo_losses`: TRL's
   loss types and f-divergences from those sums and each sequence's completion token count) and returns it.
   Backward gives each rank P x the gradient of its share; DDP/FSDP average over all W = P x dp_size ranks, so
   the update is that of the mean over the dp_size groups' losses, the one-process update. The logged
   loss (mean over all ranks) is that mean too. Gradient accumulation divides by the steps, as TRL does
   (`loss_is_scaled_for_ga = False`).
`precompute_ref_log_probs`: TRL's pass (inside `DPOTrainer.__init__`, before SP exists) is deferred to the end
of `__init__` and run on the shards (`_sharded_ref_logps`); the columns ride in each batch as `upipe_ref_logps`.
TRL's metrics (`rewards/*`, `logps/*`, `logits/*`, `entropy`, `mean_token_accuracy`, `num_tokens`) are sums on the
shards (token metrics) or on SP rank 0 (pair metrics), added over all ranks in one all_reduce per micro-batch, and
divided as TRL divides: equal to one process.

Refused at construction, on every rank, before any collective (`dpo_config_errors`): `ld_alpha`,
`use_weighting`, `use_liger_kernel`, `activation_offloading`,
`sync_ref_model`, selective checkpointing, evaluation (`eval_strategy`, `compute_metrics`), accelerate/DeepSpeed
sequence or context parallelism; after TRL's setup: vision data, an MoE router auxiliary loss, prompt-learning PEFT
(its virtual tokens would be added to every shard), packing (`padding_free` where TRL keeps it on: TRL 1.16
turns it off itself, and so runs the trainer, equal to TRL). `evaluate()` and `predict()` raise.
docs/trl-dpo.md names the mechanism each would need.
"""

from __future__ import annotations

import logging

import torch
from trl import DPOConfig, DPOTrainer
from trl.trainer.utils import use_adapter

from hf_upipe.config import UPipeConfig
from hf_upipe.data import shard_batch
from hf_upipe.distributed import SequenceParallelState
from hf_upipe.ops.reduce import sum_over_group
from hf_upipe.prepare import prepare_model
from hf_upipe.trl.base import UPipeTRLTrainer, checkpointing_off
from hf_upipe.trl.dpo_losses import DPO_LOSS_TYPES, DPOLossSettings, PairLogps, dpo_loss

logger = logging.getLogger(__name__)

__all__ = [
    "DPO_TRAINER_INTERNALS",
    "UPipeDPOTrainer",
    "dpo_config_errors",
    "shard_preference_batch",
]

# trl.DPOTrainer methods and attributes the composition relies on (trl 1.16), with their parameters.
DPO_TRAINER_INTERNALS = {
    "__init__": ("self", "model", "ref_model", "args", "data_collator", "train_dataset"),
    "log": ("self", "logs", "start_time"),
    "_save_checkpoint": ("self", "model", "trial"),
    "training_step": ("self", "args", "kwargs"),
}

_BATCH_KEYS = ("input_ids", "attention_mask", "completion_mask")
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")  # precompute_ref_log_probs: [B] each
_NOT_MODEL_INPUTS = (
    "shift_labels",
    "num_label_tokens",
    "upipe_pairs",
    "upipe_completion_tokens",
    "upipe_target_tokens",
    "upipe_ref_logps",
)


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


def shard_preference_batch(
    batch: dict, state: SequenceParallelState, pad_token_id: int = 0
) -> dict:
    """This rank's shard of a collated preference batch (`input_ids`, `attention_mask`, `completion_mask`, [2B, S]:
    B chosen rows then B rejected rows, right-padded) -> `hf_upipe.shard_batch`'s shard (`input_ids`,
    `attention_mask`, `position_ids` [2B, s], `shift_labels` [2B, s]: the next token where it is a completion
    token, else -100) plus `upipe_pairs` = B and each whole sequence's completion tokens [2B]
    (`upipe_completion_tokens`: `completion_mask` sums; `upipe_target_tokens`: the shifted mask's, the tokens
    scored), which the length-normalised loss types read.

    Raises:
        ValueError: keys other than those three (reference log-probs, images...), or an odd number of rows."""
    extra = sorted(k for k in batch if k not in _BATCH_KEYS + _REF_KEYS)
    missing = [k for k in _BATCH_KEYS if batch.get(k) is None]
    if extra or missing:
        raise ValueError(
            f"UPipeDPOTrainer shards text preference batches with keys {list(_BATCH_KEYS)}; got extra keys "
            f"{extra} and no {missing}: use TRL's DataCollatorForPreference (no images)."
        )
    ids = batch["input_ids"]  # [2B, S]
    if ids.dim() != 2 or ids.shape[0] % 2:
        raise ValueError(
            f"a preference batch has 2B rows (B chosen, then B rejected); got input_ids {tuple(ids.shape)}."
        )
    labels = ids.masked_fill(batch["completion_mask"] == 0, -100)  # [2B, S]
    full = {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": labels}
    shard = shard_batch(full, state.sp_rank, state.sp_size, pad_token_id=pad_token_id)
    shard["upipe_pairs"] = ids.shape[0] // 2
    shard["upipe_completion_tokens"] = batch["completion_mask"].sum(dim=1)  # [2B]
    shard["upipe_target_tokens"] = batch["completion_mask"][:, 1:].sum(dim=1)  # [2B]
    if all(k in batch for k in _REF_KEYS):  # precomputed: per pair, not sharded
        shard["upipe_ref_logps"] = torch.cat([batch[k] for k in _REF_KEYS])  # [2B]
    return shard


class _DPOKeywordInit(DPOTrainer):
    """Calls `DPOTrainer.__init__` with `ref_model` by keyword: `UPipeTrainer` passes (model, args) positionally,
    where `DPOTrainer` takes (model, ref_model, args)."""

    def __init__(self, model, args=None, *, ref_model=None, **kwargs):
        DPOTrainer.__init__(self, model, ref_model=ref_model, args=args, **kwargs)


class UPipeDPOTrainer(UPipeTRLTrainer, _DPOKeywordInit):
    """`trl.DPOTrainer` (its loss types and f-divergences) with UPipe sequence parallelism: every chosen and
    rejected sequence sharded, the sequence log-probabilities summed over the SP group before the loss (module
    docstring).

    Args:
        model, ref_model, args, ...: as for `trl.DPOTrainer` (a `DPOConfig`, `peft_config`, ...), by keyword after
            `args`.
        upipe_config: the sequence-parallel settings (see `UPipeTrainer`); default `UPipeConfig()`.

    Raises:
        NotImplementedError at construction, on every rank, for the settings `dpo_config_errors` names (and, after
            TRL's setup, vision data, an MoE router auxiliary loss, prompt-learning PEFT); the errors of
            `UPipeTrainer`.
    """

    loss_is_scaled_for_ga = False  # the loss is the micro-batch's mean over pairs, as TRL's
    args_class = DPOConfig
    args_named = "a DPOConfig"

    def __init__(
        self,
        model,
        ref_model=None,
        args: DPOConfig | None = None,
        *,
        upipe_config: UPipeConfig | None = None,
        **kwargs,
    ):
        super().__init__(model, args, ref_model=ref_model, upipe_config=upipe_config, **kwargs)
        # the reference runs under the same SP: same attention, same sharding
        if self.ref_model is not None:
            prepare_model(self.accelerator.unwrap_model(self.ref_model), self.upipe.config)
        if self._pending_precompute is not None:  # TRL's precompute, deferred until SP is set up
            self.train_dataset = self._sharded_ref_logps(
                self.train_dataset, self._pending_precompute
            )
        logger.info(
            "UPipeDPOTrainer: per-token log-probabilities come from TRL's fused LM head on each sequence shard; "
            "the per-sequence sums are added over the %d ranks of the SP group before the DPO loss.",
            self.upipe.state.sp_size,
        )

    def _config_errors(self, args: DPOConfig, kwargs: dict) -> list[Exception]:
        return dpo_config_errors(args, compute_metrics=kwargs.get("compute_metrics"))

    def _refuse_after_setup(self) -> None:
        """What only TRL's setup reveals; the same on every rank (same model, data and settings)."""
        self._refuse_vision_dataset()
        self._refuse_aux_loss("UPipeDPOTrainer's loss has no auxiliary term")
        self._refuse_accelerate_parallelism()
        if getattr(self, "padding_free", False):  # TRL 1.16 turns it off itself (it warns and pads)
            raise NotImplementedError(
                "DPOConfig(padding_free=True): this TRL packs each batch into one row, which UPipeDPOTrainer does "
                "not shard (the shards would need the document boundaries); set padding_free=False."
            )
        self._refuse_prompt_learning()

    # ---- data --------------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Collect the step's full preference batches and shard them; count their real tokens over all ranks (for
        `tokens_per_second`). No item count: the loss is a mean over pairs per micro-batch."""
        batches = self._next_batches(epoch_iterator, num_batches)
        if not batches:
            return [], None
        pad = self.upipe.pad_token_id
        shards = [shard_preference_batch(b, self.upipe.state, pad) for b in batches]
        self._stats["tokens"] += self.upipe.world_sum(sum(self._real_tokens(b) for b in batches))[0]
        return shards, None

    # ---- precomputed reference log-probabilities ---------------------------------------------------------------
    # the batch size of TRL's train-set precompute, deferred until SP is set up
    _pending_precompute = None

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """TRL calls this inside `DPOTrainer.__init__`, before hf_upipe's SP exists: note the train set's batch
        size and return the dataset unchanged; `_sharded_ref_logps` runs at the end of `__init__`. An eval set is
        returned as it is (evaluation is refused)."""
        if name == "train":
            self._pending_precompute = batch_size
        return dataset

    def _sharded_ref_logps(self, dataset, batch_size: int):
        """The dataset with TRL's `ref_chosen_logps` / `ref_rejected_logps` columns, computed under SP: every rank
        runs every batch (each rank its shard; the sums are added over the SP group; data-parallel groups compute
        the same values), with the reference of a training step (a separate reference model, the PEFT base, or the
        initial policy)."""
        from torch.utils.data import DataLoader

        loader = DataLoader(
            dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False
        )
        device, pad = self.args.device, self.upipe.pad_token_id
        chosen, rejected = [], []
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            logps = self._reference_logps(
                shard_preference_batch(batch, self.upipe.state, pad)
            )  # [2B]
            c, r = logps.float().cpu().chunk(2)
            chosen += c.tolist()
            rejected += r.tolist()
        return dataset.add_column("ref_chosen_logps", chosen).add_column(
            "ref_rejected_logps", rejected
        )

    # ---- loss --------------------------------------------------------------------------------------------------
    def _shard_logps(self, model, shard: dict):
        """(per-sequence log-probability sums over the SP group [2B], the fused head's per-token outputs)."""
        inputs = {k: v for k, v in shard.items() if k not in _NOT_MODEL_INPUTS}
        outputs = model(
            **inputs, shift_labels=shard["shift_labels"], use_cache=False, fused_lm_head=True
        )
        local = outputs.log_probs.sum(dim=1)  # [2B]: this shard's completion tokens (0 at -100)
        return sum_over_group(local, self.upipe.state.sp_group), outputs

    def _reference_logps(self, shard: dict) -> torch.Tensor:
        """The reference model's per-sequence log-probabilities [2B], summed over the SP group (no gradient)."""
        with (
            torch.no_grad(),
            checkpointing_off(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            peft = hasattr(self.accelerator.unwrap_model(self.model), "peft_config")
            if (
                self.ref_model is None and not peft
            ):  # precompute without a reference: the initial policy
                logps, _ = self._shard_logps(self.model, shard)
            elif (
                self.ref_model is None
            ):  # PEFT: the base model, or the initial adapter loaded as "ref"
                unwrapped = self.accelerator.unwrap_model(self.model)
                name = "ref" if "ref" in unwrapped.peft_config else None
                with use_adapter(unwrapped, adapter_name=name):
                    logps, _ = self._shard_logps(self.model, shard)
            else:
                logps, _ = self._shard_logps(self.ref_model, shard)
        return logps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The DPO loss of the micro-batch's B pairs, the same on every rank of the SP group."""
        if "upipe_pairs" not in inputs:
            raise NotImplementedError(
                "UPipeDPOTrainer computes the DPO loss on the shards of its own training loop only; evaluate() "
                "and predict() are not implemented under sequence parallelism."
            )
        if return_outputs:
            raise NotImplementedError(
                "UPipeDPOTrainer never builds the logits (return_outputs=True); drop compute_metrics."
            )
        logps, outputs = self._shard_logps(model, inputs)  # [2B]
        ref_logps = inputs.get("upipe_ref_logps")  # [2B] precomputed, or the reference now
        ref_logps = (
            self._reference_logps(inputs) if ref_logps is None else ref_logps.to(logps.dtype)
        )
        chosen_logps, rejected_logps = logps.chunk(
            2, dim=0
        )  # [B] each: the batch is [chosen, rejected]
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
        tokens = inputs["upipe_completion_tokens"].chunk(2, dim=0)  # [B] each
        pair = PairLogps(
            chosen=chosen_logps,
            rejected=rejected_logps,
            ref_chosen=ref_chosen_logps,
            ref_rejected=ref_rejected_logps,
            chosen_tokens=tokens[0],
            rejected_tokens=tokens[1],
            chosen_targets=inputs["upipe_target_tokens"].chunk(2, dim=0)[0],
        )
        loss = dpo_loss(DPOLossSettings.from_trainer(self), pair)
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        self._record_metrics(inputs, outputs, logps, chosen_logratios, rejected_logratios)
        return loss

    def _record_metrics(self, shard, outputs, logps, chosen_logratios, rejected_logratios) -> None:
        """TRL's metrics of one micro-batch, summed over all ranks in one all_reduce (module docstring)."""
        mode = "train" if self.model.training else "eval"
        B = shard["upipe_pairs"]
        mask = shard["shift_labels"] != -100  # [2B, s] completion targets of this shard
        chosen_mask, rejected_mask = mask[:B], mask[B:]  # [B, s] each
        entropy = outputs.entropy.detach()  # [2B, s]
        mean_logits = outputs.mean_logits.detach()  # [2B, s]
        token_sums = [
            (entropy * mask).sum(),
            mask.sum(),
            mean_logits[:B][chosen_mask].sum(),
            chosen_mask.sum(),
            mean_logits[B:][rejected_mask].sum(),
            rejected_mask.sum(),
            (outputs.is_top1[:B].bool() & chosen_mask).sum(),
            shard["attention_mask"].sum(),
        ]
        chosen_rewards = self.beta * chosen_logratios.detach()  # [B], the same on every SP rank
        rejected_rewards = self.beta * rejected_logratios.detach()
        chosen_logps, rejected_logps = logps.detach().chunk(2, dim=0)
        own = self.upipe.state.sp_rank == 0  # pair metrics: counted by one rank of each SP group
        pair_sums = [
            chosen_rewards.sum(),
            rejected_rewards.sum(),
            (chosen_rewards > rejected_rewards).float().sum(),
            (chosen_rewards - rejected_rewards).sum(),
            chosen_logps.sum(),
            rejected_logps.sum(),
            torch.tensor(float(B)),
        ]
        values = [float(t) for t in token_sums] + [float(t) if own else 0.0 for t in pair_sums]
        ent, tok, c_logit, c_tok, r_logit, r_tok, correct, real, *pairs = self.upipe.world_sum(
            *values
        )
        rc, rr, acc, margin, lc, lr, n_pairs = pairs
        metrics = self._metrics[mode]
        metrics["entropy"].append(ent / tok if tok > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(real)
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["logits/chosen"].append(c_logit / c_tok if c_tok > 0 else 0.0)
        metrics["logits/rejected"].append(r_logit / r_tok if r_tok > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / c_tok if c_tok > 0 else 0.0)
        for name, total in (
            ("rewards/chosen", rc),
            ("rewards/rejected", rr),
            ("rewards/accuracies", acc),
            ("rewards/margins", margin),
            ("logps/chosen", lc),
            ("logps/rejected", lr),
        ):
            metrics[name].append(total / n_pairs)

    # ---- evaluation: refused -----------------------------------------------------------------------------------
    def evaluate(self, *args, **kwargs):
        raise NotImplementedError(
            "UPipeDPOTrainer does not evaluate: DPO evaluation is not implemented under hf_upipe's sequence "
            "parallelism (train with eval_strategy='no'; evaluate the saved model with trl.DPOTrainer)."
        )

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            "UPipeDPOTrainer does not predict: the logits are never built under sequence parallelism."
        )
