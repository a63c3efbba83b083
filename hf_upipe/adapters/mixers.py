"""Token mixers other than attention under SP (gated DeltaNet, Mamba2, short convolutions), exact across shards.

Entry points:
- `install_mixers(model, state_passing)` / `remove_mixers(model)`: on every mixer module of a class in `MIXERS` or
  `HALO_MIXERS` (`hf_upipe.adapters.mixers`: once verified on the installed transformers), install (and
  remove, exactly) `sharded_mixer_forward`.
- `reentrant_refusal(model)`: why its checkpointing cannot run a state mixer (use_reentrant=True, or
  preserve_rng_state=False), or None; `ring_refusal(model, ring_size)`: why its mixers cannot run under a ring.
- `mixers_ready(config)`: whether a prepared model of this config has them installed (the support gate admits
  the `layer_types` in `MIXER_LAYER_TYPES` under SP at run time only then); `supported(module)`,
  `is_installed(module)`.

Three ways, by what the mixer carries across the sequence:
- Delta-rule state, all ranks at once (`DELTA_KERNELS`: gated DeltaNet of Qwen3-Next, Qwen3.5, OLMo-Hybrid; Kimi
  delta attention of Bailing-Hybrid): each rank corrects its shard's output by the prefix of the states all ranks
  gather (`hf_upipe.adapters.delta_rule`, which says why that is exact and what it costs). The default;
  `install_mixers(model, state_passing="sequential")` runs them the next way instead.
- State in sequence (`MIXERS`: the above, and Mamba2 of Bamba, Nemotron-H, Falcon-H1, Granite 4 hybrids, Zamba2
  and Mamba2 models). Each rank runs the mixer's own forward (transformers' code, its torch or CUDA kernels) on
  its shard, with a `ShardCache` as its cache, the way transformers continues a prefill from a cache: the causal
  convolution's state is the last k-1 convolution inputs of the previous rank's shard (a halo), the recurrence's
  initial state is the previous rank's final state. The ranks run one after the other inside each such layer
  (rank r waits for rank r-1; the backward runs the chain the other way): the sequential fallback, measured and
  documented in docs/support.md. Attention layers in between stay parallel. Bytes sent per mixer layer and rank:
  the halo [B, conv channels, k-1] and the state (gated DeltaNet [B, heads, d_k, d_v]; Mamba2 [B, heads, head_dim,
  d_state]), fp32, forward and backward.
- Halo only (`HALO_MIXERS`: LFM2's short convolutions, whose only reach is the k-1 previous tokens). All ranks at
  once send their last k-1 input tokens [B, k-1, Dm] to the next rank (`Halo`), run the mixer's own forward on
  [halo; shard] and keep the last s outputs; the backward sends the halo's gradient back, where it is added to the
  last k-1 tokens'. One exchange of (k-1)*Dm values per sequence and rank each way.
None of them gathers the sequence. Under (non-reentrant) activation checkpointing the recompute inside the backward
reuses what its forward received, found by a key both draw (`call_key`), and does not communicate.

The mixer classes hf_upipe runs across shards, the sources they were verified on, and their behaviour check.

Entry points:
- `MIXERS`: mixer class name -> the fingerprints of its forward in the verified releases: the mixers that carry a
  state across the sequence (gated DeltaNet, Kimi delta attention, Mamba2), which continue from a shard's cache.
- `HALO_MIXERS`: the same for short convolutions, which reach only k-1 tokens back.
- `MIXER_MODEL_TYPES`: mixer class name -> a model type holding one.
- `mixer_verdict(cls)`: verified by the fingerprint of a verified release, else by `mixer_check(cls)`
  (`hf_upipe.models.verification`).
- `mixer_check(cls)`: what `hf_upipe.adapters.mixers` relies on, on a tiny model's mixer, in fp32: a state
  mixer run on two halves, the second continuing from the first's `ShardCache` (its convolution tail and final
  state), equals the mixer on the whole sequence, outputs and every gradient (of the input and the parameters,
  through the state handed over); a short convolution run on [halo; second half] gives the whole sequence's
  second half.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn

from hf_upipe.adapters.delta_rule import DELTA_KERNELS, kernel_present, parallel_delta_forward
from hf_upipe.adapters.shard_exchange import (
    Halo,
    Kept,
    ShardCache,
    call_key,
    may_recompute,
    stash,
    stashed,
)
from hf_upipe.distributed import get_sequence_parallel_state, without_sequence_parallel
from hf_upipe.models.verification import VERIFIED_RELEASES, Verdict, fingerprint, verify

__all__ = [
    "HALO_MIXERS",
    "MIXERS",
    "MIXER_LAYER_TYPES",
    "MIXER_MODEL_TYPES",
    "install_mixers",
    "is_installed",
    "mixer_check",
    "mixer_verdict",
    "mixers_ready",
    "reentrant_refusal",
    "remove_mixers",
    "ring_refusal",
    "sharded_mixer_forward",
    "supported",
]

# mixer class -> fingerprints of its forward in the verified releases
# (`hf_upipe.models.verification.VERIFIED_RELEASES`);
# it reads the cache the way `ShardCache` serves it
_MAMBA2 = (
    "691f3ca98636d473",
    "c215be341ddf22ff",
    "6e1e9d6ce582599a",
)  # the Mamba2 mixers of Bamba, Nemotron-H, Granite 4, ...

_DELTA = (
    "8f31ae7d35daf534",
    "08cf65a63ca582a2",
    "a43ffe9ab7f49c75",
)  # Qwen3.5's gated DeltaNet (and the types that copy it)

MIXERS = {
    "Qwen3NextGatedDeltaNet": ("177c5d3df989a7b4", "d97f22719fb58479", "d267e937a25e4f8d"),
    "Qwen3_5GatedDeltaNet": _DELTA,
    "Qwen3_5MoeGatedDeltaNet": _DELTA,
    "Qwen4ExpTextGatedDeltaNet": _DELTA,
    "OlmoHybridGatedDeltaNet": ("167004f14399b33e", "bc540b7a213f93d0", "8b7eda855f07d012"),
    "BailingHybridDeltaAttention": ("cd86b9f6aaf59e3c", "aa638068a776c7df", "4691bf7cc2739a1d"),
    "BambaMixer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "Mamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "FalconH1Mixer": ("8274bd4cb6961bb4", "d0ddba7970a9ddd1", "3003699349bf9357"),
}

# short convolutions: class -> fingerprints of its forward; they reach k-1 tokens back and carry nothing further
_SHORT_CONV = ("dd9e0a8c046f3cb6", "1d07ca85b588af88", "ab35322f9346b8a5")

HALO_MIXERS = {"Lfm2ShortConv": _SHORT_CONV, "Lfm2MoeShortConv": _SHORT_CONV}

# mixer class -> a model type holding one, which its behaviour check builds tiny (`mixer_check`)
MIXER_MODEL_TYPES = {
    "Qwen3NextGatedDeltaNet": "qwen3_next",
    "Qwen3_5GatedDeltaNet": "qwen3_5_text",
    "Qwen3_5MoeGatedDeltaNet": "qwen3_5_moe_text",
    "Qwen4ExpTextGatedDeltaNet": "qwen4_exp_text",
    "OlmoHybridGatedDeltaNet": "olmo_hybrid",
    "BailingHybridDeltaAttention": "bailing_hybrid",
    "BambaMixer": "bamba",
    "NemotronHMamba2Mixer": "nemotron_h",
    "GraniteMoeHybridMambaLayer": "granitemoehybrid",
    "Mamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "zamba2",
    "FalconH1Mixer": "falcon_h1",
    "Lfm2ShortConv": "lfm2",
    "Lfm2MoeShortConv": "lfm2_moe",
}


def mixer_verdict(cls) -> Verdict:
    """Whether a mixer class of `MIXERS` / `HALO_MIXERS` continues from a shard's cache (or halo) as the adapter
    relies on, on the installed transformers: by the fingerprint of its forward in a verified release, else by
    `mixer_check` (`hf_upipe.models.verification`)."""
    name = cls.__name__
    known = MIXERS.get(name, HALO_MIXERS.get(name, ()))
    try:
        source = fingerprint(cls.forward)
    except (OSError, TypeError):
        source = None
    return verify("mixer", name, source, known, lambda: mixer_check(cls))


def _module_of(cls):
    """A tiny model's first mixer of class `cls` (fp32, random weights), or None."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.models.presets import tiny_config

    model_type = MIXER_MODEL_TYPES.get(cls.__name__)
    if model_type is None:
        return None
    config = tiny_config(model_type)
    for key, value in _CONFIG_FIXES.get(model_type, {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return next((m for m in model.modules() if type(m) is cls), None)


# what a type's tiny config needs beyond `hf_upipe.models.presets.tiny_config` to build
_CONFIG_FIXES = {t: dict(layer_types=["conv", "full_attention"]) for t in ("lfm2", "lfm2_moe")}


def _halves(module, x: torch.Tensor, s: int) -> torch.Tensor:
    """The mixer on x [B, S, Dm] as two shards of s and S - s tokens, the way the adapter runs it."""
    forward = type(module).forward
    if type(module).__name__ in HALO_MIXERS:
        reach = getattr(module, "conv_kernel_size", 1) - 1
        first = forward(module, x[:, :s], None, None)
        second = forward(module, x[:, s - reach :], None, None)[:, reach:]
        return torch.cat([first, second], dim=1)
    first_cache = ShardCache(None, None)
    first = forward(module, x[:, :s], first_cache, None)
    second = forward(module, x[:, s:], ShardCache(first_cache.tail, first_cache.final), None)
    return torch.cat([first, second], dim=1)


def mixer_check(cls) -> str | None:
    """See the module docstring: None when equal (relative to the largest value: outputs 1e-5, gradients 1e-4),
    else what differed."""
    with without_sequence_parallel():  # the tiny model runs whole, whatever SP state the caller has
        return _mixer_check(cls)


def _mixer_check(cls) -> str | None:
    module = _module_of(cls)
    if module is None:
        return f"no tiny model with a {cls.__name__} to check it on"
    gen = torch.Generator().manual_seed(1)
    width = getattr(module, "hidden_size", None) or module.config.hidden_size
    x = torch.randn(2, 12, width, generator=gen)  # [B, S, Dm]; shards of 5 and 7 tokens
    results = []
    for run in (
        lambda x: type(module).forward(module, x, None, None),
        lambda x: _halves(module, x, 5),
    ):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = run(xi)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        (out.double() * weight).sum().backward()
        grads = {
            "input": xi.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.grad is not None},
        }
        results.append((out.detach(), grads))
    (want, want_grads), (got, got_grads) = results
    if (
        _rel(got, want) > 1e-5
    ):  # relative to the largest value: the chunked kernels' rounding is ~1e-7
        return f"its output on two shards differs from the whole sequence's by {_rel(got, want):.2e} (relative)"
    for name, grad in want_grads.items():
        error = _rel(got_grads[name], grad) if name in got_grads else float("inf")
        if error > 1e-4:
            return f"the gradient of its {name} on two shards differs by {error:.2e} (relative)"
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


logger = logging.getLogger(__name__)

# the `layer_types` these mixers fill ("hybrid": Falcon-H1's layers, attention and a Mamba2 mixer side by side)
MIXER_LAYER_TYPES = ("linear_attention", "conv", "hybrid")

_READY: dict[int, weakref.ref] = {}

_SAID: set[str] = set()  # delta-rule mixer classes whose fallback to sequential passing was logged

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _send(t: torch.Tensor, dst: int, group, header: bool) -> None:
    """Send t (after a small header with its shape and dtype when the receiver cannot know them), on t's device."""
    if header:
        code = [t.dim(), *t.shape, _DTYPES.index(t.dtype)]
        dist.send(
            torch.tensor(code + [0] * (8 - len(code)), dtype=torch.int64, device=t.device),
            dst,
            group=group,
        )
    dist.send(t.detach().contiguous(), dst, group=group)


def _recv(src: int, group, like: tuple | None = None, device=None) -> torch.Tensor:
    """Receive what `_send` sent, on `device`: of `like` = (shape, dtype), or as its header says."""
    if like is None:
        code = torch.empty(8, dtype=torch.int64, device=device)
        dist.recv(code, src, group=group)
        code = code.tolist()
        n = code[0]
        like = (code[1 : 1 + n], _DTYPES[code[1 + n]])
    out = torch.empty(like[0], dtype=like[1], device=device)
    dist.recv(out, src, group=group)
    return out


class _Receive(torch.autograd.Function):
    """(halo, state) from the previous rank; backward sends it their gradients. `anchor` keeps the node in the
    graph on every rank alike (a leaf that requires grad), so no rank waits for a gradient nobody sends. `kept`: a
    `Kept` to fill (for a recompute), or None."""

    @staticmethod
    def forward(ctx, anchor, group, src, device, kept):
        ctx.group, ctx.src, ctx.device = group, src, device
        halo, state = _recv(src, group, device=device), _recv(src, group, device=device)
        # not the outputs: that would be a reference cycle
        ctx.like = [(t.shape, t.dtype) for t in (halo, state)]
        if kept is not None:
            kept.tensors, ctx.kept = (halo.detach(), state.detach()), kept
        return halo, state

    @staticmethod
    def backward(ctx, d_halo, d_state):
        for g, (shape, dtype) in zip((d_halo, d_state), ctx.like):
            _send(
                g if g is not None else torch.zeros(shape, dtype=dtype, device=ctx.device),
                ctx.src,
                ctx.group,
                header=False,
            )
        return None, None, None, None, None


class _Give(torch.autograd.Function):
    """Send (tail, final state) to the next rank; returns a zero scalar to add to the output, whose backward
    receives their gradients from the next rank. It saves `anchor`, so that under activation checkpointing its
    backward first makes the checkpoint recompute the layer (which may hold attention, whose recompute all ranks
    run together: Zamba2's layers run attention, then the mixer), and only then waits for the next rank."""

    @staticmethod
    def forward(ctx, anchor, group, dst, tail, final):
        ctx.group, ctx.dst, ctx.device = group, dst, tail.device
        # not the tensors: they need not live until backward
        ctx.like = [(t.shape, t.dtype) for t in (tail, final)]
        ctx.save_for_backward(anchor)
        _send(tail, dst, group, header=True)
        _send(final, dst, group, header=True)
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        ctx.saved_tensors  # noqa: B018  (a checkpoint's recompute runs here, before the wait)
        grads = [_recv(ctx.dst, ctx.group, like, ctx.device) for like in ctx.like]
        return None, None, None, *grads


class _Mark(torch.autograd.Function):
    """What `_Give` saves, in a recompute (which sends nothing): the same saved tensor in the same place."""

    @staticmethod
    def forward(ctx, anchor):
        ctx.save_for_backward(anchor)
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return None


@functools.lru_cache(maxsize=64)
def _arg_names(cls) -> tuple[str, str]:
    """The names of a mixer forward's cache and mask parameters (the 2nd and 3rd: `cache_params` or
    `past_key_values`, then `attention_mask`)."""
    names = list(inspect.signature(cls.forward).parameters)[2:4]
    return names[0], names[1]


def sharded_mixer_forward(self, hidden_states, *args, **kwargs):
    """Installed on mixer modules: under SP, the module's own forward on this shard continued from the previous
    rank's halo (and state) (module docstring); without SP the class's forward as it is."""
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cache_name, mask_name = _arg_names(type(self))
    cache_params = args[0] if args else kwargs.pop(cache_name, None)
    attention_mask = args[1] if len(args) > 1 else kwargs.pop(mask_name, None)
    if cache_params is not None:
        raise NotImplementedError(
            "a cache under sequence parallelism: call the model with use_cache=False."
        )
    reach = getattr(self, "conv_kernel_size", 1) - 1
    # every rank (equal shards), before any send or receive
    if hidden_states.shape[1] < max(reach, 2):
        raise NotImplementedError(
            f"a shard of {hidden_states.shape[1]} tokens is shorter than the convolution's "
            f"reach ({reach} tokens) or than 2 tokens: use fewer ranks or longer sequences."
        )
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("upipe_")}
    group, rank = state.sp_group, state.sp_rank
    ranks = dist.get_process_group_ranks(group)
    if type(self).__name__ in HALO_MIXERS:
        return _halo_forward(self, hidden_states, attention_mask, kwargs, group, rank, ranks, reach)
    parallel = _passing(self) == "parallel"
    # activation checkpointing's recompute, inside the backward: no communication
    if torch._C._current_graph_task_id() != -1:
        if parallel:  # what the forward received
            kept = stashed(self, call_key())
            return parallel_delta_forward(
                self, hidden_states, attention_mask, kwargs, group, rank, ranks, True, kept
            )
        return _recompute(self, hidden_states, attention_mask, rank, kwargs)  # (see there)
    key = call_key() if torch.is_grad_enabled() and may_recompute() else None  # every rank alike
    if parallel:
        kept = stash(self, key, Kept()) if key is not None else None
        return parallel_delta_forward(
            self, hidden_states, attention_mask, kwargs, group, rank, ranks, False, kept
        )
    return _chain_forward(self, hidden_states, attention_mask, kwargs, state, ranks, key)


def _halo_forward(self, hidden_states, attention_mask, kwargs, group, rank, ranks, reach):
    """A short convolution, all ranks at once: [halo; shard] through the module, the shard's outputs kept."""
    # [B, s] padding mask (transformers gives one only where a row pads)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != hidden_states.shape[:2]:
            raise NotImplementedError(
                f"{type(self).__name__}: a mask of shape {tuple(attention_mask.shape)} "
                f"for a shard of shape {tuple(hidden_states.shape[:2])}."
            )
        # what the module does first, done before the exchange so the halo carries it too
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    if reach == 0:
        return type(self).forward(self, hidden_states, None, None, **kwargs)
    # [B, reach + s, Dm] through the module (rank 0: [B, s, Dm], no halo)
    out = type(self).forward(
        self, Halo.apply(hidden_states, group, rank, tuple(ranks), reach), None, None, **kwargs
    )
    return out[:, reach:] if rank > 0 else out  # [B, s, Dm]


def _chain_forward(self, hidden_states, attention_mask, kwargs, state, ranks, key):
    """The rank chain: wait for the previous rank's (halo, state), run the module, give the next rank its own."""
    group, rank, size = state.sp_group, state.sp_rank, state.sp_size
    anchor = torch.zeros((), device=hidden_states.device, requires_grad=torch.is_grad_enabled())
    halo = start = None
    if rank > 0:
        kept = stash(self, key, Kept()) if key is not None else None  # what its recompute will need
        halo, start = _Receive.apply(anchor, group, ranks[rank - 1], hidden_states.device, kept)
    cache = ShardCache(halo, start)
    out = type(self).forward(self, hidden_states, cache, attention_mask, **kwargs)
    if rank < size - 1:
        out = out + _Give.apply(anchor, group, ranks[rank + 1], cache.tail, cache.final).to(
            out.dtype
        )
    return out


def _passing(module) -> str:
    """How this mixer passes state across shards: "parallel" (a delta-rule mixer, unless installed with
    state_passing="sequential"), "sequential" (the rank chain), or "halo" (a short convolution)."""
    name = type(module).__name__
    if name in HALO_MIXERS:
        return "halo"
    return (
        module.__dict__.get("_upipe_passing", "parallel") if name in DELTA_KERNELS else "sequential"
    )


def _recompute(self, hidden_states, attention_mask, rank, kwargs):
    """The forward again, as activation checkpointing reruns it inside the backward, without sending or receiving:
    the ranks reach their recomputes in an order the autograd engine picks (a rank may first wait in `_Give`'s
    backward for the next rank's gradient, while that rank's recompute would wait for this rank's halo), so a
    recompute that communicated could deadlock. It takes the (halo, state) this call received in its forward, found
    by the key both draw (`call_key`); gradients flow through the forward's graph, not through the recompute's."""
    key = call_key()  # every rank alike, as its forward did
    halo = start = None
    if rank > 0:
        # requiring grad as the forward's did, so the recompute saves the tensors the forward saved
        halo, start = (
            t.detach().requires_grad_(torch.is_grad_enabled()) for t in stashed(self, key).tensors
        )
    out = type(self).forward(self, hidden_states, ShardCache(halo, start), attention_mask, **kwargs)
    # where the forward gave, the same saved tensor
    if rank < get_sequence_parallel_state().sp_size - 1:
        anchor = torch.zeros((), device=hidden_states.device, requires_grad=torch.is_grad_enabled())
        out = out + _Mark.apply(anchor).to(out.dtype)
    return out


def reentrant_refusal(model: nn.Module) -> str | None:
    """Why a checkpointed layer holding a state mixer cannot run, or None: a reentrant checkpoint (its forward runs
    without grad, so nothing is kept for the recompute, which must not communicate), or one that does not restore
    the random state (the recompute finds its forward's state by a key drawn from it, `call_key`)."""
    for layer in model.modules():
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if not getattr(layer, "gradient_checkpointing", False) or fn is None:
            continue
        keywords = getattr(fn, "keywords", None) or {}
        bad = "use_reentrant=True" if keywords.get("use_reentrant", False) else None
        if bad is None and not keywords.get("preserve_rng_state", True):
            bad = "preserve_rng_state=False"
        if bad and any(is_installed(m) and type(m).__name__ in MIXERS for m in layer.modules()):
            return (
                f"{type(layer).__name__} is checkpointed with {bad} around a recurrent mixer run across shards; "
                "use transformers' default checkpointing (activation_checkpointing_kwargs={'use_reentrant': "
                "False}, random state preserved)."
            )
    return None


def ring_refusal(model: nn.Module, ring_size: int) -> str | None:
    """Why a model with installed mixers cannot run under a ring of `ring_size`, or None: a mixer passes its state
    (or halo) from each shard to the next in sequence order, and the ring reorders the shards."""
    if ring_size > 1:
        mixer = next((m for m in model.modules() if is_installed(m)), None)
        if mixer is not None:
            return (
                f"{type(mixer).__name__} passes its state (or halo) from each shard to the next in sequence "
                f"order, which ring attention (ring_size={ring_size}) reorders: use ring_size=1 for this hybrid "
                "model."
            )
    return None


def is_installed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is sharded_mixer_forward


def supported(module: nn.Module) -> bool:
    """A mixer of a known class verified on the installed transformers (installed, or to be installed)."""
    name = type(module).__name__
    return is_installed(module) or (
        (name in MIXERS or name in HALO_MIXERS)
        and mixer_verdict(type(module)).ok
        and (name not in DELTA_KERNELS or kernel_present(module))
    )


def install_mixers(model: nn.Module, state_passing: str = "parallel") -> int:
    """Install `sharded_mixer_forward` on the model's mixers of verified classes (idempotent); how many.
    `state_passing`: "parallel" (the delta-rule mixers all ranks at once, `hf_upipe.adapters.delta_rule`) or
    "sequential" (the rank chain, the least memory); Mamba2 mixers always pass state in sequence."""
    if state_passing not in ("parallel", "sequential"):
        raise ValueError(f"state_passing={state_passing!r}: use 'parallel' or 'sequential'.")
    count = 0
    for module in model.modules():
        if not supported(module):
            continue
        if "forward" not in module.__dict__ or is_installed(module):
            module.forward = types.MethodType(sharded_mixer_forward, module)
            if type(module).__name__ in DELTA_KERNELS:
                module.__dict__["_upipe_passing"] = _delta_passing(type(module), state_passing)
            count += 1
    config = getattr(model, "config", None)
    if count and config is not None:
        _READY[id(config)] = weakref.ref(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        _READY[id(text)] = weakref.ref(text)
    return count


def _delta_passing(cls, state_passing: str) -> str:
    """The state passing a delta-rule mixer runs: the parallel prefix only on a verified release's source (what it
    relies on beyond the cache, the kernel's call, is not in the behaviour check); else the rank chain."""
    if state_passing == "parallel" and mixer_verdict(cls).how != "fingerprint":
        if cls.__name__ not in _SAID:
            _SAID.add(cls.__name__)
            logger.info(
                "hf_upipe: %s passes its state in sequence (verified by behaviour on this transformers; the "
                "parallel prefix is verified on transformers %s)",
                cls.__name__,
                ", ".join(VERIFIED_RELEASES),
            )
        return "sequential"
    return state_passing


def remove_mixers(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        if is_installed(module):
            del module.forward
            module.__dict__.pop("_upipe_stash", None)
            module.__dict__.pop("_upipe_passing", None)
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
