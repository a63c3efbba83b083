"""Delta-rule mixers (gated DeltaNet, Kimi delta attention) across shards with every rank at once: state passing
by a prefix over ranks instead of a chain.

Entry points (used by `hf_upipe.adapters.mixers.sharded_mixer_forward`):
- `DELTA_KERNELS`: mixer class -> the name of the chunked kernel its forward calls (a global of its modeling module,
  transformers' torch fallback or the FLA kernel behind it); the classes run here.
- `parallel_delta_forward(module, hidden_states, attention_mask, kwargs, group, rank, ranks, recompute)`: the
  module's own forward on this rank's shard, exact across shards.

Why it works. The delta rule's state S [d_k, d_v] per head evolves as S_t = A_t S_{t-1} + k_t (beta_t v_t)^T with
A_t [d_k, d_k] built from k_t, beta_t and the decay, and reads o_t = S_t^T q_t (the kernel's chunked form computes
the same). Both are linear in (initial state, v) jointly, and the value columns never mix. So one kernel call on
this shard with the value widened by d_k zero columns and the initial state [0 | I] gives, side by side:
  o_ext [B, s, H, d_v + d_k] = [ o(0, v) | X ],   final [B, H, d_k, d_v + d_k] = [ F | M ],
where o(0, v) is the shard's output from a zero state, X [B, s, H, d_k] is what each token reads of an initial
state (o = o(0, v) + X @ S_in), F the final state from zero and M [d_k, d_k] the shard's transition
(F_out = M @ S_in + F). The ranks all-gather their [F | M] (no sequence axis), each takes the prefix over the ranks
before it, S_in(r) = M_{r-1} (... (M_0 0 + F_0) ...) + F_{r-1}, and corrects its output by X @ S_in(r) [d_k -> d_v]
before the module's gated norm. Autograd carries the gradients: the all-gather's backward sums every rank's
gradient of the gathered states (an all-reduce) and hands each rank its own slice.

The causal convolution before the kernel needs the previous rank's last k-1 convolution inputs; every rank sends
its own to the next at the same moment (`hf_upipe.adapters.shard_exchange.Halo`, on the channel axis). Under
activation checkpointing the recompute inside the backward reuses what the forward received (halo and gathered
states, found by the key both draw) and does not communicate, as for the other mixers.

Cost per layer and rank: one kernel call with d_v + d_k value columns instead of d_v (for Qwen3-Next, d_k = d_v:
the value-side work and activations of the kernel double, the key side is unchanged), an all-gather of P states
[B, H, d_k, d_v + d_k] fp32 forward and an all-reduce of as many backward, the halo [B, conv channels, k-1] each
way; nothing grows with the sequence but the kernel's widened value.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.distributed as dist

from hf_upipe.adapters.shard_exchange import Halo, NoPastCache

__all__ = ["DELTA_KERNELS", "parallel_delta_forward"]

# mixer class -> the kernel its forward calls for a prefill (transformers 5.23; its forward is fingerprinted)
DELTA_KERNELS = {
    "Qwen3NextGatedDeltaNet": "torch_chunk_gated_delta_rule",
    "Qwen3_5GatedDeltaNet": "torch_chunk_gated_delta_rule",
    "Qwen3_5MoeGatedDeltaNet": "torch_chunk_gated_delta_rule",
    "Qwen4ExpTextGatedDeltaNet": "torch_chunk_gated_delta_rule",
    "OlmoHybridGatedDeltaNet": "torch_chunk_gated_delta_rule",
    "BailingHybridDeltaAttention": "chunk_kimi_delta_attention",
}


class _GatherStates(torch.autograd.Function):
    """final [B, H, d_k, n] (this rank's) -> [P, B, H, d_k, n] (every rank's, in rank order). Backward: the sum over
    ranks of the gradient of the gathered states, this rank's slice. `kept`: a `Kept` to hold them for a recompute
    (held by this node, so it lives as long as the forward's graph), or None."""

    @staticmethod
    def forward(ctx, final, group, rank, kept):
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(final) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, final.contiguous(), group=group)
        gathered = torch.stack(parts)  # [P, B, H, d_k, n]
        if kept is not None:
            kept.tensors, ctx.kept = gathered.detach(), kept
        return gathered

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _DeltaCache(NoPastCache):
    """The cache the module reads on this shard: no convolution state and no recurrent state (the kernel wrapper
    corrects for the latter); the convolution's input gets the previous rank's halo in front."""

    def __init__(self, group, rank, ranks, kept, recompute):
        self.group, self.rank, self.ranks, self.kept, self.recompute = (
            group,
            rank,
            ranks,
            kept,
            recompute,
        )

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return None

    def update_conv_state(self, x, layer_idx, conv_kernel_size=None, **kwargs):
        """x [B, C, s] the convolution's input -> [B, C, k-1+s] (rank 0: [B, C, s]; the convolution pads it)."""
        reach = conv_kernel_size - 1
        if self.recompute:  # what the forward received, no communication
            halo = self.kept.halo
            return torch.cat([halo.to(x.dtype), x], dim=-1) if halo is not None else x
        return Halo.apply(x, self.group, self.rank, self.ranks, reach, -1, self.kept)

    def update_recurrent_state(self, state, layer_idx, **kwargs):
        pass

    def gathered(self, final: torch.Tensor) -> torch.Tensor:
        """Every rank's [F | M] [P, B, H, d_k, d_v + d_k]: gathered, or (recompute) what the forward gathered."""
        if self.recompute:
            # requiring grad as the forward's did, so the recompute saves the tensors the forward saved
            return self.kept.tensors.detach().requires_grad_(torch.is_grad_enabled())
        return _GatherStates.apply(final, self.group, self.rank, self.kept)


def _across_shards(
    kernel,
    cache: _DeltaCache,
    query,
    key,
    value,
    g=None,
    beta=None,
    initial_state=None,
    output_final_state=False,
    **kwargs,
):
    """The kernel's call on this shard, exact across shards (module docstring). query/key [B, s, Hk, d_k], value
    [B, s, H, d_v] -> (output [B, s, H, d_v], this shard's final state [B, H, d_k, d_v] or None)."""
    if initial_state is not None or kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError(
            "a delta-rule mixer across shards got an initial state or packed documents "
            "(cu_seqlens): train on unpacked rows, or without sequence parallelism."
        )
    B, s, H, dv = value.shape
    dk = key.shape[-1]
    wide = torch.cat([value, value.new_zeros(B, s, H, dk)], dim=-1)  # [B, s, H, d_v + d_k]
    start = torch.zeros(B, H, dk, dv + dk, dtype=torch.float32, device=value.device)
    start[..., dv:] = torch.eye(dk, dtype=torch.float32, device=value.device)  # [0 | I]
    out, final = kernel(
        query, key, wide, g=g, beta=beta, initial_state=start, output_final_state=True, **kwargs
    )
    gathered = cache.gathered(final.float())  # [P, B, H, d_k, d_v + d_k]: each rank's [F | M]
    state = (
        gathered[0, ..., :dv] * 0
    )  # [B, H, d_k, d_v]; a function of the gathered states on every rank
    for j in range(cache.rank):  # the prefix over the ranks before this one
        state = gathered[j, ..., dv:] @ state + gathered[j, ..., :dv]
    reads = torch.einsum("bshk,bhkv->bshv", out[..., dv:].float(), state)  # [B, s, H, d_v]
    # this shard's true final state [B, H, d_k, d_v] (some forwards hand it to the cache, which drops it)
    final = (
        (final[..., dv:].float() @ state + final[..., :dv].float()).detach()
        if output_final_state
        else None
    )
    return (out[..., :dv].float() + reads).to(out.dtype), final


@contextlib.contextmanager
def _kernel_swapped(module, cache: _DeltaCache):
    """The kernel the module's modeling file calls, replaced by `_across_shards` around it for one call, restored
    after."""
    space, name = (
        sys.modules[type(module).__module__].__dict__,
        DELTA_KERNELS[type(module).__name__],
    )
    original = space[name]
    space[name] = functools.partial(_across_shards, original, cache)
    try:
        yield
    finally:
        space[name] = original


def kernel_present(module) -> bool:
    """Whether the module's modeling file defines the kernel its class is listed with (checked at install)."""
    name = DELTA_KERNELS.get(type(module).__name__)
    space = getattr(sys.modules.get(type(module).__module__), "__dict__", {})
    return name is not None and callable(space.get(name))


def parallel_delta_forward(
    module, hidden_states, attention_mask, kwargs, group, rank, ranks, recompute, kept
):
    """The module's own forward on this shard with a `_DeltaCache` and its kernel corrected across shards.
    `recompute`: activation checkpointing's rerun inside the backward, with `kept` what the forward received;
    otherwise `kept` is a `Kept` to fill for such a rerun, or None."""
    cache = _DeltaCache(group, rank, tuple(ranks), kept, recompute)
    with _kernel_swapped(module, cache):
        return type(module).forward(module, hidden_states, cache, attention_mask, **kwargs)
