"""The mask function registered for "upipe": under sequence parallelism a description of the mask
(`SequenceParallelMask`) instead of an O(S^2) tensor.

Entry points:
- `upipe_mask(batch_size, q_length, kv_length, ...)`: transformers' `sdpa_mask` without SP; under SP the padding
  mask, whether the model asked for plain causal masking (its mask function probed on a grid of positions
  against causal masking by `hf_upipe.attention.mask`, within a window or chunks when transformers
  passes a `local_size`), the window or chunk, as a `SequenceParallelMask`. It runs once per forward with the
  model's config: the support gate checks the model there, before any collective.
- `SequenceParallelMask`: what the attention function reads of the mask; model code that computes with it as a
  tensor is refused.

Probes of transformers' mask functions: does a model's mask function agree with causal masking (inside
documents, a window, chunks or ring segments)? Mask functions are elementwise, so a grid of positions is enough
to tell a plain causal mask from a window shorter than the shard or a custom mask.

Entry points:
- `mask_agrees(mask_function, b, q_idx, kv_idx, expected)`: the mask function at index pairs of row b, against
  `expected`.
- `agrees_with_causal(mask_function, length, batch_size, window=None, chunk=None)`: causal (within a window or
  chunks) on a grid of local positions (`hf_upipe.attention.mask`).
- `agrees_with_ring_segments(mask_function, state, length, batch_size)`: causal inside the runs of consecutive
  ring positions of this shard.
- `agrees_with_documents(mask_function, doc)`: causal inside the local documents (the layout check).

Local attention patterns of transformers' masks under SP: a sliding window or chunked attention (Llama 4).

Entry points:
- `local_pattern(mask_function, batch_size, size, seq_len)`: transformers passes both a sliding-window and a chunked
  mask's size as `local_size`; which one this mask function is ("window": key t seen by query i when
  0 <= i - t < size; "chunk": when t <= i and t // size == i // size), probed at GLOBAL indices around multiples
  of `size` (a shard's local indices cannot tell them apart when the size exceeds the shard), or None (neither).
- `chunk_kernel(kernel, chunk, batch, seq_len, device, dtype)`: the kernel run inside each chunk of every row:
  `hf_upipe.ops.documents.DocumentKernel` over chunk boundaries, exactly as over packed documents (after the
  all-to-all each rank holds its heads over the whole sequence, so chunks are a property of the kernel only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

from hf_upipe.attention.state import active_state, check_model
from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.fake import is_fake, simulating
from hf_upipe.ops.kernels import get_kernel
from hf_upipe.ops.ring import ring_positions

__all__ = [
    "SequenceParallelMask",
    "agrees_with_causal",
    "agrees_with_documents",
    "agrees_with_ring_segments",
    "chunk_kernel",
    "local_pattern",
    "mask_agrees",
    "upipe_mask",
]


def mask_agrees(
    mask_function, b: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, expected: torch.Tensor
) -> bool:
    """Whether the vectorised mask function equals `expected` at the (q_idx, kv_idx) pairs [n] of row b."""
    try:
        got = mask_function(torch.full_like(q_idx, b), torch.zeros_like(q_idx), q_idx, kv_idx)
    except (
        IndexError,
        RuntimeError,
        TypeError,
    ):  # a mask function that cannot be probed: no agreement
        return False
    return torch.equal(
        torch.as_tensor(got, device=expected.device).bool().expand_as(expected), expected
    )


def agrees_with_documents(mask_function, doc: torch.Tensor, max_points: int = 24) -> bool:
    """Probe a mask function against causal masking inside the local documents `doc` [B, s] (document ids).

    Points: the plain grid {0, 1, s/2, s-1} plus, per row, the local document starts and the tokens just before
    them (at most `max_points` starts, evenly spaced), so the packed mask transformers builds from the local
    position_ids passes and windows shorter than the shard or custom masks still fail.
    """
    B, s = doc.shape
    doc = doc.cpu()  # [B, s]
    for b in range(B):
        row = doc[b]
        starts = (
            torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        ).tolist()  # local document starts
        if len(starts) > max_points:
            starts = [starts[i * len(starts) // max_points] for i in range(max_points)]
        points = torch.tensor(
            sorted(({0, 1, s // 2, s - 1} | set(starts) | {a - 1 for a in starts}) & set(range(s)))
        )
        q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
        expected = (q_idx >= kv_idx) & (row[q_idx] == row[kv_idx])  # [n]
        if not mask_agrees(mask_function, b, q_idx, kv_idx, expected):
            return False
    return True


def agrees_with_causal(
    mask_function, length: int, batch_size: int, window: int | None = None, chunk: int | None = None
) -> bool:
    """Probe a model's mask function on a grid of local (query, key) positions against plain causal masking (within
    `window` keys when given: 0 <= q - k < window; inside `chunk`-token chunks when given).

    The grid is {0, 1, s/2, s-1} and, with a window, the distances around it: a window shorter than the shard or a
    custom mask fails the probe (mask functions are elementwise, so a grid is enough to tell these apart).
    """
    grid = {0, 1, length // 2, length - 1}
    for size in (window, chunk):
        if size is not None:
            grid |= {size - 1, size, size + 1, length - 1 - size, length - size}
    points = torch.tensor(sorted(grid & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    expected = q_idx >= kv_idx
    if window is not None:
        expected &= q_idx - kv_idx < window
    if chunk is not None:
        expected &= q_idx // chunk == kv_idx // chunk
    return all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size))


def agrees_with_ring_segments(mask_function, state, length: int, batch_size: int) -> bool:
    """Probe a mask function against causal masking inside the runs of consecutive ring positions of this shard
    (`ring_positions`), on the grid {0, 1, s/2, s-1} plus each run's start and the token before it."""
    positions = ring_positions(state.sp_rank, length, state.sp_size, state.ring_size)  # [s]
    starts = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    segment = torch.zeros(length, dtype=torch.long)
    segment[starts] = 1
    segment = segment.cumsum(0)  # [s] run index
    grid = {0, 1, length // 2, length - 1} | set(starts) | {p - 1 for p in starts}
    points = torch.tensor(sorted(grid & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    expected = (q_idx >= kv_idx) & (segment[q_idx] == segment[kv_idx])
    return all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size))


def local_pattern(mask_function, batch_size: int, size: int, seq_len: int) -> str | None:
    """See the module docstring. The probes: pairs (q, k) around the first boundaries, where the two patterns
    differ (q = size, k = size - 1: a window sees it, a chunk does not) and agree (both causal inside)."""
    edges = [e for e in (size, 2 * size) if e < seq_len]
    points = sorted(
        {
            p
            for e in edges
            for p in (0, 1, e - 1, e, e + 1, min(seq_len - 1, e + size - 1))
            if 0 <= p < seq_len
        }
    )
    if not edges:
        return None
    grid = torch.tensor(points)
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(grid, grid, indexing="ij"))
    causal = q_idx >= kv_idx
    patterns = {
        "window": causal & (q_idx - kv_idx < size),
        "chunk": causal & (q_idx // size == kv_idx // size),
    }
    for name, expected in patterns.items():
        if all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size)):
            return name
    return None


def chunk_kernel(kernel, chunk: int, batch: int, seq_len: int, device, dtype):
    """`kernel` (a name or a kernel) inside each `chunk`-token block of every row of `batch` rows of `seq_len`."""
    inner = get_kernel(kernel, device, dtype) if isinstance(kernel, str) else kernel
    cuts = sorted(
        {r * seq_len + c for r in range(batch) for c in range(0, seq_len, chunk)}
        | {batch * seq_len}
    )
    return DocumentKernel(
        inner, torch.tensor(cuts, dtype=torch.int32, device=device), seq_len, min(chunk, seq_len)
    )


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
            the row), told from a window by `hf_upipe.attention.mask.local_pattern`.
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
