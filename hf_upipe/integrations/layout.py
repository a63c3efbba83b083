"""The layout check of sequence-parallel attention: do the ranks of an SP group hold shards of the same batch?

Entry points:
- `validate_layout(state, position_ids, mask, batch, local_len, device, documents=None)`: with one small
  all-gather (over the SP group's validation twin: bounded wait), checks that every rank has equal shard shapes,
  the same documents (`upipe_cu_seqlens`), position_ids that are global (or per document), a mask that is causal
  (inside the documents) and padding only at the end of each row; raises the same error on every rank. Once per
  model forward: later layers and checkpoint recomputes hand over the same objects and are not checked again.
  Returns whether attention keeps packed rows' documents apart (a model whose mask ignores them: no, and the caller
  drops them with `without_documents(kwargs)`).
  An attention call without position_ids is checked with those of its prepared model's call
  (`hf_upipe.integrations.model_calls`).
- `TensorCache`: tensor -> value by the tensor's identity, holding it weakly.

Every rank computes a small int64 summary of what it sees; the all-gathered summaries decide, identically on every
rank, which error (if any) to raise, before any all-to-all.
"""

from __future__ import annotations

import warnings
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from hf_upipe.batch_keys import DOCUMENT_KEYS
from hf_upipe.distributed import validation_failed
from hf_upipe.integrations.layout_rows import (
    check_ring_rows_trailing,
    check_rows_trailing,
    document_facts,
    padding_facts,
    restarts,
    usable_padding,
    usable_positions,
)
from hf_upipe.integrations.model_calls import model_positions
from hf_upipe.ops.ring import ring_positions

__all__ = [
    "TensorCache",
    "validate_layout",
    "without_documents",
]


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[n] on every rank -> [P, n] (a small int64 vector; gloo wants a flat output buffer)."""
    P = dist.get_world_size(group)
    out = torch.empty(P * t.numel(), dtype=t.dtype, device=t.device)
    # torch >= 2.13 renames it
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out.view(P, t.numel())


def _gather_checked(t: torch.Tensor, state) -> torch.Tensor:
    """`_all_gather` of a small int64 summary over the SP group's validation twin (gloo, CPU, bounded wait)."""
    group = state.check_group if state.check_group is not None else state.sp_group
    # a rank of its own (`local_sequence_parallel`): nothing to gather
    if group is None and state.sp_size == 1:
        return t.reshape(1, -1)
    try:
        out = _all_gather(t.cpu() if state.check_group is not None else t, group)
    except (RuntimeError, dist.DistError) as err:
        raise validation_failed(
            err, "the layout check of the attention (one all-gather per forward)"
        ) from None
    return out.to(t.device)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_code(dtype) -> int:
    return (
        _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES) + sum(map(ord, str(dtype)))
    )  # deterministic


def _layout_summary(
    state, position_ids, mask, batch, local_len, device, documents, dtype=None
) -> torch.Tensor:
    """This rank's facts as int64 [15]: s, B, mask ok, positions ok, padding ok locally, any pad, all pads
    (every row all padding), positions restarting locally, documents given, two checksums of them, the dtype,
    whether the model's mask here ignores / keeps the documents (positions restart locally and the mask is plain
    causal / is not), and the 2-D attention_mask's length (s without one)."""
    r, s = state.sp_rank, local_len
    pad, mask_len = usable_padding(mask, s)
    pos = usable_positions(position_ids, s, batch)  # [B, s] or None
    expected = ring_positions(
        r, s, state.sp_size, state.ring_size, pos.device if pos is not None else device
    )  # [s]
    restart = restarts(pos, pad, expected)
    mask_ok, pos_ok, given, sums, agrees = document_facts(
        state, documents, pos, mask, batch, s, device, expected
    )
    across = apart = False
    # the model's mask met a document start here
    if documents is not None and restart and mask is not None:
        # (given a 2-D attention_mask transformers never looks for documents, in any model: the mask tells nothing)
        across, apart = mask.plain_causal and not mask.mask_given, agrees
    form_ok, any_pad, all_pad = padding_facts(pad)
    return torch.tensor(
        [
            s,
            batch,
            mask_ok,
            pos_ok,
            form_ok,
            any_pad,
            all_pad,
            restart,
            given,
            *sums,
            _dtype_code(dtype),
            across,
            apart,
            mask_len,
        ],
        dtype=torch.long,
        device=device,
    )


class _Facts(NamedTuple):
    """The gathered summaries, one list per fact, indexed by SP rank (the fields of `_layout_summary`)."""

    s: list
    B: list
    mask_ok: list
    pos_ok: list
    form_ok: list
    any_pad: list
    all_pad: list
    restart: list
    given: list
    n_cu: list
    sum_cu: list
    dtypes: list
    across: list
    apart: list
    mask_len: list


def _check_shards(state, f: _Facts) -> None:
    """Mask lengths, dtypes, shard shapes and documents agree across ranks; positions restart only with documents."""
    s, mask_len, dtypes, given = f.s, f.mask_len, f.dtypes, f.given
    if any(length != local for length, local in zip(mask_len, s)):
        bad = [i for i, (length, local) in enumerate(zip(mask_len, s)) if length != local]
        raise ValueError(
            f"attention_mask has {[mask_len[i] for i in bad]} tokens per row on SP ranks {bad}, but their input_ids "
            f"hold a shard of {s[bad[0]]} tokens: pass each rank its shard of the attention_mask too "
            "(hf_upipe.shard_batch({'input_ids': ..., 'attention_mask': ...}, rank, sp_size) cuts both)."
        )
    if len(set(dtypes)) > 1:
        names = [
            str(_DTYPES[c]).replace("torch.", "") if c < len(_DTYPES) else "other" for c in dtypes
        ]
        raise ValueError(
            f"Sequence-parallel ranks compute attention in different dtypes ({names} by SP rank): "
            "load the model with the same dtype (and autocast) on every rank."
        )
    if len(set(s)) > 1 or len(set(f.B)) > 1:
        raise ValueError(
            f"Sequence-parallel ranks got different shard shapes: local lengths {s}, batch sizes {f.B}. Every rank "
            "of an SP group must get the same rows, cut into equal contiguous shards (pad the sequence to a "
            f"multiple of sp_size={state.sp_size} with ignored labels)."
        )
    if len(set(zip(given, f.n_cu, f.sum_cu))) > 1:
        raise ValueError(
            f"upipe_cu_seqlens differs across sequence-parallel ranks (given on ranks "
            f"{[i for i, g in enumerate(given) if g]}): every rank must pass the same global document boundaries, "
            "as hf_upipe.shard_batch returns them for a packed batch."
        )
    if given[0] and state.ring_size > 1:
        raise NotImplementedError(
            f"Packed rows (upipe_cu_seqlens) are not implemented with ring attention "
            f"(ring_size={state.ring_size}): pad each document to its own row, or use "
            "ring_size=1."
        )
    if not given[0] and any(f.restart):
        raise ValueError(
            f"position_ids restart inside the shards of SP ranks {[i for i, x in enumerate(f.restart) if x]}: packed "
            "rows (several documents per row) need their document boundaries under sequence parallelism. Shard the "
            "full batch with hf_upipe.shard_batch (it adds 'upipe_cu_seqlens' and 'upipe_max_seqlen' for packed "
            "rows) and pass every key of the shard to the model."
        )


def _check_positions(state, f: _Facts, position_ids) -> None:
    """Every rank's position_ids are its shard's global positions (or per document with upipe_cu_seqlens)."""
    if all(f.pos_ok):
        return
    s, B = f.s, f.B
    bad = [i for i, ok in enumerate(f.pos_ok) if not ok]
    if f.given[0]:
        raise ValueError(
            f"position_ids on SP ranks {bad} do not match upipe_cu_seqlens (each document counting 0, 1, 2, "
            f"... over the flattened batch of {B[0]} rows of {s[0] * state.sp_size} tokens), or upipe_cu_seqlens "
            "is malformed: pass the shard of hf_upipe.shard_batch unchanged (position_ids, upipe_cu_seqlens)."
        )
    where = (
        f"rank r must pass r*{s[0]} .. r*{s[0]}+{s[0] - 1}). Pass position_ids=torch.arange(S)[r*s:(r+1)*s]"
        " with each shard"
        if state.ring_size == 1
        else f"with ring_size={state.ring_size} rank r must pass hf_upipe.ops.ring.ring_positions(r, {s[0]}, "
        f"{state.sp_size}, {state.ring_size}), as hf_upipe.shard_batch does)"
    )
    raise ValueError(
        f"position_ids on SP ranks {bad} are not the global positions of their shard ({where}; "
        "per-shard positions starting at 0 break RoPE and causality. Packed rows (positions restarting) need "
        "hf_upipe.shard_batch, which adds their document boundaries ('upipe_cu_seqlens')."
        + (
            ""
            if position_ids is not None
            else " (This model's attention receives no position_ids: call "
            "hf_upipe.prepare_model(model) so that they are checked where the model receives them.)"
        )
    )


def _check_mask(f: _Facts) -> None:
    """The model's mask is one SP attention implements; padding only at the end of each row on every rank."""
    if not all(f.mask_ok):
        raise NotImplementedError(
            "The model asked for a mask other than plain causal (a sliding window, a custom mask, or packed "
            "sequences without 'upipe_cu_seqlens' / not matching them), which attn_implementation='upipe' does not "
            "implement under sequence parallelism."
        )
    if not all(f.form_ok):
        raise ValueError(
            "attention_mask has left or interior padding, which sequence-parallel 'upipe' attention cannot honour: "
            "pad on the right (padding_side='right') with labels -100 on the padding, or do not pad."
        )


def _check_padding_across_ranks(state, f: _Facts, mask, batch, device) -> None:
    """Padding continues to the end of each row across ranks (a second, rare all-gather when it may not)."""
    any_pad, all_pad = f.any_pad, f.all_pad
    if any(any_pad) and state.ring_size > 1:  # ranks are not in sequence order: compare positions
        check_ring_rows_trailing(
            state, mask, batch, f.s[0], device, lambda t: _gather_checked(t, state)
        )
    elif any(any_pad):
        # rows must be ones-then-zeros across ranks: after the first rank with padding, only full padding
        first = next(i for i, a in enumerate(any_pad) if a)
        if not all(all_pad[first + 1 :]):
            check_rows_trailing(mask, batch, device, lambda t: _gather_checked(t, state))


def _check_layout(
    state,
    position_ids,
    mask,
    batch,
    local_len,
    device,
    documents=None,
    dtype=None,
    across_documents: bool = False,
) -> bool:
    """Validate the global layout with one all-gather every rank enters; raise the same error on every rank.

    `documents`: `upipe_cu_seqlens` (int32 [N+1] over the flattened full batch) for packed rows, else None.
    `across_documents`: the architecture builds its mask without position_ids (`Architecture.packed_documents`).
    Returns whether attention keeps the documents apart (see `validate_layout`).
    """
    mine = _layout_summary(state, position_ids, mask, batch, local_len, device, documents, dtype)
    every = _gather_checked(mine, state)  # [P, 15]
    f = _Facts(*every.t().tolist())  # 15 lists of P
    _check_shards(state, f)
    _check_positions(state, f, position_ids)
    _check_mask(f)
    _check_padding_across_ranks(state, f, mask, batch, device)
    if not f.given[0]:
        return True
    # what the model's own mask did where it met a document start decides; else the registry's word
    keep_apart = any(f.apart) or not (any(f.across) or across_documents)
    if not keep_apart:
        _warn_across_documents()
    return keep_apart


_WARNED: list = []


def _warn_across_documents() -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            "This model builds its attention mask without position_ids, so on one device (sdpa, eager) the tokens "
            "of a packed row attend across its documents; under sequence parallelism hf_upipe does exactly the same "
            "(upipe_cu_seqlens only checks the position_ids). To keep documents apart, pad rows instead of "
            "packing them.",
            stacklevel=3,
        )


class TensorCache:
    """tensor -> value, by the tensor's identity, holding the tensor weakly (an entry dies with its tensor).
    (`weakref.WeakKeyDictionary` compares keys with `==`, which is elementwise for tensors.)"""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, tensor):
        entry = self._entries.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def set(self, tensor, value) -> None:
        key = id(tensor)
        self._entries[key] = (
            weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)),
            value,
        )


# position_ids tensor -> (state, mask, documents, (B, s)) it was validated with: the layout is checked once per model
# forward (the first attention layer; the other layers and checkpoint recomputes receive the same objects)
_VALIDATED = TensorCache()


def validate_layout(
    state,
    position_ids,
    mask,
    batch,
    local_len,
    device,
    documents=None,
    dtype=None,
    across_documents: bool = False,
) -> bool:
    """`_check_layout` once per model forward instead of once per layer (every rank raises the same error).

    The first attention layer of a forward checks, with one all-gather; later layers, and the recompute of
    checkpointed layers, get the same position_ids, mask and document objects and skip the check (no
    communication, no host sync). A new batch brings new tensors and is checked again.

    Returns whether the attention keeps packed rows' documents apart (True without documents). A model that builds
    its mask without position_ids (OPT, AFMoE: `Architecture.packed_documents`, or seen on a rank whose positions
    restart under a plain causal mask) attends across the documents of a packed row on one device; the caller then
    drops `upipe_cu_seqlens`, so that SP computes exactly that, and a warning says so once.
    """
    # an attention call without them (GPT-BigCode, Persimmon, CTRL...): the model's own
    if position_ids is None:
        position_ids = model_positions()
    seen = _VALIDATED.get(position_ids) if isinstance(position_ids, torch.Tensor) else None
    if (
        seen is not None
        and seen[0] is state
        and seen[1] is mask
        and seen[2] is documents
        and seen[3] == (batch, local_len)
    ):
        return seen[4]
    keep_apart = _check_layout(
        state, position_ids, mask, batch, local_len, device, documents, dtype, across_documents
    )
    if isinstance(position_ids, torch.Tensor):
        _VALIDATED.set(position_ids, (state, mask, documents, (batch, local_len), keep_apart))
    return keep_apart


def without_documents(kwargs: dict) -> dict:
    """An attention call's kwargs without the packed rows' documents (`validate_layout` returned False)."""
    return {k: v for k, v in kwargs.items() if k not in DOCUMENT_KEYS}
