"""Linear-time token mixers under SP (gated DeltaNet: Qwen3-Next, Qwen3.5), exact by passing state between ranks.

Entry points:
- `install_mixers(model)` / `remove_mixers(model)`: on every mixer module of a class in `MIXERS` (behind the
  fingerprint of its forward's source), install (and remove, exactly) `sharded_mixer_forward`.
- `mixers_ready(config)`: whether a prepared model of this config has them installed (the support gate admits
  `layer_types` "linear_attention" under SP at run time only then); `supported(module)`, `is_installed(module)`.

How: each rank runs the mixer's own forward (transformers' code, its torch or CUDA kernels) on its shard, with a
`_ShardCache` as its cache, the way transformers continues a prefill from a cache: the causal convolution's state
is the last k-1 convolution inputs of the previous rank's shard (a halo), the recurrence's initial state is the
previous rank's final state. The ranks run one after the other inside each such layer (rank r waits for rank
r-1's halo and state; the backward runs the chain the other way, rank r sending rank r-1 the gradients of what it
received): the sequential fallback of the sequence-parallel design, measured and documented in README. Attention
layers in between stay parallel. Bytes sent per mixer layer and rank: the halo [B, conv channels, k-1] and the state
[B, heads, d_k, d_v] (fp32), forward and backward; independent of the sequence length.
"""

from __future__ import annotations

import hashlib
import inspect
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn

from hf_upipe.distributed import get_sequence_parallel_state

__all__ = ["MIXERS", "install_mixers", "is_installed", "mixers_ready", "remove_mixers", "sharded_mixer_forward",
           "supported"]

# mixer class -> fingerprint of its forward (transformers 5.23), read the cache the way `_ShardCache` serves it
MIXERS = {"Qwen3NextGatedDeltaNet": "177c5d3df989a7b4", "Qwen3_5GatedDeltaNet": "8f31ae7d35daf534",
          "Qwen3_5MoeGatedDeltaNet": "8f31ae7d35daf534", "Qwen4ExpTextGatedDeltaNet": "8f31ae7d35daf534",
          "OlmoHybridGatedDeltaNet": "167004f14399b33e", "BailingHybridDeltaAttention": "cd86b9f6aaf59e3c"}
_READY: dict[int, weakref.ref] = {}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _fingerprint(cls) -> str:
    return hashlib.sha256(inspect.getsource(cls.forward).encode()).hexdigest()[:16]


class _ShardCache:
    """The cache a mixer reads: the previous rank's halo (conv state) and final state; it records this shard's."""

    def __init__(self, halo, state):
        self.halo, self.state, self.tail, self.final = halo, state, None, None

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.halo

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.state

    def is_recording_past(self, layer_idx):
        return False

    def update_conv_state(self, x, layer_idx, conv_kernel_size=None, **kwargs):
        """x [B, C, s] the convolution's input -> [B, C, k-1+s] with the halo in front; records this shard's tail."""
        k = conv_kernel_size
        self.tail = x[..., x.shape[-1] - (k - 1):]
        halo = self.halo if self.halo is not None else x.new_zeros(*x.shape[:-1], k - 1)
        return torch.cat([halo.to(x.dtype), x], dim=-1)

    def update_recurrent_state(self, state, layer_idx, **kwargs):
        self.final = state


def _send(t: torch.Tensor, dst: int, group, header: bool) -> None:
    """Send t (after a small header with its shape and dtype when the receiver cannot know them), on t's device."""
    if header:
        code = [t.dim(), *t.shape, _DTYPES.index(t.dtype)]
        dist.send(torch.tensor(code + [0] * (8 - len(code)), dtype=torch.int64, device=t.device), dst, group=group)
    dist.send(t.detach().contiguous(), dst, group=group)


def _recv(src: int, group, like: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """Receive what `_send` sent: shaped like `like`, or as its header says (on `device`)."""
    if like is None:
        code = torch.empty(8, dtype=torch.int64, device=device)
        dist.recv(code, src, group=group)
        code = code.tolist()
        n = code[0]
        like = torch.empty(code[1:1 + n], dtype=_DTYPES[code[1 + n]], device=device)
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)  # contiguous, whatever like's strides
    dist.recv(out, src, group=group)
    return out


class _Receive(torch.autograd.Function):
    """(halo, state) from the previous rank; backward sends it their gradients. `anchor` keeps the node in the
    graph on every rank alike (a leaf that requires grad), so no rank waits for a gradient nobody sends."""

    @staticmethod
    def forward(ctx, anchor, group, src, device):
        ctx.group, ctx.src = group, src
        halo, state = _recv(src, group, device=device), _recv(src, group, device=device)
        ctx.like = (halo, state)
        return halo, state

    @staticmethod
    def backward(ctx, d_halo, d_state):
        for g, like in zip((d_halo, d_state), ctx.like):
            _send(torch.zeros_like(like) if g is None else g, ctx.src, ctx.group, header=False)
        return None, None, None, None


class _Give(torch.autograd.Function):
    """Send (tail, final state) to the next rank; returns a zero scalar to add to the output, whose backward
    receives their gradients from the next rank."""

    @staticmethod
    def forward(ctx, anchor, group, dst, tail, final):
        ctx.group, ctx.dst, ctx.like = group, dst, (tail, final)
        _send(tail, dst, group, header=True)
        _send(final, dst, group, header=True)
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads = [_recv(ctx.dst, ctx.group, like) for like in ctx.like]
        return None, None, None, *grads


def sharded_mixer_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Installed on mixer modules: under SP, the module's own forward on this shard continued from the previous
    rank's halo and state (module docstring); without SP the class's forward as it is."""
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return type(self).forward(self, hidden_states, cache_params, attention_mask, **kwargs)
    if cache_params is not None:
        raise NotImplementedError("a cache under sequence parallelism: call the model with use_cache=False.")
    reach = getattr(self, "conv_kernel_size", 1) - 1
    if hidden_states.shape[1] < reach:  # every rank (equal shards), before any send or receive
        raise NotImplementedError(f"a shard of {hidden_states.shape[1]} tokens is shorter than the convolution's "
                                  f"reach ({reach} tokens): use fewer ranks or longer sequences.")
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("upipe_")}
    group, rank, size = state.sp_group, state.sp_rank, state.sp_size
    ranks = dist.get_process_group_ranks(group)
    anchor = torch.zeros((), device=hidden_states.device, requires_grad=torch.is_grad_enabled())
    halo = start = None
    if rank > 0:
        halo, start = _Receive.apply(anchor, group, ranks[rank - 1], hidden_states.device)
    cache = _ShardCache(halo, start)
    out = type(self).forward(self, hidden_states, cache, attention_mask, **kwargs)
    if rank < size - 1:
        out = out + _Give.apply(anchor, group, ranks[rank + 1], cache.tail, cache.final).to(out.dtype)
    return out


def is_installed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is sharded_mixer_forward


def supported(module: nn.Module) -> bool:
    """A mixer of a verified class whose installed source is the verified one (installed, or to be installed)."""
    want = MIXERS.get(type(module).__name__)
    return is_installed(module) or (want is not None and _fingerprint(type(module)) == want)


def install_mixers(model: nn.Module) -> int:
    """Install `sharded_mixer_forward` on the model's mixers of verified classes (idempotent); how many."""
    count = 0
    for module in model.modules():
        if not supported(module):
            continue
        if "forward" not in module.__dict__ or is_installed(module):
            module.forward = types.MethodType(sharded_mixer_forward, module)
            count += 1
    config = getattr(model, "config", None)
    if count and config is not None:
        _READY[id(config)] = weakref.ref(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        _READY[id(text)] = weakref.ref(text)
    return count


def remove_mixers(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if is_installed(module):
            del module.forward
            count += 1
    config = getattr(model, "config", None)
    if config is not None:
        _READY.pop(id(config), None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        _READY.pop(id(text), None)
    return count


def mixers_ready(config) -> bool:
    ref = _READY.get(id(config))
    return ref is not None and ref() is config
