"""Call arguments that would be silently wrong on a shard, refused under SP for every model, prepared or not.

`prepare_model`'s forward pre-hook refuses them on the models it prepares. A model loaded with
`attn_implementation="upipe"` and called on shards without `prepare_model` must get the same refusals, on its first
call too, where no pre-hook of ours sees its arguments. So they are also made where the argument takes effect:

- `labels=` without `shift_labels=`: the model's loss would shift the labels inside each rank's shard.
  `check_loss_labels(model)` wraps the model's own `loss_function` (the guard does, as it admits the model, before
  its first forward runs); the wrapper raises `LABELS_UNDER_SP` under SP and is the original otherwise.
- `output_attentions=True`: transformers collects the attention weights the attention modules return, and under SP
  none exist. `refuse_collected_attentions()` raises `ATTENTIONS_UNDER_SP` when transformers is collecting them
  (its output collector holds "attentions"); the "upipe" attention and the fused block call it.

Both raise on every rank alike (the same model, the same arguments), before any collective of the call.

- `shard_length_refusal(name, value, length, what)`: a tensor of the whole row (position_ids, labels, shift_labels)
  passed with a shard's input_ids is named with the shard's length and the fix, by the pre-hook below, the loss
  wrapper above and the guard (for the rotary embedding's position_ids).
- `generate()` on shards: `refuse_generation()` raises `GENERATE_UNDER_SP` (the alternative named) when a model call
  runs inside transformers' `generate`; the guard and the pre-hook below call it first.
- `install_call_checks(model)` / `remove_call_checks(model)`: the forward pre-hook `refuse_silent_misuse`, which
  refuses all of them from the call's arguments under SP, with the rest that a call can get wrong on shards:
  `use_cache=True` or a cache (`CACHE_NAMES`), non-text inputs to a multimodal model verified for text only, a
  reentrant checkpoint around a state mixer, mixers under a ring. `prepare_model` installs it; the guard installs
  it on a "upipe" model called on shards without `prepare_model`, from its second call on.

What a prepared model's latest call carried, for its attention layers that do not receive it themselves.

Entry points:
- `note_model_positions(position_ids, documents=None, max_seqlen=None, model=None)` / `model_positions()`: the
  position_ids (and packed rows' documents) a prepared model was called with (`prepare_model`'s pre-hook), for the
  models whose attention calls do not receive them (the layout check then uses what the model received).
- `adopt_modules(model)` (and `release_modules`, `is_adopted(module)`): which prepared model a module belongs to.
- `with_model_documents(kwargs, module)`: an attention call's kwargs with its own model's call's documents, when
  the call lacks them (Nemotron's decoder layers drop their kwargs).

Everything is held weakly: the tensors die with the batch, and a checkpoint recompute finds the same tensors.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

import torch
from torch import nn

from hf_upipe.adapters.mixers import reentrant_refusal, ring_refusal
from hf_upipe.batch_keys import CU_SEQLENS, DOCUMENT_KEYS, MAX_SEQLEN
from hf_upipe.distributed import get_sequence_parallel_state
from hf_upipe.models.architectures import ARCHITECTURES

__all__ = [
    "ATTENTIONS_UNDER_SP",
    "CACHE_NAMES",
    "GENERATE_UNDER_SP",
    "LABELS_UNDER_SP",
    "adopt_modules",
    "check_loss_labels",
    "install_call_checks",
    "is_adopted",
    "model_positions",
    "note_model_positions",
    "refuse_collected_attentions",
    "refuse_generation",
    "refuse_silent_misuse",
    "release_modules",
    "remove_call_checks",
    "shard_length_refusal",
    "with_model_documents",
]

_MODEL_POSITIONS: list = [
    None
]  # a weak reference to the position_ids of the latest call of a prepared model

_MODEL_DOCUMENTS: list = [
    None,
    None,
    None,
]  # and to its upipe_cu_seqlens, its upipe_max_seqlen, and the model

_OWNERS: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # module of a prepared model -> weakref(model)


def adopt_modules(model) -> None:
    """Record `model` (a prepared model) as the owner of its modules, for `with_model_documents`."""
    ref = weakref.ref(model)
    for module in model.modules():
        _OWNERS[module] = ref


def is_adopted(module) -> bool:
    """Whether `module` belongs to a model `prepare_model` prepared (and `unprepare_model` did not release)."""
    return module in _OWNERS


def release_modules(model) -> None:
    """Forget `model` as the owner of its modules (`unprepare_model`)."""
    for module in model.modules():
        _OWNERS.pop(module, None)


def note_model_positions(position_ids, documents=None, max_seqlen=None, model=None) -> None:
    """Record the position_ids (and `upipe_cu_seqlens` / `upipe_max_seqlen`) a prepared model was called with
    (`hf_upipe.prepare_model`'s pre-hook): the layout check uses them for attention calls that do not receive them
    themselves. Kept weakly, so the tensors die with the batch; a checkpoint recompute finds the same tensors."""
    _MODEL_POSITIONS[0] = (
        weakref.ref(position_ids) if isinstance(position_ids, torch.Tensor) else None
    )
    _MODEL_DOCUMENTS[:] = (
        [weakref.ref(documents), max_seqlen, None if model is None else weakref.ref(model)]
        if isinstance(documents, torch.Tensor)
        else [None, None, None]
    )


def with_model_documents(kwargs: dict, module=None) -> dict:
    """An attention call's kwargs, with the model call's packed-row documents added when the call has none, its
    position_ids are the model call's own tensor (or absent) and `module` belongs to that model: the same batch of
    the same model, so the same documents."""
    ref, owner = _MODEL_DOCUMENTS[0], _MODEL_DOCUMENTS[2]
    documents = ref() if ref is not None else None
    if documents is None or kwargs.get(CU_SEQLENS) is not None:
        return kwargs
    model = owner() if owner is not None else None
    mine = _OWNERS.get(module) if module is not None else None
    if model is None or mine is None or mine() is not model:
        return kwargs
    positions = kwargs.get("position_ids")
    if positions is not None and positions is not model_positions():
        return kwargs
    return {**kwargs, CU_SEQLENS: documents, MAX_SEQLEN: _MODEL_DOCUMENTS[1]}


def model_positions():
    """The position_ids of the latest prepared model call, or None."""
    ref = _MODEL_POSITIONS[0]
    return ref() if ref is not None else None


LABELS_UNDER_SP = (
    "labels= under sequence parallelism would be shifted inside each rank's shard (the last target of every shard "
    "lost, the shards misaligned): pass the shard's labels already shifted over the whole sequence, "
    "labels=shard['shift_labels'], shift_labels=shard['shift_labels'] (hf_upipe.shard_batch makes them), or compute "
    "the loss with hf_upipe's tiled loss."
)

GENERATE_UNDER_SP = (
    "model.generate() under sequence parallelism would run on one rank's shard of the prompt, with a KV cache of "
    "that shard only. Use hf_upipe.generate(model, input_ids, max_new_tokens=...) (input_ids the whole prompt on "
    "every rank: each rank prefills and caches its shard), or generate in one process: `with "
    "hf_upipe.without_sequence_parallel(): model.generate(input_ids)`."
)

ATTENTIONS_UNDER_SP = (
    "output_attentions=True under sequence parallelism: no [S, S] attention weights are ever "
    "formed (the kernels return outputs and log-sum-exps only)."
)

# the names transformers gives a forward's cache: `past_key_values` (to 5.23), `cache` (5.24 on)
CACHE_NAMES = ("cache", "past_key_values")

_HOOK = "_upipe_call_checks"  # the model's attribute holding the pre-hook's handle


def _sp_on() -> bool:
    state = get_sequence_parallel_state()
    return state is not None and state.sp_size > 1


def shard_length_refusal(name: str, value, length: int, what: str) -> str | None:
    """Why `value` (a tensor passed as `name` with a shard of `length` tokens, `what`) does not fit the shard, with
    the fix; None if it fits or is not a tensor. The usual mistake: the whole row's tensor with the shard's
    input_ids."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] == length:
        return None
    state = get_sequence_parallel_state()
    size = state.sp_size if state is not None else "P"
    return (
        f"{name} has {value.shape[-1]} positions but {what} has {length} (sequence parallelism, sp_size={size}): "
        f"pass this rank's shard of {name}, {name}[:, r*{length}:(r+1)*{length}] on SP rank r, as "
        f"hf_upipe.shard_batch(batch, state.sp_rank, state.sp_size) returns it"
        + (" (global positions)" if name == "position_ids" else "")
        + "."
    )


def _refusing(loss):
    @functools.wraps(loss)
    def sp_checked_loss(*args, **kwargs):
        labels = kwargs.get("labels", args[1] if len(args) > 1 else None)
        if labels is not None and kwargs.get("shift_labels") is None and _sp_on():
            raise ValueError(LABELS_UNDER_SP)
        logits = kwargs.get("logits", args[0] if args else None)
        if isinstance(logits, torch.Tensor) and logits.dim() == 3 and _sp_on():
            for name in ("shift_labels", "labels"):
                why = shard_length_refusal(
                    name,
                    kwargs.get(name, labels if name == "labels" else None),
                    logits.shape[1],
                    "this rank's shard of logits",
                )
                if why is not None:
                    raise ValueError(why)
        return loss(*args, **kwargs)

    sp_checked_loss.upipe_checked = True
    return sp_checked_loss


def check_loss_labels(model: nn.Module) -> None:
    """Make `model`'s own loss refuse unshifted labels under SP (idempotent): its `loss_function` (transformers'
    `LOSS_MAPPING` entry for its loss type), wrapped on this instance only. transformers' own tables stay as they
    are (the Trainer compares its entries by identity)."""
    if "_loss_function" in model.__dict__ or not hasattr(type(model), "loss_function"):
        return
    try:
        loss = model.loss_function
    except (AttributeError, KeyError):
        return
    model.__dict__["_loss_function"] = _refusing(loss)


def refuse_generation() -> None:
    """Raise `GENERATE_UNDER_SP` when this model call runs inside transformers' `generate` (a frame of
    transformers/generation/utils.py on the stack): its own errors (a cache, per-shard positions) would not say so."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "generate" and frame.f_code.co_filename.endswith(_GENERATION):
            raise NotImplementedError(GENERATE_UNDER_SP)
        frame = frame.f_back


_GENERATION = os.path.join("generation", "utils.py")


def refuse_collected_attentions() -> None:
    """Raise `ATTENTIONS_UNDER_SP` when transformers is collecting attention weights (its private output collector;
    without it, only `prepare_model`'s pre-hook sees the argument)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return
    collected = _active_collector.get()
    if isinstance(collected, dict) and "attentions" in collected:
        raise NotImplementedError(ATTENTIONS_UNDER_SP)


# the inputs of a text-only call (anything else of a multimodal model is refused under SP)
_TEXT_INPUTS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "inputs_embeds",
        "labels",
        "shift_labels",
        "token_type_ids",
        *DOCUMENT_KEYS,
        "cache_position",
        "num_items_in_batch",
        "logits_to_keep",
        "past_key_values",
        "cache",
    }
)


def _has_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)
    )


def refuse_silent_misuse(module, args, kwargs):
    """The forward pre-hook of `install_call_checks`: under SP, refuse the call arguments the model would silently
    get wrong (module docstring)."""
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return None
    refuse_generation()
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(LABELS_UNDER_SP)
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:  # [B, s] ids or [B, s, hidden] embeddings
        for name in ("position_ids", "shift_labels", "labels"):
            why = shard_length_refusal(name, kwargs.get(name), ids.shape[1], "this rank's shard")
            if why is not None:
                raise ValueError(why)
    if kwargs.get("output_attentions"):
        raise NotImplementedError(ATTENTIONS_UNDER_SP)
    arch = ARCHITECTURES.get(
        getattr(getattr(module, "config", None), "model_type", None)
    )  # the whole model's type
    if arch is not None and (arch.text_only or arch.vision):
        other = sorted(k for k, v in kwargs.items() if k not in _TEXT_INPUTS and _has_tensor(v))
        if arch.vision and (other or any(_has_tensor(a) for a in args[1:])):
            raise NotImplementedError(
                f"{arch.model_type} under sequence parallelism takes its images merged whole before the sequence "
                f"is sharded, and this call passes {other or 'positional inputs after input_ids'}: the vision "
                "features would be scattered into each rank's shard of the tokens. Call the model with "
                "hf_upipe.vlm.shard_multimodal_batch(model, batch, sp_rank, sp_size) (inputs_embeds, position_ids)."
            )
        if other or any(_has_tensor(a) for a in args[1:]):
            raise NotImplementedError(
                f"{arch.model_type} is verified under sequence parallelism for text input only, and this call passes "
                f"{other or 'positional inputs after input_ids'}: image, video or audio inputs would be scattered "
                "into each rank's shard of the tokens. Train on text, or without sequence parallelism."
            )
    elif arch is None:  # an unverified type, run opted in: only what a text model takes
        other = sorted(k for k, v in kwargs.items() if k not in _TEXT_INPUTS and _has_tensor(v))
        if other:
            raise NotImplementedError(
                f"{getattr(module.config, 'model_type', type(module).__name__)} is not in hf_upipe's architecture "
                f"registry, and this call passes {other}: inputs other than text (images, video, audio) would "
                "be scattered into each rank's shard of the tokens, and allow_unverified does not cover them. "
                "Train on text, or without sequence parallelism."
            )
    if (
        module.training
        and torch.is_grad_enabled()
        and (why := reentrant_refusal(module)) is not None
    ):
        raise NotImplementedError(why)
    if (
        why := ring_refusal(module, state.ring_size)
    ) is not None:  # before any layer, on every rank
        raise NotImplementedError(why)
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in CACHE_NAMES):
        raise NotImplementedError(
            "use_cache=True / a KV cache (past_key_values, cache) under sequence parallelism: "
            "the cache would hold one shard's keys and values. Call the model with "
            "use_cache=False; generate with hf_upipe.generate."
        )
    return None


def _prepared_call(module, args, kwargs):
    """`refuse_silent_misuse`, after noting the call's position_ids and documents for the attention layers of a
    prepared model that do not receive them (`hf_upipe.adapters.call_checks.note_model_positions`)."""
    state = get_sequence_parallel_state()
    if state is not None and state.sp_size > 1:
        note_model_positions(
            kwargs.get("position_ids"),
            kwargs.get(CU_SEQLENS),
            kwargs.get(MAX_SEQLEN),
            module,
        )
    return refuse_silent_misuse(module, args, kwargs)


def install_call_checks(model: nn.Module, prepared: bool = True) -> None:
    """`refuse_silent_misuse` as `model`'s forward pre-hook (idempotent). `prepare_model` installs it on the model
    it prepares (`prepared`: the hook also notes the call's positions for its attention layers, and replaces a hook
    the guard installed before); the guard (`hf_upipe.adapters.hooks`) on a transformers model it admits on
    shards without `prepare_model` (refusals only: it may be a model inside another, whose positions are not its
    own)."""
    kind = model.__dict__.get(_HOOK, (None, None))[1]
    if kind == "prepared" or (kind == "guard" and not prepared):
        return
    remove_call_checks(model, loss=False)
    hook = _prepared_call if prepared else refuse_silent_misuse
    model.__dict__[_HOOK] = (
        model.register_forward_pre_hook(hook, with_kwargs=True),
        "prepared" if prepared else "guard",
    )


def remove_call_checks(model: nn.Module, loss: bool = True) -> None:
    """Remove the pre-hook (and, with `loss`, the loss wrapper of `check_loss_labels`): nothing of them is left."""
    if _HOOK in model.__dict__:
        model.__dict__.pop(_HOOK)[0].remove()
    if loss and getattr(model.__dict__.get("_loss_function"), "upipe_checked", False):
        del model.__dict__["_loss_function"]
