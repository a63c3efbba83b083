"""`prepare_model` / `unprepare_model`: apply the registry's adapters to a loaded model, and revert them exactly.

Entry points:
- `prepare_model(model, upipe_config=None)`: switch the model to `attn_implementation="upipe"`, make
  length-dependent RoPE take the global length (`hf_upipe.adapters.rope`), install the fused
  attention block (`hf_upipe.attention.fused`) and, with `upipe_config.tiled_mlp`, the tiled MLP/RMSNorm
  (`hf_upipe.adapters.tiled_mlp`) on the modules of the architectures in `hf_upipe.models.architectures`, each once
  verified on the installed transformers (`hf_upipe.models.verification`). Idempotent; a plain transformers model, a
  PEFT
  model, or any module tree.
- `unprepare_model(model)`: remove every adapter and restore the attention implementation the model had: its
  outputs and state_dict are those of the model before `prepare_model`.

Under sequence parallelism (`init_sequence_parallel` called before), `prepare_model` first runs the support gate on
the whole model (`hf_upipe.adapters.support.model_refusal`: an unverified architecture, a token mixer other
than attention, attention that bypasses transformers' attention interface are refused), then checks in one bounded
collective that every rank of the SP group prepares the same model (class, parameter counts) with the same
settings, and raises the same error naming what differs on every rank otherwise. It also installs a forward
pre-hook on the model that refuses, under SP, what a call would silently get wrong: `labels=` without
`shift_labels=` (the model would shift inside each shard), `output_attentions=True` (no attention weights exist),
`use_cache=True` or a cache (`past_key_values`, or `cache` from transformers 5.24 on: it would hold one shard's
keys and values), any input but text to a multimodal model verified for text only (`Architecture.text_only`); and
it notes the call's position_ids and packed-row documents, which the attention uses where its call does not
receive them.

One log line says what was applied; classes kept off because an adapter is not verified on the installed
transformers (`hf_upipe.models.verification`) get a warning naming them and what differed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from hf_upipe.adapters.call_checks import (
    adopt_modules,
    install_call_checks,
    release_modules,
    remove_call_checks,
)
from hf_upipe.adapters.mixers import install_mixers, remove_mixers
from hf_upipe.adapters.rope import install_global_rope, installable, remove_global_rope
from hf_upipe.adapters.support import model_refusal, refusal_error
from hf_upipe.adapters.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp, tiled_verdict
from hf_upipe.attention.fused import (
    fused_verdict,
    install_fused_attention,
    remove_fused_attention,
)
from hf_upipe.config import check_config, differing_settings_error
from hf_upipe.distributed import get_sequence_parallel_state, simulated, validation_failed
from hf_upipe.models.architectures import ARCHITECTURES
from hf_upipe.models.peft import base_model
from hf_upipe.models.verification import verdicts

logger = logging.getLogger(__name__)

__all__ = [
    "ADAPTERS",
    "PREPARED_SETTINGS",
    "Adapter",
    "preparation",
    "preparations_error",
    "prepare_model",
    "unprepare_model",
]

_PREVIOUS = "_upipe_previous_attn_implementation"
# the settings `prepare_model` reads (what the ranks of an SP group must share with the model)
PREPARED_SETTINGS = (
    "fused_attention",
    "fused_backward",
    "overlap_comm",
    "tiled_mlp",
    "mlp_chunk_tokens",
    "mixer_state_passing",
)


def preparation(model: nn.Module, upipe_config) -> tuple:
    """((name, value, as shown), ...): what `prepare_model` does to `model` with `upipe_config`, and the model:
    what the ranks of an SP group compare (`preparations_error`)."""
    base = base_model(model)
    # ds_numel: the whole size of a parameter ZeRO-3 partitions (its local tensor is empty)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters())
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters() if p.requires_grad)
    described = (
        (type(base).__name__, total, trained),
        f"{type(base).__name__} with {total:,} parameters ({trained:,} trainable)",
    )
    if upipe_config is None:  # the values prepare_model uses without a UPipeConfig
        values = dict(
            fused_attention=True,
            fused_backward="recompute",
            overlap_comm=False,
            tiled_mlp=False,
            mlp_chunk_tokens=None,
            mixer_state_passing="parallel",
        )
        shown = {name: f"{name}={value!r} (no UPipeConfig)" for name, value in values.items()}
    else:
        values = {name: getattr(upipe_config, name) for name in PREPARED_SETTINGS}
        shown = {name: upipe_config.describe(name) for name in values}
    if not values["tiled_mlp"]:
        values["mlp_chunk_tokens"] = shown["mlp_chunk_tokens"] = None  # unused
    verdicts = _verdicts(base, values["fused_attention"], values["tiled_mlp"])
    return (
        (("model", *described),)
        + tuple((name, value, shown[name]) for name, value in values.items())
        + (("adapters verified", verdicts, f"adapters verified on this transformers: {verdicts}"),)
    )


def _verdicts(base: nn.Module, fused: bool, tiled: bool) -> tuple:
    """((adapter, subject, ok), ...) for the adapters `prepare_model` would install on `base`: reached before the
    agreement, so that ranks which (against expectation) judged a source differently are named, not run apart."""
    arch = ARCHITECTURES.get(getattr(getattr(base, "config", None), "model_type", None))
    found = []
    if arch is not None and arch.fused and fused:
        found.append(("fused", arch.model_type, fused_verdict(arch).ok))
    if arch is not None and arch.tiled and tiled:
        found.append(("tiled", arch.model_type, tiled_verdict(arch).ok))
    classes = {type(m).__name__ for m in base.modules()}
    found += [
        (adapter, subject, v.ok)
        for (adapter, subject), v in verdicts().items()
        if (adapter == "mixer" and subject in classes) or (adapter == "rope" and installable(base))
    ]
    return tuple(sorted(set(found)))


def _preparations_differ(model: nn.Module, upipe_config, state) -> ValueError | None:
    """None when every rank of the SP group prepares the same model with the same settings, else the error naming
    what differs, on every rank: one all_gather_object over the group's validation twin (none in a simulated
    world, whose collectives carry no data)."""
    group = state.check_group or state.sp_group
    if group is None or not dist.is_initialized() or simulated():
        return None
    mine = preparation(model, upipe_config)
    every = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(every, mine, group=group)
    except (RuntimeError, dist.DistError) as err:
        raise validation_failed(err, "prepare_model") from None
    return preparations_error(every)


def preparations_error(every: list[tuple]) -> ValueError | None:
    """The error naming what differs between the `preparation`s of one SP group's ranks, or None."""
    return differing_settings_error(
        every,
        "The ranks of one SP group called prepare_model differently",
        (
            ": each rank would run other collectives (or other weights) on its shard of the same sequence, which hangs "
            "or corrupts the run. Prepare the same model with the same settings on every rank."
        ),
    )


def _language_implementation(config, implementation):
    """`implementation` for the model and its language model; a multimodal model's other sub-models (a vision
    tower, an audio encoder), which run on whole inputs, keep their own (transformers' dict form; a plain string
    where the model has no such sub-model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    subs = {k: getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}}
    subs = {k: c for k, c in subs.items() if c is not None}
    if not any(c is not text for c in subs.values()):
        return implementation
    return {
        "": implementation,
        **{k: implementation for k, c in subs.items() if c is text},
        **{k: c._attn_implementation for k, c in subs.items() if c is not text},
    }


@dataclass(frozen=True)
class Adapter:
    """One adapter of `prepare_model`: `install(model, base, upipe_config)` (base: the model, PEFT unwrapped) and
    its exact inverse `remove(model, base)`, a no-op where nothing is installed. `gated`: under SP, the support gate
    runs just before this adapter is installed (and a refusal removes the adapters installed so far)."""

    name: str
    install: Callable
    remove: Callable
    gated: bool = False


def _install_mixers(model, base, upipe_config):
    passing = upipe_config.mixer_state_passing if upipe_config is not None else "parallel"
    return install_mixers(base, state_passing=passing)


def _install_tiled_mlp(model, base, upipe_config):
    if upipe_config is not None and upipe_config.tiled_mlp:
        apply_tiled_mlp(model, upipe_config.mlp_chunk_tokens)


def _use_upipe(model, base, upipe_config):
    config = getattr(base, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if config is not None and current != "upipe" and hasattr(base, "set_attn_implementation"):
        setattr(base, _PREVIOUS, _language_implementation(config, current))
        base.set_attn_implementation(_language_implementation(config, "upipe"))
        logger.info("hf_upipe: attn_implementation set to 'upipe' (was %r)", current)


def _restore_implementation(model, base):
    if _PREVIOUS in base.__dict__:
        base.set_attn_implementation(base.__dict__.pop(_PREVIOUS))


def _install_fused(model, base, upipe_config):
    """(fused modules, classes kept off as unverified, other classes), or None with fused_attention=False."""
    if upipe_config is not None and not upipe_config.fused_attention:
        return None
    return install_fused_attention(
        model,
        save=upipe_config is not None and upipe_config.fused_backward == "save",
        overlap=upipe_config is not None and upipe_config.overlap_comm,
    )


# installed in this order, removed in the reverse one (`unprepare_model`), so the revert is exact by construction;
# under SP the support gate runs before the `gated` adapter (it needs the global RoPE and the mixers in place)
ADAPTERS = (
    Adapter(
        "global RoPE", lambda m, b, c: install_global_rope(m), lambda m, b: remove_global_rope(b)
    ),
    Adapter("mixers", _install_mixers, lambda m, b: remove_mixers(b)),
    Adapter("tiled MLP", _install_tiled_mlp, lambda m, b: remove_tiled_mlp(m), gated=True),
    Adapter(
        "call checks", lambda m, b, c: install_call_checks(b), lambda m, b: remove_call_checks(b)
    ),
    Adapter("adopted modules", lambda m, b, c: adopt_modules(b), lambda m, b: release_modules(b)),
    Adapter("attention implementation", _use_upipe, _restore_implementation),
    Adapter("fused attention", _install_fused, lambda m, b: remove_fused_attention(m)),
)


def prepare_model(model: nn.Module, upipe_config=None, *, agreed: bool = False) -> nn.Module:
    """Install hf_upipe's adapters on `model` (see the module docstring).

    Args:
        model: a transformers model, a PEFT model wrapping one, or any module tree containing attention modules.
        upipe_config: an optional `hf_upipe.UPipeConfig`: `fused_attention=False` keeps the registered attention path
            (only `attn_implementation="upipe"` is set); `tiled_mlp=True` also tiles the MLPs and RMSNorms
            (`mlp_chunk_tokens`); `mixer_state_passing` picks how a hybrid's delta-rule mixers pass state.
            Offloading is per step: wrap each forward and backward in
            `hf_upipe.training.offload.offload_checkpoints(model, upipe_config.offload, ...)` (UPipeTrainer does).
        agreed: the ranks already compared this `preparation` in the launch's one agreement
            (`hf_upipe.training.runtime.agree_on_launch`): no collective here.

    Returns:
        The same model, with `attn_implementation="upipe"` set where a config is found.

    Raises:
        NotImplementedError: under sequence parallelism, a model the support gate refuses (nothing is changed).
        ValueError: `model` is not a module, or `upipe_config` not a UPipeConfig (named); under sequence
            parallelism, the ranks of an SP group prepare different models or with different
            settings (compared in one bounded collective: every rank of the group must call prepare_model).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"prepare_model needs the model (a torch.nn.Module: a transformers or PEFT model), got a "
            f"{type(model).__name__}: load it first, e.g. AutoModelForCausalLM.from_pretrained(path, "
            "attn_implementation='upipe')."
        )
    check_config(upipe_config)
    state = get_sequence_parallel_state()
    base = base_model(model)  # PEFT unwrapped once, here
    done = {}
    for i, adapter in enumerate(ADAPTERS):
        if adapter.gated and state is not None and state.sp_size > 1:
            reason = model_refusal(model, allow_unverified=state.allow_unverified)
            error = refusal_error(reason) if reason is not None else None
            if error is None and not agreed:
                error = _preparations_differ(model, upipe_config, state)
            if error is not None:
                for installed in reversed(ADAPTERS[:i]):  # nothing left installed
                    installed.remove(model, base)
                raise error
        done[adapter.name] = adapter.install(model, base, upipe_config)
    if done["fused attention"] is not None:
        _report_fused(model, upipe_config, *done["fused attention"])
    return model


def _report_fused(model: nn.Module, upipe_config, fused: int, changed: set, other: set) -> None:
    """The fused block's log lines, or the error of overlap_comm on a model none of whose modules took it."""
    if upipe_config is not None and upipe_config.overlap_comm and not fused:
        unprepare_model(model)  # nothing left installed
        raise ValueError(
            f"{upipe_config.describe('overlap_comm')} overlaps the fused block's all-to-alls, but none "
            f"of this model's attention modules takes the fused block ({sorted(changed | other)} keep "
            "the registered 'upipe' path): turn overlap_comm off."
        )
    if changed:
        logger.warning(
            "hf_upipe: %s keep the registered 'upipe' attention, not the fused block: not verified on the "
            "installed transformers (the warning above says why), or another library replaced their "
            "forward",
            sorted(changed),
        )
    logger.info(
        "hf_upipe: fused UPipe attention on %d module(s)%s",
        fused,
        f"; {sorted(other)} keep the registered 'upipe' path" if other else "",
    )


def unprepare_model(model: nn.Module) -> nn.Module:
    """Remove every adapter `prepare_model` installed, in the reverse order of `ADAPTERS`, and restore the
    previous attention implementation."""
    base = base_model(model)
    for adapter in reversed(ADAPTERS):
        adapter.remove(model, base)
    return model
