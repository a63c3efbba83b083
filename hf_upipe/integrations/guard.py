"""Refuse a transformers model that would run on a rank's shard as if the shard were the whole sequence.

Under sequence parallelism each rank calls the model on its shard. Attention is exact there only through
`attn_implementation="upipe"`, and token mixers (Mamba2, gated DeltaNet, short convolutions) only once
`prepare_model` installed their cross-shard forward. A model called without either would mix each shard alone,
with no error. A model without attention layers (Mamba2 alone) runs no hf_upipe code at all unless prepared, so
only a hook outside the model can notice.

Entry points:
- `sync_guard(active)`: install (True) or remove (False) a global module forward pre-hook that refuses such a call
  on every rank, before the model computes anything. Importing this module (`import hf_upipe` does) has
  `hf_upipe.distributed` call it whenever the SP state changes: active while sp_size > 1.
- An unprepared model it admits (attention "upipe", no token mixer) gets `prepare_model`'s call checks
  (`hf_upipe.integrations.call_checks`) for its later calls, and a loss that refuses unshifted labels for this one;
  `output_attentions` is refused where the weights would be collected.
- The rotary embeddings of a model it admits refuse the whole row's position_ids with a shard's hidden states,
  naming the shard's length and the fix (`call_checks.shard_length_refusal`), on its first call too.
- `unprepared_refusal(model, allow_unverified)`: why `model`, not prepared by `prepare_model`, cannot run on
  shards (its token mixers, what the support gate refuses, its attention); None if it can (no token mixer, a type
  the gate admits, its attention modules, if any, "upipe").

Cost: the hook returns at once for a module that is not a transformers model (a dict lookup by class); a model it
admitted is remembered with its attention implementation (weakly), so a step pays one lookup per model call.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hf_upipe.distributed import get_sequence_parallel_state, on_state_change
from hf_upipe.integrations.call_checks import (
    check_loss_labels,
    install_call_checks,
    refuse_generation,
    shard_length_refusal,
)
from hf_upipe.integrations.mixers import is_installed, supported
from hf_upipe.integrations.model_calls import is_adopted
from hf_upipe.integrations.support import config_refusal, model_refusal, refusal_error

__all__ = ["sync_guard", "unprepared_refusal"]

_HANDLE: list = [None]  # the installed global hook's handle
_IS_MODEL: dict[type, bool] = {}  # class -> whether it is a transformers PreTrainedModel
_ADMITTED: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # model -> (attn implementation, prepared)


def _is_transformers_model(cls: type) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in cls.__mro__
    )


def unprepared_refusal(model: nn.Module, allow_unverified: bool = False) -> str | None:
    """See the module docstring."""
    state = get_sequence_parallel_state()
    where = (
        f"{type(model).__name__} was called under sequence parallelism (sp_size="
        f"{state.sp_size if state is not None else '?'}) without hf_upipe.prepare_model"
    )
    mixers = sorted(
        {type(m).__name__ for m in model.modules() if supported(m) and not is_installed(m)}
    )
    if mixers:
        return (
            f"{where}: its {mixers} layers would each mix their rank's shard alone, from a zero state (every "
            "shard after the first silently wrong). Call model = hf_upipe.prepare_model(model) first "
            "(UPipeTrainer and UPipePlugin do), which makes them run across the shards."
        )
    # what the support gate refuses whether prepared or not (an unverified type, a mixer hf_upipe does not run)
    config = getattr(model, "config", None)
    reason = (
        config_refusal(config, allow_unverified=allow_unverified) if config is not None else None
    )
    reason = reason or model_refusal(model, allow_unverified=allow_unverified)
    if reason is not None:
        return str(refusal_error(reason))
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    attention = any(
        type(m).__name__.endswith("Attention") and not supported(m) for m in model.modules()
    )
    if attention and impl != "upipe":
        return (
            f"{where}, and its attn_implementation is {impl!r}: each rank would attend within its own shard "
            "only. Load it with attn_implementation='upipe', or call model = hf_upipe.prepare_model(model) "
            "(UPipeTrainer and UPipePlugin do). To run a model on whole sequences in this process, call it "
            "inside `with hf_upipe.without_sequence_parallel():`."
        )
    return None


def _check_rotary(module, args, kwargs) -> None:
    """A rotary embedding called as `rotary_emb(x, position_ids)` under SP with position_ids of a length no
    sequence-like dimension of x has (x: [B, s, hidden], [B, H, s, D] or [B, s, H, D]): the whole row's positions
    with a shard, named before the attention's own shape error."""
    x = args[0] if args else kwargs.get("x")
    positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
    state = get_sequence_parallel_state()
    if not (isinstance(x, torch.Tensor) and isinstance(positions, torch.Tensor) and x.dim() >= 3):
        return
    if state is None or state.sp_size == 1 or positions.shape[-1] in x.shape[1:-1]:
        return
    raise ValueError(
        shard_length_refusal("position_ids", positions, x.shape[-2], "this rank's shard")
    )


def _watch_rotary(model: nn.Module) -> None:
    """`_check_rotary` on the model's rotary embeddings (once each): they run in this call too, after this hook."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and not hasattr(module, _WATCHED):
            setattr(
                module, _WATCHED, module.register_forward_pre_hook(_check_rotary, with_kwargs=True)
            )


_WATCHED = "_upipe_rotary_check"


def _refuse_unprepared(module: nn.Module, args) -> None:
    """The global forward pre-hook (module docstring)."""
    cls = type(module)
    is_model = _IS_MODEL.get(cls)
    if is_model is None:
        is_model = _IS_MODEL[cls] = _is_transformers_model(cls)
    if not is_model:
        return None
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return None
    # what the verdict depends on: the attention implementation, and whether prepare_model prepared the model
    # (then its own checks ran) or unprepare_model released it since
    key = (
        getattr(getattr(module, "config", None), "_attn_implementation", None),
        is_adopted(module),
    )
    if _ADMITTED.get(module) == key:
        return None
    refuse_generation()
    if not key[1]:
        reason = unprepared_refusal(module, state.allow_unverified)
        if reason is not None:
            raise NotImplementedError(reason)
        check_loss_labels(module)  # this call's labels too: its loss runs after this hook
        _watch_rotary(module)  # this call's position_ids too
        install_call_checks(
            module, prepared=False
        )  # its later calls' arguments are refused as a prepared one's
    _ADMITTED[module] = key
    return None


def sync_guard(active: bool) -> None:
    """Install the global hook (active) or remove it; idempotent."""
    if active and _HANDLE[0] is None:
        _HANDLE[0] = nn.modules.module.register_module_forward_pre_hook(_refuse_unprepared)
    elif not active and _HANDLE[0] is not None:
        _HANDLE[0].remove()
        _HANDLE[0] = None
        _ADMITTED.clear()


on_state_change(lambda state: sync_guard(state is not None and state.sp_size > 1))
