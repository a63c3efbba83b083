"""`attn_implementation="upipe"` for transformers: the attention function and its mask function.

Entry points:
- `register()`: adds "upipe" to transformers' `AttentionInterface` and `AttentionMaskInterface` (idempotent;
  `import hf_upipe` calls it).
- `upipe_attention_forward(module, query, key, value, attention_mask, ...)`: the registered attention function.
- `upipe_mask(...)`: the registered mask function; `SequenceParallelMask`: what it returns under SP.

The flow, with sequence parallelism initialised (`hf_upipe.init_sequence_parallel`, group of P > 1 ranks):
1. each rank calls the model on its contiguous shard input_ids [B, s] with GLOBAL position_ids
   (rank r: r*s .. r*s+s-1), so RoPE is applied with global positions before attention;
2. `upipe_mask` does not build an O(S^2) mask: it passes on the 2-D padding mask (if any) and whether the
   model asked for plain causal masking, as a `SequenceParallelMask`;
3. `upipe_attention_forward` checks, with one tiny all-gather that every rank enters, that the ranks agree on
   the layout (equal shard lengths, global consecutive position_ids, no packing, padding only at the end of each
   row), so a bad batch raises the same error on every rank before any all-to-all; then it runs
   `hf_upipe.ops.upipe_attention` on the shard.
Without SP (never initialised, or a group of one rank) "upipe" is exactly transformers' "sdpa": same mask, same
kernel, padding, packing and generation with a KV cache included.

Under SP, trailing (right) padding is accepted: causal attention never lets a real token see a later pad, so
real tokens are exact; outputs at padded positions are not meaningful and their labels must be ignored (-100).
Left or interior padding, packed rows, sliding windows shorter than the sequence, dropout, softcap, attention
sinks and KV caches with past tokens raise errors naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from hf_upipe.distributed import SequenceParallelState, get_sequence_parallel_state
from hf_upipe.ops.upipe_attention import upipe_attention
from hf_upipe.planning.simulate import is_fake

__all__ = ["SequenceParallelMask", "register", "upipe_attention_forward", "upipe_mask"]

NAME = "upipe"


@dataclass(frozen=True)
class SequenceParallelMask:
    """What the attention function needs to know about masking under SP (instead of an O(S^2) mask).

    Attributes:
        padding: [B, s] bool, True for real tokens of this rank's shard; None when nothing is padded.
        plain_causal: False when the model asked for more than causal masking (packed-sequence, sliding-window
            or custom mask functions), which the SP path does not implement.
    """

    padding: torch.Tensor | None
    plain_causal: bool


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
    if padding is not None and not is_fake(padding) and bool(padding.all()):
        padding = None
    plain = mask_function is causal_mask_function or _agrees_with_causal(mask_function, q_length, batch_size)
    return SequenceParallelMask(padding=padding, plain_causal=plain)


def _agrees_with_causal(mask_function, length: int, batch_size: int) -> bool:
    """Probe a model's mask function on a grid of local (query, key) positions against plain causal masking.

    A sliding window at least as long as the shard passes here (the attention function then checks the window
    against the full sequence); packed-sequence, chunked, bidirectional-block and windows shorter than the shard
    fail. Mask functions are vectorised over index tensors, as `sdpa_mask` calls them.
    """
    points = torch.tensor(sorted({0, 1, length // 2, length - 1} & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    for b in range(batch_size):
        try:
            got = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, kv_idx)
        except (IndexError, RuntimeError, TypeError):  # a mask function that cannot be probed: not plain causal
            return False
        if not torch.equal(torch.as_tensor(got).bool().expand_as(q_idx), q_idx >= kv_idx):
            return False
    return True


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[n] on every rank -> [P, n] (a small int64 vector; gloo wants a flat output buffer)."""
    P = dist.get_world_size(group)
    out = torch.empty(P * t.numel(), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 renames it
    gather(out, t.contiguous(), group=group)
    return out.view(P, t.numel())


def _layout_summary(state, position_ids, mask, batch, local_len, device) -> torch.Tensor:
    """This rank's facts as int64 [8]: s, B, plain causal, global positions ok, padding ok locally, any pad,
    all pads (every row all padding)."""
    r, s = state.sp_rank, local_len
    pos_ok = position_ids is not None and position_ids.shape[-1] == s
    if pos_ok:
        expected = torch.arange(r * s, (r + 1) * s, device=position_ids.device)
        pos_ok = bool((position_ids == expected).all())
    plain = mask is None or mask.plain_causal
    pad = None if mask is None else mask.padding
    if pad is None:
        form_ok, any_pad, all_pad = True, False, False
    else:
        # ones-then-zeros in every row: once a row has a zero, it stays zero
        form_ok = bool((pad.int().cummin(dim=-1).values == pad.int()).all())
        any_pad, all_pad = bool((~pad).any()), bool((~pad).all())
    return torch.tensor([s, batch, plain, pos_ok, form_ok, any_pad, all_pad, 0], dtype=torch.long, device=device)


def _check_layout(state, position_ids, mask, batch, local_len, device) -> None:
    """Validate the global layout with one all-gather every rank enters; raise the same error on every rank."""
    mine = _layout_summary(state, position_ids, mask, batch, local_len, device)
    every = _all_gather(mine, state.sp_group)  # [P, 8]
    s, B, plain, pos_ok, form_ok, any_pad, all_pad, _ = every.t().tolist()
    if len(set(s)) > 1 or len(set(B)) > 1:
        raise ValueError(
            f"Sequence-parallel ranks got different shard shapes: local lengths {s}, batch sizes {B}. Every rank "
            "of an SP group must get the same rows, cut into equal contiguous shards (pad the sequence to a "
            f"multiple of sp_size={state.sp_size} with ignored labels)."
        )
    if not all(plain):
        raise NotImplementedError(
            "The model asked for a mask other than plain causal (packed sequences, a sliding window or a custom "
            "mask), which attn_implementation='upipe' does not implement under sequence parallelism."
        )
    if not all(pos_ok):
        bad = [i for i, ok in enumerate(pos_ok) if not ok]
        raise ValueError(
            f"position_ids on SP ranks {bad} are not the global positions of their shard (rank r must pass "
            f"r*{s[0]} .. r*{s[0]}+{s[0] - 1}). Pass position_ids=torch.arange(S)[r*s:(r+1)*s] with each shard; "
            "per-shard positions starting at 0 break RoPE and causality, and packed rows (positions restarting) "
            "are not supported by this path."
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


def _check_static(module, dropout, kwargs) -> None:
    """Checks that need no communication (identical on every rank: same model, same arguments)."""
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("attn_implementation='upipe' supports causal (decoder) attention only.")
    if dropout and dropout > 0.0:
        raise NotImplementedError(
            f"attention dropout={dropout} is not supported by sequence-parallel 'upipe' attention: set the model "
            "config's attention_dropout=0.0."
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


def upipe_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """Attention function registered as "upipe" (transformers' AttentionInterface signature).

    Args:
        module: the model's attention module (`is_causal`, `config`, `layer_idx` are read).
        query: [B, H, s, D] this rank's tokens, RoPE applied; key/value: [B, Hk, s, D] (GQA not expanded).
        attention_mask: what `upipe_mask` returned.
        scaling: softmax scale; sliding_window: the model's window, if any.
        **kwargs: transformers' kwargs; `position_ids` [B or 1, s] (global) is required under SP.

    Returns:
        (attn_output [B, s, H, D], None)
    """
    state = _active_state()
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    _check_static(module, dropout, kwargs)
    _check_kv_length(query, key)
    if isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"attn_implementation='upipe' got a prepared {attention_mask.dim()}-D attention mask tensor under "
            "sequence parallelism; pass a 2-D padding mask (right padding) or none."
        )
    B, _, s, _ = query.shape
    if not is_fake(query):  # fake tensors (memory simulation) carry no values to check
        _check_layout(state, kwargs.get("position_ids"), attention_mask, B, s, query.device)
    sliding_window_check(sliding_window, s * state.sp_size)
    out = upipe_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # [B, s, H|Hk, D] views
        group=state.sp_group, heads_per_chunk=state.heads_per_chunk, kernel=state.kernel, scale=scaling,
    )
    return out, None  # [B, s, H, D]


def register() -> None:
    """Make `attn_implementation="upipe"` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, upipe_attention_forward)
    AttentionMaskInterface.register(NAME, upipe_mask)
