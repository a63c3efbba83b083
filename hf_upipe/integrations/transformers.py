"""`attn_implementation="upipe"` for transformers: the attention function and its mask function.

Entry points:
- `register()`: adds "upipe" to transformers' `AttentionInterface` and `AttentionMaskInterface` (idempotent; run
  when this module is imported, which `import hf_upipe` arranges as soon as transformers' modeling code loads).
- `upipe_attention_forward(module, query, key, value, attention_mask, ...)`: the registered attention function.
- `upipe_mask(...)`: the registered mask function; `SequenceParallelMask`: what it returns under SP.
- `sp_kernel(state, kwargs, device, dtype, seq_len)`: the state's kernel, wrapped in
  `hf_upipe.ops.documents.DocumentKernel` for packed rows (one per batch; shared with the fused path).
- `active_state()`, `check_call(...)`, `validate_layout(...)`, `sliding_window_check(...)`: the checks the fused
  path shares; `validate_layout` runs the layout all-gather once per model forward, not per layer.

The flow, with sequence parallelism initialised (`hf_upipe.init_sequence_parallel`, group of P > 1 ranks):
1. each rank calls the model on its contiguous shard input_ids [B, s] with GLOBAL position_ids
   (rank r: r*s .. r*s+s-1), so RoPE is applied with global positions before attention; for packed rows
   (several documents per row) with per-document position_ids and the document boundaries
   `upipe_cu_seqlens` / `upipe_max_seqlen` (`hf_upipe.shard_batch` makes all of these), which transformers
   passes through its kwargs to the attention function;
2. `upipe_mask` does not build an O(S^2) mask: it passes on the 2-D padding mask (if any) and whether the
   model asked for plain causal masking (else the mask function, probed later), as a `SequenceParallelMask`;
3. `upipe_attention_forward` checks (once per model forward: the first layer; `validate_layout`), with one tiny
   all-gather that every rank enters, that the ranks agree on
   the layout (equal shard lengths, the same documents, position_ids that are global or match the documents,
   a mask that is causal (within the local documents), padding only at the end of each row), so a bad batch
   raises the same error on every rank before any all-to-all; then it runs `hf_upipe.ops.upipe_attention` on
   the shard, with the kernel wrapped in `DocumentKernel` for packed rows (each token attends only to earlier
   tokens of its own document).
Without SP (never initialised, or a group of one rank) "upipe" is exactly transformers' "sdpa": same mask, same
kernel, padding, packing and generation with a KV cache included (`upipe_cu_seqlens` is ignored there).

Under SP, trailing (right) padding is accepted: causal attention never lets a real token see a later pad, so
real tokens are exact; outputs at padded positions are not meaningful and their labels must be ignored (-100).
Left or interior padding, packed rows without `upipe_cu_seqlens`, sliding windows shorter than the sequence,
custom masks, dropout, softcap, attention sinks and KV caches with past tokens raise errors naming the fix.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from hf_upipe.distributed import SequenceParallelState, get_sequence_parallel_state
from hf_upipe.ops.documents import DocumentKernel, cu_seqlens_error, left_padded_rows
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.upipe_attention import upipe_attention

__all__ = ["SequenceParallelMask", "active_state", "check_call", "register", "sliding_window_check", "sp_kernel",
           "upipe_attention_forward", "upipe_mask", "validate_layout"]

NAME = "upipe"


@dataclass(frozen=True)
class SequenceParallelMask:
    """What the attention function needs to know about masking under SP (instead of an O(S^2) mask).

    Attributes:
        padding: [B, s] bool, True for real tokens of this rank's shard; None when nothing is padded.
        plain_causal: False when the model asked for more than causal masking (packed-sequence, sliding-window
            or custom mask functions); the SP path accepts such a mask only when it agrees with causal masking
            inside the documents given by `upipe_cu_seqlens` (transformers' packed mask from local position_ids).
        mask_function: the model's mask function when not plain causal (probed by the attention function), else
            None.
    """

    padding: torch.Tensor | None
    plain_causal: bool
    mask_function: Callable | None = field(default=None, compare=False, repr=False)


def active_state() -> SequenceParallelState | None:
    """The installed sequence-parallel state when it has more than one rank (SP on), else None."""
    return _active_state()


def _active_state() -> SequenceParallelState | None:
    state = get_sequence_parallel_state()
    return state if state is not None and state.sp_size > 1 else None


def upipe_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
               attention_mask=None, **kwargs):
    """Mask function registered for "upipe": `sdpa_mask` without SP, a `SequenceParallelMask` with SP."""
    if _active_state() is None:
        return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                         mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    padding = attention_mask
    # a fake mask (memory simulation) carries no values: simulations model unpadded batches
    if padding is not None and (is_fake(padding) or bool(padding.all())):
        padding = None
    plain = mask_function is causal_mask_function or _agrees_with_causal(mask_function, q_length, batch_size)
    return SequenceParallelMask(padding=padding, plain_causal=plain, mask_function=None if plain else mask_function)


def _probe(mask_function, b: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether the vectorised mask function equals `expected` at the (q_idx, kv_idx) pairs [n] of row b."""
    try:
        got = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, kv_idx)
    except (IndexError, RuntimeError, TypeError):  # a mask function that cannot be probed: no agreement
        return False
    return torch.equal(torch.as_tensor(got, device=expected.device).bool().expand_as(expected), expected)


def _agrees_with_causal(mask_function, length: int, batch_size: int) -> bool:
    """Probe a model's mask function on a grid of local (query, key) positions against plain causal masking.

    A sliding window at least as long as the shard passes here (the attention function then checks the window
    against the full sequence); packed-sequence, chunked, bidirectional-block and windows shorter than the shard
    fail. Mask functions are vectorised over index tensors, as `sdpa_mask` calls them.
    """
    points = torch.tensor(sorted({0, 1, length // 2, length - 1} & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    return all(_probe(mask_function, b, q_idx, kv_idx, q_idx >= kv_idx) for b in range(batch_size))


def _agrees_with_documents(mask_function, doc: torch.Tensor, max_points: int = 24) -> bool:
    """Probe a mask function against causal masking inside the local documents `doc` [B, s] (document ids).

    Points: the plain grid {0, 1, s/2, s-1} plus, per row, the local document starts and the tokens just before
    them (at most `max_points` starts, evenly spaced), so the packed mask transformers builds from the local
    position_ids passes and windows shorter than the shard or custom masks still fail.
    """
    B, s = doc.shape
    doc = doc.cpu()  # [B, s]
    for b in range(B):
        row = doc[b]
        starts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()  # local document starts
        if len(starts) > max_points:
            starts = [starts[i * len(starts) // max_points] for i in range(max_points)]
        points = torch.tensor(sorted(({0, 1, s // 2, s - 1} | set(starts) | {a - 1 for a in starts}) & set(range(s))))
        q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
        expected = (q_idx >= kv_idx) & (row[q_idx] == row[kv_idx])  # [n]
        if not _probe(mask_function, b, q_idx, kv_idx, expected):
            return False
    return True


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[n] on every rank -> [P, n] (a small int64 vector; gloo wants a flat output buffer)."""
    P = dist.get_world_size(group)
    out = torch.empty(P * t.numel(), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renames it
    gather(out, t.contiguous(), group=group)
    return out.view(P, t.numel())


def _local_documents(cu: torch.Tensor, r: int, s: int, P: int, B: int, device) -> torch.Tensor | None:
    """Document ids [B, s] and their per-document positions [B, s] of rank r's tokens from the global
    `upipe_cu_seqlens` (boundaries over the flattened [B * P*s] batch); None when it is malformed."""
    cu = cu.to(device=device, dtype=torch.long).reshape(-1)  # [N+1]
    S = s * P
    if cu_seqlens_error(cu, B, S) is not None:
        return None
    g = torch.arange(B, device=device)[:, None] * S + r * s + torch.arange(s, device=device)  # [B, s] flat index
    doc = torch.searchsorted(cu, g, right=True) - 1  # [B, s]
    return torch.stack([doc, g - cu[doc]])  # [2, B, s]


def _layout_summary(state, position_ids, mask, batch, local_len, device, documents) -> torch.Tensor:
    """This rank's facts as int64 [11]: s, B, mask ok, positions ok, padding ok locally, any pad, all pads
    (every row all padding), positions restarting locally, documents given, and two checksums of them."""
    r, s = state.sp_rank, local_len
    pad = None if mask is None else mask.padding
    pos = None  # [B, s] when usable; anything else fails the position check on every rank (no local raise)
    if position_ids is not None and position_ids.dim() in (1, 2) and position_ids.shape[-1] == s \
            and position_ids.reshape(-1, s).shape[0] in (1, batch):
        pos = position_ids.reshape(-1, s).expand(batch, s)  # [B, s]
    restart = False
    if pos is not None:  # between two real tokens, a position that does not continue: a new document
        jump = pos[:, 1:] != pos[:, :-1] + 1  # [B, s-1]
        restart = bool((jump if pad is None else jump & pad[:, 1:] & pad[:, :-1]).any())
    if documents is None:
        mask_ok = mask is None or mask.plain_causal
        pos_ok = pos is not None and bool((pos == torch.arange(r * s, (r + 1) * s, device=pos.device)).all())
        given, sums = 0, (0, 0)
    else:
        local = _local_documents(documents, r, s, state.sp_size, batch, pos.device if pos is not None else device)
        pos_ok = local is not None and pos is not None and bool((pos == local[1]).all())
        mask_ok = mask is None or mask.plain_causal or (
            local is not None and mask.mask_function is not None
            and _agrees_with_documents(mask.mask_function, local[0]))
        cu = documents.reshape(-1).to(torch.long)
        given, sums = 1, (int(cu.numel()), int((cu * (torch.arange(cu.numel(), device=cu.device) % 7919 + 1)).sum()))
    if pad is None:
        form_ok, any_pad, all_pad = True, False, False
    else:
        # ones-then-zeros in every row: once a row has a zero, it stays zero
        form_ok = not left_padded_rows(pad)
        any_pad, all_pad = bool((~pad).any()), bool((~pad).all())
    return torch.tensor([s, batch, mask_ok, pos_ok, form_ok, any_pad, all_pad, restart, given, *sums],
                        dtype=torch.long, device=device)


def _check_layout(state, position_ids, mask, batch, local_len, device, documents=None) -> None:
    """Validate the global layout with one all-gather every rank enters; raise the same error on every rank.

    `documents`: `upipe_cu_seqlens` (int32 [N+1] over the flattened full batch) for packed rows, else None.
    """
    mine = _layout_summary(state, position_ids, mask, batch, local_len, device, documents)
    every = _all_gather(mine, state.sp_group)  # [P, 11]
    s, B, mask_ok, pos_ok, form_ok, any_pad, all_pad, restart, given, n_cu, sum_cu = every.t().tolist()
    if len(set(s)) > 1 or len(set(B)) > 1:
        raise ValueError(
            f"Sequence-parallel ranks got different shard shapes: local lengths {s}, batch sizes {B}. Every rank "
            "of an SP group must get the same rows, cut into equal contiguous shards (pad the sequence to a "
            f"multiple of sp_size={state.sp_size} with ignored labels)."
        )
    if len(set(zip(given, n_cu, sum_cu))) > 1:
        raise ValueError(
            f"upipe_cu_seqlens differs across sequence-parallel ranks (given on ranks "
            f"{[i for i, g in enumerate(given) if g]}): every rank must pass the same global document boundaries, "
            "as hf_upipe.shard_batch returns them for a packed batch."
        )
    if not given[0] and any(restart):
        raise ValueError(
            f"position_ids restart inside the shards of SP ranks {[i for i, x in enumerate(restart) if x]}: packed "
            "rows (several documents per row) need their document boundaries under sequence parallelism. Shard the "
            "full batch with hf_upipe.shard_batch (it adds 'upipe_cu_seqlens' and 'upipe_max_seqlen' for packed "
            "rows) and pass every key of the shard to the model."
        )
    if not all(pos_ok):
        bad = [i for i, ok in enumerate(pos_ok) if not ok]
        if given[0]:
            raise ValueError(
                f"position_ids on SP ranks {bad} do not match upipe_cu_seqlens (each document counting 0, 1, 2, "
                f"... over the flattened batch of {B[0]} rows of {s[0] * state.sp_size} tokens), or upipe_cu_seqlens "
                "is malformed: pass the shard of hf_upipe.shard_batch unchanged (position_ids, upipe_cu_seqlens)."
            )
        raise ValueError(
            f"position_ids on SP ranks {bad} are not the global positions of their shard (rank r must pass "
            f"r*{s[0]} .. r*{s[0]}+{s[0] - 1}). Pass position_ids=torch.arange(S)[r*s:(r+1)*s] with each shard; "
            "per-shard positions starting at 0 break RoPE and causality. Packed rows (positions restarting) need "
            "hf_upipe.shard_batch, which adds their document boundaries ('upipe_cu_seqlens')."
        )
    if not all(mask_ok):
        raise NotImplementedError(
            "The model asked for a mask other than plain causal (a sliding window, a custom mask, or packed "
            "sequences without 'upipe_cu_seqlens' / not matching them), which attn_implementation='upipe' does not "
            "implement under sequence parallelism."
        )
    if not all(form_ok):
        raise ValueError(
            "attention_mask has left or interior padding, which sequence-parallel 'upipe' attention cannot honour: "
            "pad on the right (padding_side='right') with labels -100 on the padding, or do not pad."
        )
    if any(any_pad):
        # rows must be ones-then-zeros across ranks: after the first rank with padding, only full padding
        first = next(i for i, a in enumerate(any_pad) if a)
        if not all(all_pad[first + 1:]):
            _check_rows_trailing(state, mask, batch, device)


class _TensorCache:
    """tensor -> value, by the tensor's identity, holding the tensor weakly (an entry dies with its tensor).
    (`weakref.WeakKeyDictionary` compares keys with `==`, which is elementwise for tensors.)"""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, tensor):
        entry = self._entries.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def set(self, tensor, value) -> None:
        key = id(tensor)
        self._entries[key] = (weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)), value)


# position_ids tensor -> (state, mask, documents, (B, s)) it was validated with: the layout is checked once per model
# forward (the first attention layer; the other layers and checkpoint recomputes receive the same objects)
_VALIDATED = _TensorCache()
# upipe_cu_seqlens tensor -> ((kernel name, device, dtype, S), DocumentKernel) of the current batch
_DOCUMENT_KERNELS = _TensorCache()


def validate_layout(state, position_ids, mask, batch, local_len, device, documents=None) -> None:
    """`_check_layout` once per model forward instead of once per layer (every rank raises the same error).

    The first attention layer of a forward checks, with one all-gather; later layers, and the recompute of
    checkpointed layers, get the same position_ids, mask and document objects and skip the check (no
    communication, no host sync). A new batch brings new tensors and is checked again.
    """
    seen = _VALIDATED.get(position_ids) if isinstance(position_ids, torch.Tensor) else None
    if seen is not None and seen[0] is state and seen[1] is mask and seen[2] is documents \
            and seen[3] == (batch, local_len):
        return
    _check_layout(state, position_ids, mask, batch, local_len, device, documents)
    if isinstance(position_ids, torch.Tensor):
        _VALIDATED.set(position_ids, (state, mask, documents, (batch, local_len)))


def _check_rows_trailing(state, mask, batch, device) -> None:
    """Per-row check that padding starts on one rank and continues to the end (second, rare all-gather)."""
    pad = mask.padding if mask is not None and mask.padding is not None else None
    ones = pad.sum(-1) if pad is not None else torch.full((batch,), -1, device=device)
    length = pad.shape[-1] if pad is not None else 0
    mine = torch.where(ones == length, torch.full_like(ones, -1), ones).long()  # -1: row has no padding here
    every = _all_gather(mine, state.sp_group)  # [P, B]
    for row in every.t().tolist():
        started = False
        for count in row:
            if started and count != 0:
                raise ValueError(
                    "attention_mask has interior padding across sequence shards (a padded stretch followed by real "
                    "tokens): pad on the right (padding_side='right') with labels -100, or do not pad."
                )
            started = started or count != -1


# the names transformers configs give the attention dropout probability
_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout",
                 "attention_dropout_prob")


def check_call(module, dropout, kwargs) -> None:
    """Checks of one attention call that need no communication (identical on every rank: same model, same
    arguments): causal attention, no dropout, no softcap or attention sinks."""
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("attn_implementation='upipe' supports causal (decoder) attention only.")
    if dropout and dropout > 0.0:
        config = getattr(module, "config", None)
        keys = [k for k in _DROPOUT_KEYS if getattr(config, k, None) == dropout] or ["attention_dropout"]
        raise NotImplementedError(
            f"attention dropout={dropout} is not supported by sequence-parallel 'upipe' attention: set the model "
            f"config's {keys[0]}=0.0 (e.g. from_pretrained(..., {keys[0]}=0.0)) or call model.eval()."
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"'{name}' is not supported by sequence-parallel 'upipe' attention.")


def sliding_window_check(sliding_window: int | None, seq_len: int) -> None:
    """Raise when a sliding window is shorter than the full sequence (not implemented under SP)."""
    if sliding_window is not None and sliding_window < seq_len:
        raise NotImplementedError(
            f"sliding_window={sliding_window} is shorter than the sequence ({seq_len} tokens): "
            "sliding-window attention is not implemented under sequence parallelism (use a sequence no longer "
            "than the window, or a config with use_sliding_window=False / sliding_window=None)."
        )


def _check_kv_length(query, key) -> None:
    if key.shape[-2] != query.shape[-2]:
        raise NotImplementedError(
            f"key length {key.shape[-2]} != query length {query.shape[-2]}: a KV cache with past tokens "
            "(generation) is not supported under sequence parallelism; generate without SP (one process), or "
            "call the model with use_cache=False."
        )


def sp_kernel(state, kwargs: dict, device, dtype, seq_len: int) -> str | AttentionKernel:
    """The attention kernel for this call: the state's kernel, or for packed rows (`upipe_cu_seqlens` in the
    model's kwargs) that kernel wrapped in `DocumentKernel` over the full sequence of `seq_len` tokens."""
    documents = kwargs.get("upipe_cu_seqlens")
    if documents is None:
        return state.kernel
    key = (state.kernel, device, dtype, seq_len)
    cached = _DOCUMENT_KERNELS.get(documents)
    if cached is not None and cached[0] == key:
        return cached[1]  # one DocumentKernel per batch: its documents are read (one sync) once, not per layer
    inner = get_kernel(state.kernel, device, dtype) if isinstance(state.kernel, str) else state.kernel
    kernel = DocumentKernel(inner, documents, seq_len, kwargs.get("upipe_max_seqlen"))
    _DOCUMENT_KERNELS.set(documents, (key, kernel))
    return kernel


def upipe_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """Attention function registered as "upipe" (transformers' AttentionInterface signature).

    Args:
        module: the model's attention module (`is_causal`, `config`, `layer_idx` are read).
        query: [B, H, s, D] this rank's tokens, RoPE applied; key/value: [B, Hk, s, D] (GQA not expanded).
        attention_mask: what `upipe_mask` returned.
        scaling: softmax scale; sliding_window: the model's window, if any.
        **kwargs: transformers' kwargs; `position_ids` [B or 1, s] (global, or per document with
            `upipe_cu_seqlens` / `upipe_max_seqlen` for packed rows) is required under SP.

    Returns:
        (attn_output [B, s, H, D], None)
    """
    state = _active_state()
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    check_call(module, dropout, kwargs)
    _check_kv_length(query, key)
    if isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"attn_implementation='upipe' got a prepared {attention_mask.dim()}-D attention mask tensor under "
            "sequence parallelism; pass a 2-D padding mask (right padding) or none."
        )
    B, _, s, _ = query.shape
    kernel = state.kernel
    if not is_fake(query):  # fake tensors (memory simulation) carry no values to check (nor documents to split)
        validate_layout(state, kwargs.get("position_ids"), attention_mask, B, s, query.device,
                        kwargs.get("upipe_cu_seqlens"))
        kernel = sp_kernel(state, kwargs, query.device, query.dtype, s * state.sp_size)
    sliding_window_check(sliding_window, s * state.sp_size)
    out = upipe_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [B, s, H|Hk, D] views
        group=state.sp_group, heads_per_chunk=state.heads_per_chunk, kernel=kernel, scale=scaling,
    )
    return out, None  # [B, s, H, D]


def register() -> None:
    """Make `attn_implementation="upipe"` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, upipe_attention_forward)
    AttentionMaskInterface.register(NAME, upipe_mask)


register()  # importing this module registers "upipe" (hf_upipe.registration imports it once transformers loads)
