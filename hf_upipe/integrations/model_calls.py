"""What a prepared model's latest call carried, for its attention layers that do not receive it themselves.

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

import weakref

import torch

from hf_upipe.batch_keys import CU_SEQLENS, MAX_SEQLEN

__all__ = [
    "adopt_modules",
    "is_adopted",
    "model_positions",
    "note_model_positions",
    "release_modules",
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
