"""`UPipeTrainer`: transformers' Trainer with sequence parallelism, an exact token-weighted loss and a tiled loss.

Entry points:
- `UPipeTrainer(model, args, ..., upipe_config=UPipeConfig(...))`: a `transformers.Trainer` subclass; everything
  else of the Trainer (callbacks, logging, lr schedules, gradient accumulation, activation checkpointing, PEFT,
  checkpoints and `resume_from_checkpoint`) keeps working.
- `TRAINER_INTERNALS`: the Trainer methods this class overrides, with the parameters they were written against
  (`tests/training/test_trainer_internals.py` fails when the installed transformers changes one).

What it does, with W processes and `sp_size` P (W = P x dp_size):
1. setup, at construction, on every rank: `hf_upipe.training.runtime.UPipeRuntime.setup` checks the settings against the
   launch and the model (sp_size, heads, kv heads, heads_per_chunk, kernel, checkpointing for offload/auto, a
   writable output_dir when checkpoints are saved; before `Trainer.__init__`, `hf_upipe.training.trainer`) and raises
   the same error on every rank before training (model_offload='cpu' without FSDP2 too); then auto settings,
   the SP groups (P neighbouring ranks, DP across them), the fused block and the tiled MLP; with
   model_offload='cpu', accelerate's FSDP2 plugin gets the host-offload policy
   (`hf_upipe.training.model_offload`). Each training step runs inside `offload_checkpoints` (offload
   'cpu'/'disk');
2. data: the Trainer's own dataloaders, with accelerate's batch sharding re-pointed from W processes to the
   dp_size SP groups (`hf_upipe.training.loaders`), so sampler seeding, epochs and `skip_first_batches` on
   resume work unchanged. Each full batch is cut by `hf_upipe.shard_batch`;
3. loss (training): the runtime's token-weighted loss: the update and the logged loss are those of the token mean
   over the whole optimizer step, whatever P, dp_size and the accumulation steps; a step without label tokens
   logs 0, as the Trainer does. With `tiled_loss` (default) the [tokens, vocab] logits never exist;
4. eval (W > 1): its own loop (`evaluation_loop`), not the Trainer's gather: no repeated examples (accelerate pads
   the last round with them), every rank the same number of forwards, one all_reduce at the end. `eval_loss` is
   the Trainer's own definition, each round's token mean weighted by its examples, so it equals a one-process
   `transformers.Trainer` with the same global batch on any eval set, at every call. With `compute_metrics` or
   `predict()`, each rank also computes per-token predictions on its shard, tile by tile (argmax ids, or
   `preprocess_logits_for_metrics(logits, aligned targets)`), gathered over the SP group in sequence order and
   over data parallelism in one-process order (`hf_upipe.training.predictions`); full-vocabulary logits never
   cross ranks. With one process the Trainer's own evaluation runs, predicting the same way;
5. checkpoints: written into a hidden staging folder, given a manifest (size and SHA-256 of every file,
   `hf_upipe.training.checkpoint`) and renamed to `checkpoint-N` once every rank has written its part, so an interrupted
   save never leaves a partial `checkpoint-N`; `train(resume_from_checkpoint=...)` verifies the manifest first and
   refuses a corrupted or incomplete checkpoint, naming the file (`hf_upipe.training.trainer`). PEFT models
   save plain PEFT adapters, others plain transformers checkpoints. Each checkpoint records its layout
   (`upipe_layout.json`): it resumes at another (SP, ring, DP) layout with the same global batch and model,
   and is refused otherwise (`hf_upipe.training.checkpoint_layout`, docs/checkpoints.md);
6. Liger (`use_liger_kernel=True`): applied by hf_upipe before `prepare_model`, with its fused linear
   cross-entropy, cross-entropy and RoPE off (`hf_upipe.training.liger`; `docs/kernels.md`); the Trainer gets
   a copy of the arguments with `use_liger_kernel=False`, so it does not apply Liger again in `train()`;
7. logs: `tokens_per_second` (real tokens of all ranks since the last log) and `peak_memory_gib` (the largest
   per-rank peak: device allocations on CUDA, process peak RSS on CPU) on every training log line
   (`hf_upipe.training.trainer`).

The checks `UPipeTrainer` runs at construction, on every rank, before training.

Entry points:
- `early_checks(args, config, parallelism, world, deepspeed)`: before `Trainer.__init__` (before transformers
  creates the output folder and accelerate its groups or DeepSpeed its SP): a writable output_dir and accelerate's
  `ParallelismConfig`, agreed over all ranks; returns the arguments transformers gets.
- `check_trainer_options(args, compute_loss_func)`: the Trainer options the loss computed here cannot honour.
- `check_metrics_options(args, world)`: the metric options the multi-process evaluation does not offer.

Atomic checkpoints and verified resumes for `UPipeTrainer`.

Entry points:
- `save_staged(write, *, run_dir, args, state)`: one checkpoint written into a hidden staging folder, given a
  manifest (size and SHA-256 of every file, `hf_upipe.training.checkpoint`) and renamed to `checkpoint-N` once every
  rank
  has written its part, so an interrupted save never leaves a partial `checkpoint-N`.
- `verify_resume(resume_from_checkpoint, output_dir)`: the checkpoint `train(resume_from_checkpoint=...)` resumes
  from, verified against its manifest on every rank.
- `resume_path(resume_from_checkpoint, output_dir)`: that checkpoint's folder (True: the last one), or None.

What `UPipeTrainer` adds to its training log lines.

Entry points:
- `with_throughput(logs, stats, device)`: a training log line with `tokens_per_second` (real tokens of all ranks
  since the last log) and `peak_memory_gib` (the largest per-rank peak) added, and the counters restarted.
- `peak_memory_bytes(device)`: this process's peak: device allocations on CUDA, process peak RSS on CPU.
"""

from __future__ import annotations

import copy
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    EvalLoopOutput,
    get_last_checkpoint,
    rotate_checkpoints,
)

from hf_upipe.adapters.replaced import replaced_forwards
from hf_upipe.allocator import arrange_allocator
from hf_upipe.config import UPipeConfig, check_config
from hf_upipe.models.peft import base_model
from hf_upipe.prepare import prepare_model
from hf_upipe.training.checkpoint import verify_checkpoint, write_manifest
from hf_upipe.training.checkpoint_layout import (
    TrainingLayout,
    check_resume_layout,
    model_fingerprint,
    rng_file,
    write_layout,
)
from hf_upipe.training.liger import apply_liger
from hf_upipe.training.loaders import share_batches_within_sp
from hf_upipe.training.model_offload import (
    apply_model_offload,
    check_cpu_collectives,
    check_model_offload,
    trainer_fsdp_version,
)
from hf_upipe.training.parallelism import (
    Launch,
    accelerate_view,
    find_parallelism,
    resolve_launch,
    uses_deepspeed,
)
from hf_upipe.training.peers import start_watch
from hf_upipe.training.predictions import (
    PredictionRecorder,
    concat_predictions,
    one_process_preprocess,
    with_metrics,
)
from hf_upipe.training.runtime import (
    UPipeRuntime,
    agree_on_errors,
    check_setup,
    output_dir_errors,
)
from hf_upipe.training.save_errors import explained_save_errors

__all__ = [
    "TRAINER_INTERNALS",
    "UPipeTrainer",
    "check_metrics_options",
    "check_trainer_options",
    "early_checks",
    "peak_memory_bytes",
    "resume_path",
    "save_staged",
    "verify_resume",
    "with_throughput",
]


_CHECKPOINTING_FIX = (
    "set TrainingArguments(activation_checkpointing=True) (older transformers: "
    "gradient_checkpointing=True)"
)


def _checkpointing(args) -> bool:
    return bool(getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing)


def _checked_early(model, args) -> bool:
    """Whether the model given to `UPipeTrainer` is checked before `Trainer.__init__`: a module, with arguments,
    not patched by Liger after (`use_liger_kernel`), without forwards another library replaced (the support gate
    runs those by behaviour on the model's device, where the Trainer moves it later)."""
    return (
        isinstance(model, torch.nn.Module)
        and args is not None
        and not getattr(args, "use_liger_kernel", False)
        and not replaced_forwards(model)
    )


def early_checks(args, launch: Launch, model=None) -> tuple:
    """The checks that must pass before `Trainer.__init__`, on every rank (one all_gather_object): a writable
    output_dir, and accelerate's `ParallelismConfig` in the `launch` (`hf_upipe.training.parallelism`); given
    the `model` the Trainer will train, also the runtime's checks (`hf_upipe.training.runtime.check_setup`): the
    launch's one agreement. Returns (the arguments transformers gets, the launch, agreed when the model was
    checked): with a parallelism config, a copy of the arguments whose `parallelism_config` has no SP (the SP ranks
    folded into data parallelism), so neither transformers nor accelerate applies its own SP."""
    errors = (
        output_dir_errors(args.output_dir)
        if args is not None and args.save_strategy != "no"
        else []
    )
    errors += launch.size_errors()
    if model is None:
        agree_on_errors(errors, launch.world)
    else:
        launch = check_setup(
            launch,
            model,
            device=args.device,
            checkpointing=_checkpointing(args),
            checkpointing_fix=_CHECKPOINTING_FIX,
            output_dir=None,
            before=(errors,),
        )
    parallelism, sp, world = launch.parallelism, launch.sp, launch.world
    if parallelism is None:
        return args, launch
    if args is None:  # what transformers' Trainer uses by default
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="trainer_output")
    fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    args = copy.copy(args)
    args.parallelism_config = accelerate_view(parallelism, sp, world, fsdp=fsdp)
    return args, launch


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


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_staged(
    write: Callable[[str], None], *, run_dir: str, args, state, layout: TrainingLayout | None = None
) -> None:
    """Write the Trainer's checkpoint of step `state.global_step` into `<run_dir>/.staging-checkpoint-N/`, give it
    its manifest, rename it to `<run_dir>/checkpoint-N` and rotate the old ones (every rank, in step).

    Args:
        write: `write(staging)` runs the Trainer's own save with its output folder re-pointed to
            `<run_dir>/<staging>` (UPipeTrainer's `_get_output_dir`).
        run_dir: the Trainer's output folder of this run; args, state: its `TrainingArguments` and `TrainerState`
            (`best_model_checkpoint` is moved to the final folder).
    """
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging_root = os.path.join(run_dir, f".staging-{name}")
    if args.should_save and os.path.exists(staging_root):
        shutil.rmtree(staging_root)  # left by an interrupted save
    _barrier()
    write(f".staging-{name}")
    _barrier()  # every rank has written its files (RNG states, sharded optimizer states)
    staged, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
    best = state.best_model_checkpoint
    if best and best.startswith(staging_root):
        state.best_model_checkpoint = os.path.join(run_dir, os.path.relpath(best, staging_root))
        if args.should_save:
            state.save_to_json(os.path.join(staged, "trainer_state.json"))
    if layout is not None and args.should_save:
        write_layout(staged, layout)
    _barrier()
    write_manifest(staged)  # every rank hashes a share; returns once the manifest is written
    if args.should_save:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(staged, final)
        shutil.rmtree(staging_root)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
    _barrier()


def resume_path(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint `train(resume_from_checkpoint=...)` names (True: the last in `output_dir`), or None."""
    path = resume_from_checkpoint
    if path is True:
        path = get_last_checkpoint(output_dir)
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else None


def verify_resume(resume_from_checkpoint, output_dir: str) -> None:
    """Verify the checkpoint `train(resume_from_checkpoint=...)` names (True: the last in `output_dir`) against its
    manifest (`hf_upipe.training.checkpoint.verify_checkpoint`); nothing to verify without one (the Trainer raises
    its own
    error when True finds none)."""
    path = resume_path(resume_from_checkpoint, output_dir)
    if path is not None:
        verify_checkpoint(path)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: device allocations (reset after reading) on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def with_throughput(logs: dict[str, float], stats: dict, device) -> tuple[dict[str, float], dict]:
    """(`logs` with `tokens_per_second` and `peak_memory_gib`, new counters) for a training log line (one
    all_reduce); (`logs`, `stats`) unchanged for other lines or before the first step.

    `stats`: {"tokens": real tokens of all ranks since `since`, "since": `time.perf_counter()` of the clock's
    start, or None}."""
    if "loss" not in logs or any(k.startswith("eval_") for k in logs) or stats["since"] is None:
        return logs, stats
    peak = torch.tensor([float(peak_memory_bytes(device))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    now = time.perf_counter()
    rate = stats["tokens"] / max(now - stats["since"], 1e-9)
    logs = {
        **logs,
        "tokens_per_second": round(rate, 1),
        "peak_memory_gib": round(peak.item() / 2**30, 3),
    }
    return logs, {"tokens": 0, "since": now}


logger = logging.getLogger(__name__)

# transformers.Trainer methods overridden here -> the parameters they were written against (transformers 5.x).
# Also relied on: `_save_checkpoint` writes through `_get_output_dir` (tested by the atomic checkpoint test), and
# `training_step` honours the documented class attribute `loss_is_scaled_for_ga`.
TRAINER_INTERNALS = {
    "_get_dataloader": (
        "self",
        "dataset",
        "description",
        "batch_size",
        "sampler_fn",
        "is_training",
        "dataloader_key",
    ),
    "get_batch_samples": ("self", "epoch_iterator", "num_batches", "device"),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "prediction_step": ("self", "model", "inputs", "prediction_loss_only", "ignore_keys"),
    "evaluation_loop": (
        "self",
        "dataloader",
        "description",
        "prediction_loss_only",
        "ignore_keys",
        "metric_key_prefix",
    ),
    "_get_output_dir": ("self", "trial"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_rng_state": ("self", "checkpoint"),
    "call_model_init": ("self", "trial"),
    "log": ("self", "logs", "start_time"),
    "train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
}


class UPipeTrainer(Trainer):
    """A `transformers.Trainer` for long sequences: UPipe sequence parallelism, exact loss, tiled loss.

    Args:
        model, args, ...: as for `transformers.Trainer` (everything is passed on).
        upipe_config: the sequence-parallel settings; default `UPipeConfig()` (all processes of a node share a
            sequence; `UPIPE_*` environment variables apply). Never modified: `trainer.upipe.config` holds the
            settings in force.

    Attributes:
        upipe: the `hf_upipe.training.runtime.UPipeRuntime` (config in force, `state` with the SP/DP groups, `plan`).

    The data collator must produce `labels` (or `shift_labels`), e.g. `DataCollatorForLanguageModeling(tokenizer,
    mlm=False)` with right padding, `default_data_collator` on pre-tokenized rows, or
    `DataCollatorWithFlattening` for packed rows. The loss is always normalised by the label tokens of the whole
    optimizer step across all ranks (the Trainer's `average_tokens_across_devices=True` semantics).

    Raises:
        ValueError / NotImplementedError at construction, on every rank, before training: the runtime's checks
            (module docstring), label smoothing or `compute_loss_func` (the loss is computed here),
            `batch_eval_metrics` or `include_for_metrics` with more than one process.
    """

    loss_is_scaled_for_ga = (
        True  # compute_loss normalises by the label tokens of the whole optimizer step
    )

    def __init__(
        self, model=None, args=None, *pargs, upipe_config: UPipeConfig | None = None, **kwargs
    ):
        world = dist.get_world_size() if dist.is_initialized() else 1
        check_config(upipe_config)
        config = upipe_config if upipe_config is not None else UPipeConfig()
        arrange_allocator(config.allocator)  # before the Trainer moves the model to the GPU
        parallelism = find_parallelism(getattr(args, "parallelism_config", None))
        deepspeed = uses_deepspeed(args)
        launch = resolve_launch(config, parallelism, world, deepspeed=deepspeed)  # the sizes, once
        args = self._launch_args(args, launch)
        # before transformers creates the output folder (main rank only) and accelerate its groups or DeepSpeed SP;
        # the model too when it is the one trained as it is (`_checked_early`): then this is the launch's one
        # agreement
        self._liger = getattr(args, "use_liger_kernel", False)
        args, launch = early_checks(args, launch, model if _checked_early(model, args) else None)
        check_model_offload(config, fsdp_version=trainer_fsdp_version(args), deepspeed=deepspeed)
        # Liger is applied here, before prepare_model, not again by Trainer.train (hf_upipe.training.liger)
        if self._liger:
            args = copy.copy(args)
            args.use_liger_kernel = False
        super().__init__(model, args, *pargs, **kwargs)
        # the process group exists now, before the runtime's collectives
        check_cpu_collectives(config)
        if self._liger and self.model is not None:
            apply_liger(self.model, self.args.liger_kernel_config)
        check_trainer_options(self.args, self.compute_loss_func)
        if not self.args.average_tokens_across_devices:
            logger.warning(
                "UPipeTrainer normalises the loss by the label tokens of all ranks "
                "(average_tokens_across_devices=True semantics); the False setting is not used."
            )
        pad = getattr(self.processing_class, "pad_token_id", None)
        self.upipe = UPipeRuntime.setup(
            # agreed on with `model`: another one (model_init's) is checked and agreed on in the setup
            launch if self.model is model else replace(launch, agreed=False),
            self.model,
            device=self.args.device,
            checkpointing=_checkpointing(self.args),
            checkpointing_fix=_CHECKPOINTING_FIX,
            pad_token_id=0 if pad is None else pad,
        )
        start_watch(world, self.args.output_dir)  # the peer watch (hf_upipe.training.peers)
        if self.is_fsdp_enabled:  # before train() prepares (shards) the model
            apply_model_offload(self.accelerator.state.fsdp_plugin, self.upipe.config)
        self._metrics_checks(world)
        self._stats = {"tokens": 0, "since": None}

    def _launch_args(self, args, launch: Launch):
        """`args` as transformers' (or TRL's) setup should see them under `launch`, resolved once before it; a
        subclass may return a copy (the GRPO trainer recounts its generation batch over `launch.dp`)."""
        return args

    def _metrics_checks(self, world: int) -> None:
        """Refuse the metric options the multi-process evaluation does not offer (`check_metrics_options`); in one
        process, predict as with more processes: the argmax ids, or `preprocess_logits_for_metrics` with the
        aligned targets, -100 on padding (`hf_upipe.training.predictions`)."""
        check_metrics_options(self.args, world)
        if world == 1:
            self.preprocess_logits_for_metrics = one_process_preprocess(
                self.preprocess_logits_for_metrics, lambda: getattr(self, "_padding", None)
            )

    @property
    def upipe_config(self) -> UPipeConfig:
        """The settings in force (`self.upipe.config`)."""
        return self.upipe.config

    # ---- setup -------------------------------------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs) -> dict:
        """transformers' DDP rule for a plain model (look for unused parameters only without activation
        checkpointing), applied to a PEFT model's transformers model too: transformers otherwise makes DDP search a
        PEFT model's graph every step, and DDP warns that it found nothing. An explicit
        `ddp_find_unused_parameters` is kept."""
        built = super()._build_accelerator_args(**kwargs)
        base = base_model(self.model) if self.model is not None else None
        if self.args.ddp_find_unused_parameters is None and base is not self.model:
            checkpointing = getattr(base, "is_activation_checkpointing", None)
            if isinstance(checkpointing, bool):
                for handler in built.get("kwargs_handlers", []):
                    if hasattr(handler, "find_unused_parameters"):
                        handler.find_unused_parameters = not (
                            checkpointing or bool(self.args.activation_checkpointing)
                        )
        return built

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if getattr(self, "_liger", False):
            apply_liger(model, self.args.liger_kernel_config)
        return prepare_model(model, self.upipe.config) if hasattr(self, "upipe") else model

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """The Trainer's `train`; a checkpoint to resume from is checked first, on every rank: its recorded layout
        against this run's (another global batch or model is refused:
        `hf_upipe.training.checkpoint_layout.check_resume_layout`), then every file against its manifest
        (`hf_upipe.training.checkpoint.verify_checkpoint`; `UPipeConfig(verify_checkpoints=False)` skips that)."""
        path = resume_path(resume_from_checkpoint, self.args.output_dir)
        # another layout resumes; another global batch or model is refused, before any step or collective
        if path is not None:
            check_resume_layout(path, self._layout())
        if self.upipe.config.verify_checkpoints:
            verify_resume(resume_from_checkpoint, self.args.output_dir)
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, with checkpointed layer inputs offloaded for its forward and backward."""
        with self.upipe.step(self.model):
            return super().training_step(model, inputs, num_items_in_batch)

    def _exact_eval(self) -> bool:
        """Whether evaluation runs this class's loop: more than one process (one process: the Trainer's own)."""
        return self.upipe.world_size > 1

    def _get_dataloader(
        self,
        dataset,
        description,
        batch_size,
        sampler_fn=None,
        is_training=False,
        dataloader_key=None,
    ):
        loader = super()._get_dataloader(
            dataset,
            description,
            batch_size,
            sampler_fn=sampler_fn,
            is_training=is_training,
            dataloader_key=dataloader_key,
        )
        exact = not is_training and self._exact_eval()
        return share_batches_within_sp(loader, self.upipe.state, evaluation=exact)

    # ---- training loss -----------------------------------------------------------------------------------------
    def _next_batches(self, epoch_iterator, num_batches: int) -> list:
        """The step's next `num_batches` full batches (fewer at the epoch's end); starts the tokens/s clock."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if self._stats["since"] is None:
            self._stats["since"] = time.perf_counter()
        return batches

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Collect the step's full batches, shard them, and count the step's label tokens over all ranks."""
        batches = self._next_batches(epoch_iterator, num_batches)
        if not batches:
            return [], None
        shards = [self.upipe.shard(b) for b in batches]
        labels, tokens = self.upipe.world_sum(
            sum(self.upipe.own_count(s) for s in shards), sum(self._real_tokens(b) for b in batches)
        )
        self._stats["tokens"] += tokens
        return shards, torch.tensor(labels, dtype=torch.float64, device=device)

    def _real_tokens(self, batch: dict) -> float:
        if self.upipe.state.sp_rank != 0:
            return 0.0
        mask = batch.get("attention_mask")
        return float(mask.sum()) if mask is not None else float(batch["input_ids"].numel())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training loss of this rank's shard: W x (its token-loss sum) / (label tokens of the whole step).
        Unsharded inputs (the Trainer's own evaluation, one process or sp_size 1) take the Trainer's loss."""
        if "shift_labels" not in inputs or "num_label_tokens" not in inputs:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        return self.upipe.loss(model, inputs, num_items_in_batch, return_outputs=return_outputs)

    # ---- evaluation --------------------------------------------------------------------------------------------
    _eval_token_stats = (
        False  # whether the exact eval loop also sums TokenStats (subclasses' metrics)
    )

    def _record_eval_sums(self, sums) -> None:
        """Hook: the exact eval loop's per-round sums (`hf_upipe.training.runtime.EvalSums`), for subclasses'
        metrics."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Trainer's (one process); the batch's attention mask is kept for `_metrics_checks`' wrapper."""
        self._padding = inputs.get("attention_mask")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def evaluation_loop(
        self,
        dataloader,
        description,
        prediction_loss_only=None,
        ignore_keys=None,
        metric_key_prefix="eval",
    ):
        """Exact eval loss and per-token predictions over every rank (module docstring, item 4); the Trainer's own
        loop with one process."""
        if not self._exact_eval():
            return super().evaluation_loop(
                dataloader,
                description,
                prediction_loss_only=prediction_loss_only,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        loss_only = (
            prediction_loss_only
            if prediction_loss_only is not None
            else self.args.prediction_loss_only
        )
        model = self.model
        model.eval()
        if hasattr(self.optimizer, "eval") and callable(self.optimizer.eval):
            self.optimizer.eval()
        self.callback_handler.eval_dataloader = dataloader
        recorder = (
            None
            if loss_only
            else PredictionRecorder(self.upipe, self.preprocess_logits_for_metrics)
        )
        current = {}

        def shards():
            for batch in dataloader:
                current["batch"] = batch
                yield self._prepare_inputs(self.upipe.shard(batch))
                self.control = self.callback_handler.on_prediction_step(
                    self.args, self.state, self.control
                )

        sums = self.upipe.eval_sums(
            model,
            dataloader,
            shards=shards(),
            context=self.compute_loss_context_manager,
            token_stats=self._eval_token_stats,
            forward=None
            if recorder is None
            else lambda s, stats: recorder.forward(model, s, current["batch"], stats),
        )
        self._record_eval_sums(sums)
        metrics = {
            f"{metric_key_prefix}_loss": sums.batch_mean(
                nan_filter=self.args.logging_nan_inf_filter
            )
        }
        preds = labels = None
        if recorder is not None:
            preds, labels = concat_predictions(recorder.result(), self.args.eval_do_concat_batches)
            metrics = with_metrics(self.compute_metrics, preds, labels, metrics, metric_key_prefix)
        return EvalLoopOutput(
            predictions=preds,
            label_ids=labels,
            metrics=metrics,
            num_samples=sum(sums.examples or []),
        )

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, self._staging) if getattr(self, "_staging", None) else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written into `<run_dir>/.staging-checkpoint-N/`, given its manifest, renamed
        (`hf_upipe.training.trainer.save_staged`)."""
        save = super()._save_checkpoint

        def write(staging: str) -> None:  # the Trainer's save, re-pointed by _get_output_dir
            self._staging = staging
            try:
                save(model, trial)
            finally:
                self._staging = None

        run_dir = super()._get_output_dir(trial)
        # a failed write (a full disk) is explained and leaves no half checkpoint (training.save_errors)
        with explained_save_errors(run_dir, should_save=self.args.should_save):
            save_staged(
                write, run_dir=run_dir, args=self.args, state=self.state, layout=self._layout()
            )

    def _layout(self) -> TrainingLayout:
        """This run's layout (`hf_upipe.training.checkpoint_layout`): recorded in checkpoints, checked on resume."""
        state = self.upipe.state
        return TrainingLayout(
            sp_size=state.sp_size,
            ring_size=state.ring_size,
            dp_size=state.dp_size,
            world_size=self.upipe.world_size,
            micro_batch=self._train_batch_size,
            grad_accum=self.args.gradient_accumulation_steps,
            model=model_fingerprint(self.model),
        )

    def _load_rng_state(self, checkpoint) -> None:
        """The Trainer's, except that a rank without its own file (a checkpoint saved by fewer processes) loads rank
        0's: every rank's generators are alike between forwards (docs/randomness.md)."""
        index = self.args.process_index
        name = os.path.join(checkpoint, f"rng_state_{index}.pth") if checkpoint else None
        if self.args.world_size == 1 or name is None or os.path.isfile(name):
            return super()._load_rng_state(checkpoint)
        source = rng_file(checkpoint, "rng_state_{}.pth", index)
        if source is None:
            return super()._load_rng_state(checkpoint)
        with tempfile.TemporaryDirectory() as folder:
            os.symlink(os.path.abspath(source), os.path.join(folder, f"rng_state_{index}.pth"))
            super()._load_rng_state(folder)

    # ---- logging -----------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `tokens_per_second` and `peak_memory_gib` to training log lines (one all_reduce per log;
        `hf_upipe.training.trainer.with_throughput`)."""
        logs, self._stats = with_throughput(logs, self._stats, self.args.device)
        super().log(logs, start_time)
