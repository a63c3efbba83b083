"""The checks `UPipeRuntime.setup` runs before any collective but the one that shares their verdict.

Entry points:
- `check_setup(config, model, *, world_size, device, checkpointing, checkpointing_fix, output_dir, parallelism,
  deepspeed)`: step 1 of `hf_upipe.runtime.UPipeRuntime.setup`; returns (the config with accelerate's SP degree
  applied, sp_size) or raises the same error on every rank.
- `activation_checkpointing(model)`: whether a model checkpoints its layers.
- `model_heads(model)` and `geometry_errors(config, heads, sp, world)`: the model's heads, and whether they split
  over sp_size in chunks of heads_per_chunk.
- `output_dir_errors(path)`: the writable-folder check.
- `shared_settings(config)`, `settings_error(every)` and `agree_on_errors(errors, world, settings)`: the settings
  every rank must share, the error naming those that differ, and the all-ranks agreement (UPipeTrainer runs it
  before transformers creates the output folder, `hf_upipe.trainer_checks`).

What `check_setup` checks (every rank, the same arguments): sp_size divides the processes, activation
checkpointing where offload/auto need it, the kernel runs on this device and dtype, the heads split over sp_size in
chunks of heads_per_chunk, the model passes the support gate (`hf_upipe.integrations.support`), the output folder
can be written. Each rank collects its errors; one all_gather_object over all ranks shares them with the settings,
and every rank raises the first error (naming the ranks where only some failed), or else names the settings that
differ between ranks (all but the offload folder and the planner's GPU memory must agree: they decide which
collectives run), before any other collective. Messages name each setting as the user wrote it
(`config.describe`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import fields

import torch
import torch.distributed as dist

from hf_upipe.config import PER_RANK_SETTINGS, UPipeConfig, differing_settings_error
from hf_upipe.distributed import validation_failed, validation_group
from hf_upipe.integrations.parallelism import (
    ParallelismSizes,
    parallelism_errors,
    with_parallelism_sp,
)
from hf_upipe.integrations.peft import base_model
from hf_upipe.integrations.support import model_refusal, refusal_error
from hf_upipe.ops.head_layout import geometry_error, valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.ops.kernels import get_kernel

__all__ = [
    "activation_checkpointing",
    "agree_on_errors",
    "check_setup",
    "geometry_errors",
    "model_heads",
    "output_dir_errors",
    "settings_error",
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


def agree_on_errors(errors: list[Exception], world: int, settings: tuple | None = None) -> None:
    """Raise on every rank the first error any rank found, or else (given each rank's `shared_settings`) the
    settings that differ between ranks: one all_gather_object over all ranks."""
    mine = ([(isinstance(e, NotImplementedError), str(e)) for e in errors], settings)
    every = [mine]
    if world > 1 and dist.is_initialized():
        every = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(every, mine, group=validation_group())
        except (RuntimeError, dist.DistError) as err:
            raise validation_failed(err, "hf_upipe's setup checks") from None
    failed = [rank for rank, (found, _) in enumerate(every) if found]
    if failed:
        not_implemented, message = every[failed[0]][0][0]
        if len(failed) < len(every):
            message += (
                f" (found on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))})"
            )
        raise (NotImplementedError if not_implemented else ValueError)(message)
    if settings is not None and (err := settings_error([s for _, s in every])) is not None:
        raise err


def check_setup(
    config: UPipeConfig,
    model,
    *,
    world_size: int,
    device,
    checkpointing: bool,
    checkpointing_fix: str,
    output_dir: str | None,
    parallelism: ParallelismSizes | None,
    deepspeed: bool,
) -> tuple[UPipeConfig, int]:
    """Every check of the settings against the launch and the model (module docstring), agreed over all ranks.

    Args: as for `hf_upipe.runtime.UPipeRuntime.setup`.

    Returns:
        (`config` with the sp_size of accelerate's `ParallelismConfig` where it gives none, the resolved sp_size).

    Raises:
        ValueError / NotImplementedError on every rank, after one all_gather_object and before any other
        collective.
    """
    errors = parallelism_errors(config, parallelism, world_size, deepspeed=deepspeed)
    config = with_parallelism_sp(config, parallelism)
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
    sp = None
    try:
        sp = config.resolve_sp_size(world_size)
    except ValueError as err:
        errors.append(err)
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
    agree_on_errors(errors, world_size, shared_settings(config))
    return config, sp
