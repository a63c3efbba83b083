"""`UPipeRuntime`: the sequence-parallel setup and loss of one run, shared by `UPipeTrainer` and `UPipePlugin`.

Entry points:
- `UPipeRuntime.setup(launch, model, *, device, checkpointing, checkpointing_fix, output_dir=None,
  pad_token_id=0)`: check the settings against the launch and the model, apply auto settings, build the SP groups and
  install the fused block / tiled MLP; returns the runtime. The settings object is never changed: `runtime.config`
  is the configuration in force (a copy, with the planner's choices under `auto=True`), `runtime.state` the
  `SequenceParallelState`, `runtime.plan` the planner's answer (auto) or None, `runtime.launch` the
  `hf_upipe.training.parallelism.Launch`: the SP, ring and DP sizes and where each came from.
- `runtime.shard(batch)`: a collated batch -> this rank's shard (`hf_upipe.shard_batch`).
- `runtime.count(shards)`: label tokens of these shards' batches over all ranks, each counted once.
- `runtime.loss(model, shard, num_items)`: the token-weighted loss of a shard, ready for backward.
- `runtime.step(model)`: context for one forward + backward (offloads checkpointed inputs when configured).
- `runtime.windows(loader, steps)`: shards grouped into gradient-accumulation windows (one batch each under
  DeepSpeed, whose engine steps at every backward).
- `runtime.evaluate(model, loader)`: the exact eval loss (token mean over the whole eval set) of an
  accelerate-prepared loader; `runtime.eval_sums(...)`: its per-round sums (what `UPipeTrainer` reports from);
  both in `hf_upipe.training.runtime`.
- `NO_SP`: the state of a run without sequence parallelism.

The sections below: the setup checks (`check_setup`, `agree_on_errors`, ...) and the exact evaluation
(`eval_sums`, `evaluate`, `EvalSums`).

The flow of `setup` (every rank, the same arguments):
1. the launch, resolved once by the caller (`hf_upipe.training.parallelism.resolve_launch`: the settings, the SP,
   ring and DP sizes);
2. `hf_upipe.training.runtime.check_setup`, unless the caller's launch is agreed on already: the checks that need
   only the settings, the launch and the model, and what `init_sequence_parallel` and `prepare_model` compare,
   shared in the launch's one agreement (one all_gather_object over all ranks); every rank raises the same error
   before any other collective;
3. `auto=True`: the planner's settings (rank 0 plans in a child process and broadcasts) in a copy of the config;
4. `init_sequence_parallel`, then `prepare_model` (fused block, tiled MLP), neither agreeing again (prepare_model
   does where the auto plan changed what it reads).

The loss: N = label tokens of the whole optimizer step (all gradient-accumulation micro-batches, all SP and DP
ranks, counted once); rank r's loss = W x (its shard's summed token loss) / max(N, 1). DDP and FSDP average the
gradients over the W ranks, so the update is that of the token mean over N, exactly; a step without label tokens
gives a zero loss and zero gradients, as transformers' Trainer does.

The checks `UPipeRuntime.setup` runs before any collective but the one that shares their verdict.

Entry points:
- `check_setup(launch, model, *, device, checkpointing, checkpointing_fix, output_dir, before=())`: step 2 of
  `hf_upipe.training.runtime.UPipeRuntime.setup` (`setup_errors`, then `agree_on_launch`); returns the launch,
  agreed, or raises the same error on every rank.
- `activation_checkpointing(model)`: whether a model checkpoints its layers.
- `model_heads(model)` and `geometry_errors(config, heads, sp, world)`: the model's heads, and whether they split
  over sp_size in chunks of heads_per_chunk.
- `output_dir_errors(path)`: the writable-folder check.
- `shared_settings(config)`, `settings_error(every)` and `agree_on_launch(stages, world, settings, ...)` (or
  `agree_on_errors(errors, world, settings)`): the settings every rank must share, the error naming those that
  differ, and the all-ranks agreement (UPipeTrainer runs it before transformers creates the output folder,
  `hf_upipe.training.trainer`).

What `check_setup` checks (every rank, the same arguments): sp_size divides the processes, activation
checkpointing where offload/auto need it, the kernel runs on this device and dtype, the heads split over sp_size in
chunks of heads_per_chunk, the model passes the support gate (`hf_upipe.adapters.support`), the output folder
can be written. Each rank collects its errors; one all_gather_object over all ranks shares them with the settings,
and every rank raises the first error (naming the ranks where only some failed), or else names the settings that
differ between ranks (all but the offload folder and the planner's GPU memory must agree: they decide which
collectives run), before any other collective. Messages name each setting as the user wrote it
(`config.describe`).

The exact evaluation of one run: the token-weighted eval loss over every rank, no example counted twice.

Entry points (`hf_upipe.training.runtime.UPipeRuntime.eval_sums` and `.evaluate` call these with the runtime):
- `eval_sums(runtime, model, loader, *, shards=None, context=..., token_stats=False, forward=None)`: the per-round
  sums of an evaluation pass over an accelerate-prepared loader (what `UPipeTrainer` reports from).
- `evaluate(runtime, model, loader)`: the eval loss, the token mean over the whole eval set, in eval mode.
- `EvalSums`: those sums, with `token_mean()` and transformers' `batch_mean()`.

Every rank runs the same number of forwards (a data-parallel replica whose batches ran out runs throw-away ones
on a one-token shard: FSDP needs every rank's), and the sums cross ranks in one all_reduce at the end.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from hf_upipe.adapters.support import model_refusal, refusal_error
from hf_upipe.allocator import arrange_allocator
from hf_upipe.config import PER_RANK_SETTINGS, UPipeConfig, differing_settings_error
from hf_upipe.data import shard_batch
from hf_upipe.distributed import (
    SequenceParallelState,
    agreed_settings,
    init_sequence_parallel,
    set_sequence_parallel_state,
    settings_disagreement,
    simulated,
    validation_failed,
    validation_group,
)
from hf_upipe.models.peft import base_model
from hf_upipe.ops.head_layout import geometry_error, valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.tiled_loss import TokenStats
from hf_upipe.prepare import PREPARED_SETTINGS, preparation, preparations_error, prepare_model
from hf_upipe.training.auto_settings import apply_auto_settings
from hf_upipe.training.loaders import eval_rounds, share_batches_within_sp
from hf_upipe.training.loss import shard_loss_sum
from hf_upipe.training.offload import offload_checkpoints
from hf_upipe.training.parallelism import Launch
from hf_upipe.training.peers import guarded, start_watch

__all__ = [
    "EvalSums",
    "NO_SP",
    "UPipeRuntime",
    "activation_checkpointing",
    "agree_on_errors",
    "agree_on_launch",
    "check_setup",
    "eval_sums",
    "evaluate",
    "geometry_errors",
    "model_heads",
    "output_dir_errors",
    "settings_error",
    "setup_errors",
    "shared_settings",
]


def model_heads(model) -> tuple[int, int] | None:
    """(query heads, key-value heads) from the model's (text) config, or None when it does not say."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return (heads, kv) if isinstance(heads, int) and isinstance(kv, int) else None


def activation_checkpointing(model) -> bool:
    """Whether activation checkpointing is on for a transformers (or PEFT) model: transformers' current name,
    `is_activation_checkpointing`, where the installed version has it (the older one warns that it is deprecated)."""
    base = base_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def _dtype(model) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def output_dir_errors(path: str) -> list[Exception]:
    """[] when files can be created in `path` (created if missing), else the error saying why not."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".upipe-write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return [
            ValueError(
                f"output_dir={path!r} cannot be written ({type(err).__name__}: {err.strerror or err}): "
                "checkpoints would fail only after the training before them; choose a writable folder."
            )
        ]
    return []


def _sp_origin(config: UPipeConfig, sp: int) -> str:
    if config.sp_size is None:
        return f"sp_size={sp} (the default: the processes of one node)"
    return config.describe("sp_size")


def geometry_errors(config: UPipeConfig, heads, sp: int, world: int) -> list[Exception]:
    """The model's heads (`model_heads`) against sp_size and heads_per_chunk (empty when they fit, or without
    SP)."""
    if heads is None or sp == 1:
        return []
    H, Hk = heads
    ring = config.ring_size
    if ring > 1:  # the heads split over the U = sp / ring ranks of a ring shard
        why = geometry_error(H, Hk, sp // ring)
        if why is not None:
            return [
                ValueError(
                    f"sp_size={sp} with {config.describe('ring_size')} leaves {sp // ring} ranks per ring "
                    f"shard, which cannot split this model's attention: {why}. Values of sp_size / "
                    f"ring_size that work: {[p for p in valid_sp_sizes(H, Hk, upto=sp) if sp % p == 0]}."
                )
            ]
        sp = sp // ring
    why = geometry_error(H, Hk, sp)
    if why is not None:
        ok = [p for p in valid_sp_sizes(H, Hk, upto=world) if world % p == 0]
        return [
            ValueError(
                f"{_sp_origin(config, sp)} cannot split this model's attention: {why}. sp_size values "
                f"that work for {H} query / {Hk} key-value heads and divide the {world} processes: {ok}."
            )
        ]
    hpc = config.heads_per_chunk
    valid = valid_heads_per_chunk(H, Hk, sp)
    if hpc != "all" and hpc not in valid:
        return [
            ValueError(
                f"{config.describe('heads_per_chunk')} does not fit {H} query / {Hk} key-value heads on sp_size={sp} "
                f"({H // sp} query heads per rank, {H // max(Hk, sp)} per key-value head): use "
                f"one of {valid}, or 'all' "
                f"for all local heads in one chunk ({config.spell('heads_per_chunk', 'all')})."
            )
        ]
    return []


def shared_settings(config: UPipeConfig) -> tuple:
    """((name, value, as the user wrote it), ...) of the settings every rank must share: the schedule of the
    collectives (fused backward mode, overlap, mixer state passing, heads per chunk...) and the numerics depend on
    them."""
    return tuple(
        (f.name, getattr(config, f.name), config.describe(f.name))
        for f in fields(config)
        if f.name not in PER_RANK_SETTINGS
    )


def settings_error(every: list[tuple]) -> ValueError | None:
    """The error naming each setting whose value differs between ranks (`every`: each rank's `shared_settings`),
    or None when they all agree."""
    return differing_settings_error(
        every,
        "The ranks were given different hf_upipe settings",
        (
            ". Every rank must use the same ones (the same UPIPE_* variables, flags and script): "
            "different settings pair "
            "different collectives, which hangs or corrupts the run."
        ),
    )


def _raise_first(every: list[list[tuple[bool, str]]]) -> None:
    """Raise the first error of the first rank that found one (`every[rank]`: its (not implemented, message)
    pairs), naming the ranks where only some did."""
    failed = [rank for rank, found in enumerate(every) if found]
    if failed:
        not_implemented, message = every[failed[0]][0]
        if len(failed) < len(every):
            message += (
                f" (found on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))})"
            )
        raise (NotImplementedError if not_implemented else ValueError)(message)


def agree_on_launch(
    stages: list[list[Exception]],
    world: int,
    settings: tuple | None = None,
    *,
    init: tuple | None = None,
    prepared: tuple | None = None,
    sp: int | None = None,
) -> None:
    """The launch's one agreement: one all_gather_object over all ranks, then on every rank the error that separate
    agreements would have raised, in their order: the first stage of `stages` in which any rank found an error
    (that rank's first, naming the ranks where only some found one); the settings that differ (`settings`: each
    rank's `shared_settings`); what `init_sequence_parallel` compares (`init`: `agreed_settings`); what
    `prepare_model` compares within each SP group of `sp` neighbouring ranks (`prepared`: `preparation`)."""
    mine = ([[(isinstance(e, NotImplementedError), str(e)) for e in s] for s in stages], settings)
    mine += (init, prepared)
    every = [mine]
    distributed = world > 1 and dist.is_initialized()
    if distributed:
        every = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(every, mine, group=validation_group())
        except (RuntimeError, dist.DistError) as err:
            raise validation_failed(err, "hf_upipe's setup checks") from None
    for stage in range(len(stages)):
        _raise_first([found[stage] for found, *_ in every])
    checks = [lambda: settings_error([s for _, s, _, _ in every]) if settings is not None else None]
    if distributed and not simulated():  # a simulated world's collectives carry no data
        checks.append(lambda: settings_disagreement([i for *_, i, _ in every]) if init else None)
        shared = [p for *_, p in every]  # compared once the sizes (in `init`) agree
        groups = range(0, len(shared), sp) if prepared is not None and sp else ()
        checks += [lambda g=g: preparations_error(shared[g : g + sp]) for g in groups]
    for check in checks:  # in order: the first that finds a difference raises it
        if (error := check()) is not None:
            raise error


def agree_on_errors(errors: list[Exception], world: int, settings: tuple | None = None) -> None:
    """Raise on every rank the first error any rank found, or else (given each rank's `shared_settings`) the
    settings that differ between ranks: one all_gather_object over all ranks (`agree_on_launch`)."""
    agree_on_launch([errors], world, settings)


def setup_errors(
    launch: Launch,
    model,
    *,
    device,
    checkpointing: bool,
    checkpointing_fix: str,
    output_dir: str | None,
) -> list[Exception]:
    """Every refusal of the settings against the launch and the model (module docstring), in the order they are
    reported. Args: as for `hf_upipe.training.runtime.UPipeRuntime.setup`."""
    config, sp, world_size = launch.config, launch.sp, launch.world
    errors = list(launch.errors)
    for name in ("auto", "offload"):
        value = getattr(config, name)
        if value not in (False, "none") and not checkpointing:
            errors.append(
                ValueError(
                    f"{config.describe(name)} needs activation checkpointing on every layer ("
                    f"{'it plans with it' if name == 'auto' else 'it offloads what checkpointing keeps'}): "
                    f"{checkpointing_fix}"
                    + (f", or {config.spell('offload', 'none')}." if name == "offload" else ".")
                )
            )
    if launch.sp_error is not None:
        errors.append(launch.sp_error)
    try:
        get_kernel(config.kernel, device, _dtype(model))
    except ValueError as err:
        errors.append(ValueError(f"{config.describe('kernel')}: {err}"))
    if sp is not None:
        errors += geometry_errors(config, model_heads(model), sp, world_size)
    if sp is not None and sp > 1:
        reason = model_refusal(model, allow_unverified=config.allow_unverified)
        if reason is not None:
            errors.append(refusal_error(reason))
    if output_dir is not None:
        errors += output_dir_errors(output_dir)
    return errors


def check_setup(
    launch: Launch,
    model,
    *,
    device,
    checkpointing: bool,
    checkpointing_fix: str,
    output_dir: str | None,
    before: tuple[list[Exception], ...] = (),
) -> Launch:
    """Every check of the settings against the launch and the model (`setup_errors`), agreed over all ranks in the
    launch's one agreement (`agree_on_launch`), with what `init_sequence_parallel` and `prepare_model` would agree
    on. `before`: errors found earlier, raised first (UPipeTrainer's `early_checks`).

    Returns:
        `launch`, agreed.

    Raises:
        ValueError / NotImplementedError on every rank, after one all_gather_object and before any other
        collective.
    """
    errors = setup_errors(
        launch,
        model,
        device=device,
        checkpointing=checkpointing,
        checkpointing_fix=checkpointing_fix,
        output_dir=output_dir,
    )
    config, sp = launch.config, launch.sp
    clean = not errors and not any(
        before
    )  # what follows is compared only when no rank found an error
    init = config.init_kwargs()
    agree_on_launch(
        [*before, errors],
        launch.world,
        shared_settings(config),
        init=agreed_settings((sp, *(init[k] for k in _INIT_ORDER))) if clean else None,
        prepared=preparation(model, config) if clean and sp > 1 else None,
        sp=sp,
    )
    return launch.as_agreed()


_INIT_ORDER = (
    "heads_per_chunk",
    "kernel",
    "allow_unverified",
    "ring_size",
)  # init_sequence_parallel's settings


@dataclass
class EvalSums:
    """Per evaluation round g (the g-th batch of every data-parallel replica, what one process sees as its g-th
    batch): summed token loss and label tokens over all ranks, and the examples of the round (None when not
    recorded: one process)."""

    loss: list[float]
    tokens: list[float]
    examples: list[int] | None
    # with `eval_sums(token_stats=True)`: per round, the summed entropy and argmax hits of the label tokens
    entropy: list[float] | None = None
    correct: list[float] | None = None

    def token_mean(self) -> float:
        """The mean loss over every label token of the eval set (NaN when it has none)."""
        total = sum(self.tokens)
        return sum(self.loss) / total if total else float("nan")

    def batch_mean(self, nan_filter: bool = True) -> float:
        """transformers.Trainer's `eval_loss`: each round's token mean weighted by its examples; with `nan_filter`
        (`logging_nan_inf_filter`), rounds without label tokens are left out unless no round has any."""
        means = [s / t if t else float("nan") for s, t in zip(self.loss, self.tokens)]
        weights = self.examples if self.examples is not None else [1] * len(means)
        keep = [i for i, m in enumerate(means) if math.isfinite(m)]
        if not (nan_filter and keep):
            keep = list(range(len(means)))
        total = sum(weights[i] for i in keep)
        return sum(weights[i] * means[i] for i in keep) / total if total else float("nan")


def _throwaway_forward(runtime, model, context) -> None:
    """A forward on a one-token shard, for a replica with no batch left in a round (FSDP needs every rank's)."""
    P = runtime.state.sp_size
    ids = torch.zeros(
        1, P, dtype=torch.long, device=runtime.device
    )  # [1, P]: one token per SP rank
    shard = shard_batch(
        {"input_ids": ids, "labels": torch.full_like(ids, -100)}, runtime.state.sp_rank, P
    )
    with torch.no_grad(), context():
        runtime.loss_sum(model, shard)


def eval_sums(
    runtime,
    model,
    loader,
    *,
    shards=None,
    context=contextlib.nullcontext,
    token_stats: bool = False,
    forward=None,
) -> EvalSums:
    """Per-round loss sums of an evaluation pass over an accelerate-prepared `loader` (no repeated examples).

    Args:
        runtime: the run's `hf_upipe.training.runtime.UPipeRuntime`.
        model: the model to call (eval mode is the caller's choice).
        loader: the accelerate-prepared loader (re-pointed here for evaluation; idempotent).
        shards: this rank's shards of `loader`'s batches, on the device (default: `runtime.shard` of each batch).
        context: a context-manager factory for each forward (e.g. autocast).
        token_stats: also sum each round's entropy and argmax hits of the label tokens (`TokenStats`).
        forward: `forward(shard, token_stats) -> summed token loss` of one shard (default: `runtime.loss_sum`'s);
            UPipeTrainer's records the shard's predictions too (`hf_upipe.training.predictions`).

    Every rank runs the same number of forwards (a replica whose batches ran out runs throw-away ones), and the
    sums cross ranks in one all_reduce at the end.
    """
    share_batches_within_sp(loader, runtime.state, evaluation=True)
    rows = []
    for shard in shards if shards is not None else (runtime.shard(b) for b in loader):
        stats = TokenStats(device=shard["shift_labels"].device) if token_stats else None
        with torch.no_grad(), context():
            loss_sum = (
                runtime.loss_sum(model, shard, stats)[0]
                if forward is None
                else forward(shard, stats)
            )
        count = torch.tensor(runtime.own_count(shard), dtype=torch.float64, device=loss_sum.device)
        row = [loss_sum.detach().to(torch.float64).reshape(()), count]
        if stats is not None:
            row += [stats.entropy_sum.to(loss_sum.device), stats.correct.to(loss_sum.device)]
        rows.append(torch.stack(row))
    distributed = runtime.world_size > 1 and dist.is_initialized()
    examples = eval_rounds(loader, runtime.state.dp_size) if distributed else None
    rounds = len(examples) if examples is not None else len(rows)
    if len(rows) > rounds:
        raise RuntimeError(
            f"evaluation: {len(rows)} batches on this rank but {rounds} rounds recorded"
        )
    for _ in range(rounds - len(rows)):
        _throwaway_forward(runtime, model, context)
    # [G, (loss, tokens)] or [G, (loss, tokens, entropy, correct)]
    sums = torch.zeros(rounds, 4 if token_stats else 2, dtype=torch.float64, device=runtime.device)
    if rows:
        sums[: len(rows)] = torch.stack(rows).to(runtime.device)
    if distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    columns = sums.t().tolist() if rounds else [[] for _ in range(sums.shape[1])]
    stats = dict(entropy=columns[2], correct=columns[3]) if token_stats else {}
    return EvalSums(loss=columns[0], tokens=columns[1], examples=examples, **stats)


def evaluate(runtime, model, loader) -> float:
    """The exact eval loss of `loader` (accelerate-prepared) with `runtime` (its `eval_sums`), `model` in eval
    mode meanwhile: the token mean over every label token of the eval set, the same on every rank."""
    training = model.training
    model.eval()
    try:
        return runtime.eval_sums(model, loader).token_mean()
    finally:
        model.train(training)


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
        launch: Launch | None = None,
    ):
        self.config, self.state, self.plan, self.deepspeed = config, state, plan, deepspeed
        self.launch = launch  # the sizes and where each came from (`setup`'s), or None
        self.world_size, self.device, self.pad_token_id = (
            world_size,
            torch.device(device),
            pad_token_id,
        )

    @classmethod
    def setup(
        cls,
        launch: Launch,
        model,
        *,
        device,
        checkpointing: bool,
        checkpointing_fix: str,
        output_dir: str | None = None,
        pad_token_id: int = 0,
    ) -> UPipeRuntime:
        """Check, plan (auto), build the SP groups and prepare `model` (module docstring).

        Args:
            launch: the launch the caller resolved once (`hf_upipe.training.parallelism.resolve_launch`): the
                settings (not modified), the processes, accelerate's parallelism sizes, whether the DeepSpeed
                engine runs; when the ranks agreed on it with this model (UPipeTrainer's), the setup runs no
                agreement.
            model: the transformers or PEFT model, before accelerate/DDP/FSDP wrap it.
            device: this rank's device.
            checkpointing: whether activation checkpointing is on; `checkpointing_fix`: how the caller's user turns
                it on (named in errors).
            output_dir: a folder checkpoints will be written to (checked writable), or None.
            pad_token_id: the pad id `shard` pads the sequence with.

        Raises:
            ValueError / NotImplementedError on every rank before any collective but the one that shares them.
        """
        world_size, deepspeed = launch.world, launch.deepspeed
        arrange_allocator(launch.config.allocator)  # before prepare_model puts anything on the GPU
        if not launch.agreed:  # the launch's one agreement collective
            launch = check_setup(
                launch,
                model,
                device=device,
                checkpointing=checkpointing,
                checkpointing_fix=checkpointing_fix,
                output_dir=output_dir,
            )
        config, sp, plan = launch.config, launch.sp, None
        if config.auto:
            config, plan = apply_auto_settings(config, model, world_size=world_size)
            # the broadcast choice is the same on every rank, so is this check: no agreement needed
            agree_on_errors(geometry_errors(config, model_heads(model), sp, world_size), 1)
        if (
            world_size > 1
        ):  # the settings and the UPIPE_* environment were agreed on with the launch
            state = init_sequence_parallel(sp, **config.init_kwargs(), agreed=True)
        else:
            state = NO_SP
            set_sequence_parallel_state(None)
        # the model's preparation was agreed on too, unless the auto plan changed what prepare_model reads
        same = all(getattr(config, n) == getattr(launch.config, n) for n in PREPARED_SETTINGS)
        prepare_model(model, config, agreed=same)
        # names a rank that stops inside a step (hf_upipe.training.peers)
        start_watch(world_size, output_dir)
        return cls(
            config,
            state,
            world_size=world_size,
            device=device,
            plan=plan,
            pad_token_id=pad_token_id,
            deepspeed=deepspeed,
            launch=launch.with_plan(config),
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
        # the sequence length, for an out-of-memory message
        self.seq_len = shard["input_ids"].shape[-1] * self.state.sp_size
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
        """Context manager for one forward + backward: offloads checkpointed inputs when `offload` is set; an
        out-of-memory error is explained, and a rank that stops is named (`hf_upipe.training.peers.guarded`)."""
        cfg = self.config
        if cfg.offload == "none":
            return guarded(self, model)
        return guarded(
            self,
            model,
            offload_checkpoints(
                model, cfg.offload, path=cfg.offload_path, min_bytes=cfg.offload_min_bytes
            ),
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

    # ---- evaluation: the module's functions, with this runtime as their first argument ----
    eval_sums = (
        eval_sums  # per-round loss sums of an evaluation pass (what UPipeTrainer reports from)
    )
    evaluate = (
        evaluate  # the exact eval loss: the token mean over every label token of the eval set
    )
