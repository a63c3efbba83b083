"""What the mixers of `hf_upipe.adapters.mixers` and `hf_upipe.adapters.delta_rule` exchange across
shards, and how a checkpoint's recompute finds what its forward received.

Entry points:
- `Halo` (autograd Function): x [B, s, Dm] (or [B, C, s] along `dim`) -> the previous rank's last k-1 tokens in
  front, every rank at once; the backward sends the front's gradient back.
- `Kept`: what a recompute of one forward needs (received tensors), held by a node of that forward's graph.
- `call_key()`: a key drawn from torch's random generator, the same in a checkpointed forward and its recompute;
  `may_recompute()`: whether this forward runs inside a (non-reentrant) checkpoint.
- `stash(module, key, kept)` / `stashed(module, key)`: record `kept` weakly on the module, find it again.
- `ShardCache`: the cache a mixer reads on one shard; `NoPastCache`: what every shard cache answers about recorded
  past.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from hf_upipe.ops.fake import simulating

__all__ = [
    "Halo",
    "Kept",
    "NoPastCache",
    "ShardCache",
    "call_key",
    "may_recompute",
    "stash",
    "stashed",
]


class Kept:
    """What a recompute of one forward needs, detached: `tensors` (the received halo and state; or the gathered
    states) and `halo` (the halo `Halo` received). Held by a node of that forward's graph (`_Receive` in
    `hf_upipe.adapters.mixers`, `_GatherStates` in `hf_upipe.adapters.delta_rule`), so it lives exactly as
    long as the graph; the mixer's stash holds it weakly."""

    __slots__ = ("tensors", "halo", "__weakref__")

    def __init__(self):
        self.tensors = self.halo = None


class Halo(torch.autograd.Function):
    """x [B, s, Dm] -> [B, k-1+s, Dm] (or on another axis `dim`, e.g. a convolution's input [B, C, s] -> [B, C,
    k-1+s]): the previous rank's last k-1 tokens in front (rank 0: x unchanged). Every rank sends its own last k-1
    tokens to the next rank at the same time. Backward: the front's gradient goes back to the previous rank, and the
    gradient received from the next rank is added to the last k-1 tokens'. `kept`: a `Kept` whose `halo` takes
    the received tokens (for a recompute), or None."""

    @staticmethod
    def forward(ctx, x, group, rank, ranks, reach, dim=1, kept=None):
        dim = dim % x.dim()
        ctx.group, ctx.rank, ctx.ranks, ctx.reach, ctx.dim = group, rank, ranks, reach, dim
        s = x.shape[dim]
        halo = x.new_empty(*x.shape[:dim], reach, *x.shape[dim + 1 :]) if rank > 0 else None
        works = (
            [dist.isend(x.narrow(dim, s - reach, reach).contiguous(), ranks[rank + 1], group=group)]
            if rank + 1 < len(ranks)
            else []
        )
        if halo is not None:
            works.append(dist.irecv(halo, ranks[rank - 1], group=group))
        for work in works:
            work.wait()
        if kept is not None:
            kept.halo = halo
        return (
            torch.cat([halo, x], dim=dim) if halo is not None else x.clone()
        )  # k-1+s (rank 0: s) along dim

    @staticmethod
    def backward(ctx, grad):
        rank, ranks, reach, group, dim = ctx.rank, ctx.ranks, ctx.reach, ctx.group, ctx.dim
        s = grad.shape[dim] - (reach if rank > 0 else 0)
        dx = grad.narrow(dim, grad.shape[dim] - s, s).contiguous().clone()  # x's shape
        works, d_tail = [], None
        if rank > 0:
            works.append(
                dist.isend(grad.narrow(dim, 0, reach).contiguous(), ranks[rank - 1], group=group)
            )
        if rank + 1 < len(ranks):
            d_tail = dx.new_empty(*dx.shape[:dim], reach, *dx.shape[dim + 1 :])
            works.append(dist.irecv(d_tail, ranks[rank + 1], group=group))
        for work in works:
            work.wait()
        if d_tail is not None:
            dx.narrow(dim, s - reach, reach).add_(d_tail)
        return dx, None, None, None, None, None, None


def stash(module, key: int, kept: Kept) -> Kept:
    """Record `kept` under `key` for this call's recompute, weakly (it lives as long as the forward's graph)."""
    table = module.__dict__.setdefault("_upipe_stash", {})
    for k in [k for k, ref in table.items() if ref() is None]:
        del table[k]
    table[key] = weakref.ref(kept)
    return kept


def stashed(module, key: int) -> Kept:
    """What the forward that drew `key` received (its recompute draws the same key)."""
    ref = module.__dict__.get("_upipe_stash", {}).get(key)
    kept = ref() if ref is not None else None
    if kept is None:
        raise RuntimeError(
            f"{type(module).__name__}: a recompute found no state received by its forward: the "
            "checkpoint does not restore the random state (keep preserve_rng_state=True, its default)."
        )
    return kept


def may_recompute() -> bool:
    """Whether saved-tensor hooks are active, as inside a (non-reentrant) activation checkpoint's forward, whose
    recompute will need what this call received (plain forwards keep no stash). Unknown: True."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def call_key() -> int:
    """A number drawn from torch's CPU generator. Activation checkpointing restores that generator's state before
    it recomputes a forward (preserve_rng_state, its default), so the recompute draws the same number: an exact key
    from a checkpointed forward to its recompute, distinct between forwards, whatever their inputs."""
    if (
        simulating()
    ):  # a memory simulation: fake tensors have no values to read (and nothing is recomputed twice)
        return 0
    return int(torch.randint(0, 2**62, (1,)).item())


class NoPastCache:
    """What a shard's cache answers to transformers' questions about recorded past (speculative decoding's): it
    records none, so it keeps no intermediate state. The shard caches below inherit these answers."""

    def is_recording_past(self, layer_idx):
        return False

    def get_recurrent_states_to_keep(self, layer_idx=None):
        """0, as a transformers cache that records no past answers (asked from transformers 5.25 on)."""
        return 0


class ShardCache(NoPastCache):
    """The cache a mixer reads: the previous rank's halo (conv state) and final state; it records this shard's."""

    def __init__(self, halo, state):
        self.halo, self.state, self.tail, self.final = halo, state, None, None

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.halo

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.state

    def update_conv_state(self, x, layer_idx, conv_kernel_size=None, **kwargs):
        """x [B, C, s] the convolution's input -> [B, C, k-1+s] with the halo in front (rank 0: x, which the
        convolution pads itself); records this shard's tail [B, C, k-1], a copy, so x need not outlive the call."""
        k = conv_kernel_size
        self.tail = x[..., x.shape[-1] - (k - 1) :].clone()
        return torch.cat([self.halo.to(x.dtype), x], dim=-1) if self.halo is not None else x

    def update_recurrent_state(self, state, layer_idx, **kwargs):
        self.final = state
