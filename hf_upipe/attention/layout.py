"""The layout check of sequence-parallel attention: do the ranks of an SP group hold shards of the same batch?

Entry points:
- `validate_layout(state, shard)`, `ShardLayout` (one call's position_ids, mask, B, s, device, documents, dtype):
  with one small
  all-gather (over the SP group's validation twin: bounded wait), checks that every rank has equal shard shapes,
  the same documents (`upipe_cu_seqlens`), position_ids that are global (or per document), a mask that is causal
  (inside the documents) and padding only at the end of each row; raises the same error on every rank. Once per
  model forward: later layers and checkpoint recomputes hand over the same objects and are not checked again.
  Returns whether attention keeps packed rows' documents apart (a model whose mask ignores them: no, and the caller
  drops them with `without_documents(kwargs)`).
  An attention call without position_ids is checked with those of its prepared model's call
  (`hf_upipe.adapters.call_checks`).

Every rank computes a small int64 summary of what it sees; the all-gathered summaries decide, identically on every
rank, which error (if any) to raise, before any all-to-all.

Per-row facts of one rank's shard for the layout check (`hf_upipe.attention.layout`), and padding across ranks.

Entry points:
- `usable_padding(mask, s)`, `usable_positions(position_ids, s, batch)`: the padding [B, s] and position_ids
  [B, s] the check reads, or None.
- `local_documents(cu, r, s, P, B, device)`: document ids and per-document positions of rank r's tokens.
- `document_facts(state, documents, pos, mask, batch, s, device, expected)`: whether the mask and the positions
  fit the documents (`upipe_cu_seqlens`, or none), and checksums of them.
- `restarts(pos, pad, expected)`: whether positions restart between real tokens (a new document).
- `padding_facts(pad)`: padding only at the end of each row here, any padding, all padding.
- `check_ring_rows_trailing(state, mask, batch, local_len, device, gather)`,
  `check_rows_trailing(mask, batch, device, gather)`: padding continues to the end of each row across the ranks
  (a second, rare all-gather through `gather`, entered by every rank; the same error on every rank).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from hf_upipe.adapters.call_checks import model_positions
from hf_upipe.attention.mask import agrees_with_documents
from hf_upipe.attention.state import TensorCache
from hf_upipe.batch_keys import DOCUMENT_KEYS
from hf_upipe.distributed import validation_failed
from hf_upipe.ops.documents import cu_seqlens_error, left_padded_rows
from hf_upipe.ops.ring import ring_positions

__all__ = [
    "ShardLayout",
    "check_ring_rows_trailing",
    "check_rows_trailing",
    "document_facts",
    "local_documents",
    "padding_facts",
    "restarts",
    "usable_padding",
    "usable_positions",
    "validate_layout",
    "without_documents",
]


def local_documents(
    cu: torch.Tensor, r: int, s: int, P: int, B: int, device
) -> torch.Tensor | None:
    """Document ids [B, s] and their per-document positions [B, s] of rank r's tokens from the global
    `upipe_cu_seqlens` (boundaries over the flattened [B * P*s] batch); None when it is malformed."""
    cu = cu.to(device=device, dtype=torch.long).reshape(-1)  # [N+1]
    S = s * P
    if cu_seqlens_error(cu, B, S) is not None:
        return None
    g = (
        torch.arange(B, device=device)[:, None] * S + r * s + torch.arange(s, device=device)
    )  # [B, s] flat index
    doc = torch.searchsorted(cu, g, right=True) - 1  # [B, s]
    return torch.stack([doc, g - cu[doc]])  # [2, B, s]


def document_facts(state, documents, pos, mask, batch, s, device, expected):
    """(mask ok, positions ok, documents given, their two checksums, the mask agrees with the documents)."""
    if documents is None:
        mask_ok = mask is None or mask.plain_causal
        pos_ok = pos is not None and bool((pos == expected).all())
        return mask_ok, pos_ok, 0, (0, 0), None
    local = local_documents(
        documents, state.sp_rank, s, state.sp_size, batch, pos.device if pos is not None else device
    )  # [2, B, s] or None
    pos_ok = local is not None and pos is not None and bool((pos == local[1]).all())
    agrees = (
        mask is not None
        and not mask.plain_causal
        and local is not None
        and mask.mask_function is not None
        and agrees_with_documents(mask.mask_function, local[0])
    )
    mask_ok = mask is None or mask.plain_causal or agrees
    cu = documents.reshape(-1).to(torch.long)  # [N+1]
    sums = (
        int(cu.numel()),
        int((cu * (torch.arange(cu.numel(), device=cu.device) % 7919 + 1)).sum()),
    )
    return mask_ok, pos_ok, 1, sums, agrees


def usable_padding(mask, s: int):
    """(padding [B, s] or None, the 2-D attention_mask's length): a mask of another length (the whole sequence's?)
    is named after the gather, not used here."""
    pad = None if mask is None else mask.padding
    mask_len = s if pad is None else int(pad.shape[-1])
    if mask_len != s:
        pad = None
    return pad, mask_len


def usable_positions(position_ids, s: int, batch: int):
    """position_ids as [B, s] when usable; None otherwise (it then fails the position check on every rank, no
    local raise)."""
    if (
        position_ids is not None
        and position_ids.dim() in (1, 2)
        and position_ids.shape[-1] == s
        and position_ids.reshape(-1, s).shape[0] in (1, batch)
    ):
        return position_ids.reshape(-1, s).expand(batch, s)  # [B, s]
    return None


def restarts(pos, pad, expected) -> bool:
    """Between two real tokens, a position that does not continue (in ring order): a new document."""
    if pos is None:
        return False
    jump = pos[:, 1:] - pos[:, :-1] != expected[1:] - expected[:-1]  # [B, s-1]
    return bool((jump if pad is None else jump & pad[:, 1:] & pad[:, :-1]).any())


def padding_facts(pad) -> tuple[bool, bool, bool]:
    """(padding only at the end of each row here, any padding, every row all padding)."""
    if pad is None:
        return True, False, False
    # ones-then-zeros in every row: once a row has a zero, it stays zero
    return not left_padded_rows(pad), bool((~pad).any()), bool((~pad).all())


def check_ring_rows_trailing(state, mask, batch, local_len, device, gather) -> None:
    """With a ring: per row, every padded token comes after every real token in global positions (second, rare
    all-gather of each rank's last real and first padded position per row)."""
    pos = ring_positions(state.sp_rank, local_len, state.sp_size, state.ring_size, device)  # [s]
    real = (
        mask.padding
        if mask is not None and mask.padding is not None
        else torch.ones(batch, local_len, dtype=torch.bool, device=device)
    )  # [B, s], True on real tokens
    last_real = torch.where(real, pos, -1).amax(-1)  # [B]
    first_pad = torch.where(real, local_len * state.sp_size, pos).amin(-1)  # [B]
    every = gather(torch.cat([last_real, first_pad]).long()).view(-1, 2, batch)  # [P, 2, B]
    if bool((every[:, 0].amax(0) > every[:, 1].amin(0)).any()):
        raise ValueError(
            "attention_mask has interior padding across sequence shards (a padded stretch followed by "
            "real tokens): pad on the right (padding_side='right') with labels -100, or do not pad."
        )


def check_rows_trailing(mask, batch, device, gather) -> None:
    """Per-row check that padding starts on one rank and continues to the end (second, rare all-gather)."""
    pad = mask.padding if mask is not None and mask.padding is not None else None
    ones = pad.sum(-1) if pad is not None else torch.full((batch,), -1, device=device)
    length = pad.shape[-1] if pad is not None else 0
    mine = torch.where(
        ones == length, torch.full_like(ones, -1), ones
    ).long()  # -1: row has no padding here
    every = gather(mine)  # [P, B]
    for row in every.t().tolist():
        started = False
        for count in row:
            if started and count != 0:
                raise ValueError(
                    "attention_mask has interior padding across sequence shards (a padded stretch followed by real "
                    "tokens): pad on the right (padding_side='right') with labels -100, or do not pad."
                )
            started = started or count != -1


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


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """What one attention call says of this rank's shard, as the layout check reads it.

    position_ids: [B or 1, s] (None: the model's own, noted by its pre-hook); mask: the call's
    `SequenceParallelMask` (or None); batch, local_len: B and s; device, dtype: of the call's tensors;
    documents: `upipe_cu_seqlens` (int32 [N+1] over the flattened full batch) for packed rows, else None;
    across_documents: the architecture builds its mask without position_ids (`Architecture.packed_documents`)."""

    position_ids: object
    mask: object
    batch: int
    local_len: int
    device: object
    documents: object = None
    dtype: object = None
    across_documents: bool = False


def _layout_summary(state, shard: ShardLayout) -> torch.Tensor:
    """This rank's facts as int64 [15]: s, B, mask ok, positions ok, padding ok locally, any pad, all pads
    (every row all padding), positions restarting locally, documents given, two checksums of them, the dtype,
    whether the model's mask here ignores / keeps the documents (positions restart locally and the mask is plain
    causal / is not), and the 2-D attention_mask's length (s without one)."""
    position_ids, mask, batch, device = shard.position_ids, shard.mask, shard.batch, shard.device
    documents, dtype = shard.documents, shard.dtype
    r, s = state.sp_rank, shard.local_len
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


def _check_layout(state, shard: ShardLayout) -> bool:
    """Validate the global layout with one all-gather every rank enters; raise the same error on every rank.

    Returns whether attention keeps the documents apart (see `validate_layout`).
    """
    mine = _layout_summary(state, shard)
    every = _gather_checked(mine, state)  # [P, 15]
    f = _Facts(*every.t().tolist())  # 15 lists of P
    _check_shards(state, f)
    _check_positions(state, f, shard.position_ids)
    _check_mask(f)
    _check_padding_across_ranks(state, f, shard.mask, shard.batch, shard.device)
    if not f.given[0]:
        return True
    # what the model's own mask did where it met a document start decides; else the registry's word
    keep_apart = any(f.apart) or not (any(f.across) or shard.across_documents)
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


# position_ids tensor -> (state, mask, documents, (B, s)) it was validated with: the layout is checked once per model
# forward (the first attention layer; the other layers and checkpoint recomputes receive the same objects)
_VALIDATED = TensorCache()


def validate_layout(state, shard: ShardLayout) -> bool:
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
    if shard.position_ids is None:
        shard = replace(shard, position_ids=model_positions())
    position_ids, mask, documents = shard.position_ids, shard.mask, shard.documents
    sizes = (shard.batch, shard.local_len)
    seen = _VALIDATED.get(position_ids) if isinstance(position_ids, torch.Tensor) else None
    if (
        seen is not None
        and seen[0] is state
        and seen[1] is mask
        and seen[2] is documents
        and seen[3] == sizes
    ):
        return seen[4]
    keep_apart = _check_layout(state, shard)
    if isinstance(position_ids, torch.Tensor):
        _VALIDATED.set(position_ids, (state, mask, documents, sizes, keep_apart))
    return keep_apart


def without_documents(kwargs: dict) -> dict:
    """An attention call's kwargs without the packed rows' documents (`validate_layout` returned False)."""
    return {k: v for k, v in kwargs.items() if k not in DOCUMENT_KEYS}
