"""Probes of transformers' mask functions: does a model's mask function agree with causal masking (inside
documents, a window, chunks or ring segments)? Mask functions are elementwise, so a grid of positions is enough
to tell a plain causal mask from a window shorter than the shard or a custom mask.

Entry points:
- `mask_agrees(mask_function, b, q_idx, kv_idx, expected)`: the mask function at index pairs of row b, against
  `expected`.
- `agrees_with_causal(mask_function, length, batch_size, window=None, chunk=None)`: causal (within a window or
  chunks) on a grid of local positions (`hf_upipe.integrations.sp_mask`).
- `agrees_with_ring_segments(mask_function, state, length, batch_size)`: causal inside the runs of consecutive
  ring positions of this shard.
- `agrees_with_documents(mask_function, doc)`: causal inside the local documents (the layout check).
"""

from __future__ import annotations

import torch

from hf_upipe.ops.ring import ring_positions

__all__ = [
    "agrees_with_causal",
    "agrees_with_documents",
    "agrees_with_ring_segments",
    "mask_agrees",
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
