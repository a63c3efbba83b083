"""Where generation's tokens live under sequence parallelism: each rank's KV cache and which rank caches what.

Entry points:
- `ShardKVCache`: one rank's cache, allocated once at its final size (keys and values of all layers and heads, for
  the tokens this rank holds, with their global positions); `hf_upipe.generate` fills it (re-exported by
  `hf_upipe.generation`).
- `token_schedule(L, state, max_new_tokens)`: how many prompt tokens each rank of the SP group holds, the rank holding
  the last prompt token, and the rank caching each fed-back new token (the fewest cached tokens; ties: the lowest
  rank), computed alike on every rank without communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_upipe.ops.ring import ring_positions

__all__ = ["ShardKVCache", "token_schedule"]


@dataclass
class ShardKVCache:
    """One rank's KV cache, allocated once at its final size: the global positions [capacity] of the rank's prompt
    tokens and of the new tokens it will hold (ascending; the first `tokens` filled), and per layer keys
    [Hk, capacity - first, D] and values [Hk, capacity - first, Dv] of those from index `first[layer]` on: a layer
    with a sliding window of W does not keep the prompt tokens that no new token sees (positions <= L - W).
    `key(layer)`, `value(layer)` and `layer_positions(layer)` are views of the filled part."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    tokens: int = 0
    first: dict[int, int] = field(default_factory=dict)  # per layer: its first kept token
    # per layer: the prefill mask's window
    windows: dict[int, int | None] = field(default_factory=dict)

    def start(self, positions: torch.Tensor, capacity: int) -> None:
        """Hold the prompt tokens at global `positions` [n] (ascending; their keys come per layer: `fill`), room
        for `capacity` tokens in all."""
        self.positions = positions.new_zeros(capacity)
        self.positions[: len(positions)] = positions
        self.tokens = len(positions)

    def fill(self, layer: int, key: torch.Tensor, value: torch.Tensor, first: int = 0) -> None:
        """The prompt tokens' key [Hk, n, D] and value [Hk, n, Dv] of `layer`, copied into its buffers from token
        `first` on."""
        size, kept = len(self.positions) - first, key.shape[1] - first
        self.first[layer] = first
        self.keys[layer] = key.new_empty(key.shape[0], size, key.shape[2])
        self.values[layer] = value.new_empty(value.shape[0], size, value.shape[2])
        self.keys[layer][:, :kept] = key[:, first:]
        self.values[layer][:, :kept] = value[:, first:]

    def append_position(self, position: int) -> None:
        """A new token at global `position` (its keys come per layer: `put`)."""
        self.positions[self.tokens] = position
        self.tokens += 1

    def put(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The newest token's key [Hk, D] and value [Hk, Dv] of `layer`."""
        self.keys[layer][:, self.tokens - 1 - self.first[layer]] = key
        self.values[layer][:, self.tokens - 1 - self.first[layer]] = value

    def key(self, layer: int) -> torch.Tensor:
        return self.keys[layer][:, : self.tokens - self.first[layer]]  # [Hk, n, D]

    def value(self, layer: int) -> torch.Tensor:
        return self.values[layer][:, : self.tokens - self.first[layer]]  # [Hk, n, Dv]

    def layer_positions(self, layer: int) -> torch.Tensor:
        return self.positions[self.first[layer] : self.tokens]  # [n]

    def copy_from(self, other: ShardKVCache) -> None:
        """Become an independent copy of `other` (a row's cache shared by its num_return_sequences draws)."""
        self.keys = {layer: t.clone() for layer, t in other.keys.items()}
        self.values = {layer: t.clone() for layer, t in other.values.items()}
        self.positions = other.positions.clone()
        self.tokens, self.first, self.windows = other.tokens, dict(other.first), dict(other.windows)

    def numel(self) -> int:
        """Elements of the filled keys and values (all layers)."""
        return sum(self.key(i).numel() + self.value(i).numel() for i in self.keys)

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (all layers, the whole capacity)."""
        return sum(
            t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values())
        )


def token_schedule(L: int, state, max_new_tokens: int) -> tuple[list, int, list]:
    """Where the tokens live, computed alike on every rank without communication: the prompt tokens each rank
    holds (the shards `hf_upipe.shard_batch` cuts from a prompt of L tokens, without their padded tail), the rank
    holding the last prompt token, and the rank caching each fed-back new token (the fewest cached tokens; ties:
    the lowest rank)."""
    P, R = state.sp_size, state.ring_size
    multiple = P * (2 if R > 1 else 1)  # shard_batch pads to this (a ring cuts 2R chunks)
    s = -(-L // multiple) * multiple // P  # tokens per shard, padding included
    counts, last = [], None
    for rank in range(P):
        positions = ring_positions(rank, s, P, R)  # [s] global positions of the rank's tokens
        counts.append(int((positions < L).sum()))
        last = rank if bool((positions == L - 1).any()) else last
    held, owners = list(counts), []
    for _ in range(max_new_tokens - 1):  # the last generated token is not fed back
        owners.append(min(range(P), key=lambda r: (held[r], r)))
        held[owners[-1]] += 1
    return counts, last, owners
