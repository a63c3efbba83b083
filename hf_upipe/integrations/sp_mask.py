"""The mask function registered for "upipe": under sequence parallelism a description of the mask
(`SequenceParallelMask`) instead of an O(S^2) tensor.

Entry points:
- `upipe_mask(batch_size, q_length, kv_length, ...)`: transformers' `sdpa_mask` without SP; under SP the padding
  mask, whether the model asked for plain causal masking (its mask function probed on a grid of positions
  against causal masking by `hf_upipe.integrations.mask_probe`, within a window or chunks when transformers
  passes a `local_size`), the window or chunk, as a `SequenceParallelMask`. It runs once per forward with the
  model's config: the support gate checks the model there, before any collective.
- `SequenceParallelMask`: what the attention function reads of the mask; model code that computes with it as a
  tensor is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

from hf_upipe.integrations.chunked import local_pattern
from hf_upipe.integrations.mask_probe import agrees_with_causal, agrees_with_ring_segments
from hf_upipe.integrations.sp_checks import active_state, check_model
from hf_upipe.ops.fake import is_fake, simulating

__all__ = ["SequenceParallelMask", "upipe_mask"]


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
        window: the sliding window of the mask (transformers' `local_size`: key t seen by query i when
            0 <= i - t < window) when it is shorter than the full sequence; `plain_causal` then means causal within
            that window (the mask function was probed against it).
        chunk: chunked attention (Llama 4: key t seen by query i when t <= i in the same `chunk`-token block of
            the row), told from a window by `hf_upipe.integrations.chunked.local_pattern`.
        mask_given: the model got a 2-D attention_mask (transformers then never looks for packed documents in
            position_ids, so a plain causal mask says nothing about the model's handling of them).
    """

    padding: torch.Tensor | None
    plain_causal: bool
    mask_function: Callable | None = field(default=None, compare=False, repr=False)
    window: int | None = None
    chunk: int | None = None
    mask_given: bool = False

    def __getattr__(self, name: str):
        # model code that treats the mask as a tensor (its own mask arithmetic: `.dtype`, `.shape`, ...) would run
        # on a mask that is not there: a clear refusal (an AttributeError too, so `hasattr` stays False)
        if name.startswith("__"):
            raise AttributeError(name)
        raise _MaskUsedAsTensor(
            f"the model reads attention_mask.{name}: it computes with the mask itself (its own masking code), but "
            "under sequence parallelism 'upipe' hands the layers a description of the mask, not an [S, S] tensor. "
            "This model is not supported under sequence parallelism."
        )


class _MaskUsedAsTensor(AttributeError, NotImplementedError):
    """Model code used the SP mask as a tensor (both an AttributeError and a NotImplementedError)."""


def upipe_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """Mask function registered for "upipe": `sdpa_mask` without SP, a `SequenceParallelMask` with SP.

    It runs once per forward, before any layer, with the model's config: the support gate checks it here (the same
    verdict on every rank, before any collective or token mixing)."""
    state = active_state()
    if state is None:
        check_model(kwargs.get("config"), None)
        return sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    check_model(kwargs.get("config"), state, q_length * state.sp_size)
    padding = attention_mask
    # a fake mask (memory simulation) carries no values: simulations model unpadded batches
    if padding is not None and (is_fake(padding) or bool(padding.all())):
        padding = None
    local_size = kwargs.get(
        "local_size"
    )  # the size of transformers' sliding-window and chunked masks
    window = chunk = None
    if (
        simulating()
    ):  # fake tensors (the planner): no values to probe; a window's and a chunk's kernels and the
        # layout check are not run on fake tensors either, and neither changes the buffers of the attention
        window = (
            local_size
            if isinstance(local_size, int) and 0 < local_size < q_length * state.sp_size
            else None
        )
        return SequenceParallelMask(
            padding=padding, plain_causal=True, window=window, mask_given=attention_mask is not None
        )
    if isinstance(local_size, int) and 0 < local_size < q_length * state.sp_size:
        pattern = local_pattern(mask_function, batch_size, local_size, q_length * state.sp_size)
        chunk, window = (local_size, None) if pattern == "chunk" else (None, local_size)
    plain = mask_function is causal_mask_function or agrees_with_causal(
        mask_function, q_length, batch_size, window, chunk
    )
    if not plain and state.ring_size > 1 and window is None and chunk is None:
        # ring order jumps inside a shard, which transformers takes for packed documents: causal within those
        # segments is plain causal here (the layout check refuses positions other than the ring's)
        plain = agrees_with_ring_segments(mask_function, state, q_length, batch_size)
    return SequenceParallelMask(
        padding=padding,
        plain_causal=plain,
        mask_function=None if plain else mask_function,
        window=window,
        chunk=chunk,
        mask_given=attention_mask is not None,
    )
