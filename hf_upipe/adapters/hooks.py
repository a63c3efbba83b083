"""Refuse a transformers model that would run on a rank's shard as if the shard were the whole sequence.

Under sequence parallelism each rank calls the model on its shard. Attention is exact there only through
`attn_implementation="upipe"`, and token mixers (Mamba2, gated DeltaNet, short convolutions) only once
`prepare_model` installed their cross-shard forward. A model called without either would mix each shard alone,
with no error. A model without attention layers (Mamba2 alone) runs no hf_upipe code at all unless prepared, so
only a hook outside the model can notice.

Entry points:
- `sync_guard(active)`: install (True) or remove (False) a global module forward pre-hook that refuses such a call
  on every rank, before the model computes anything. Importing this module (`import hf_upipe` does) has
  `hf_upipe.distributed` call it whenever the SP state changes: active while sp_size > 1.
- An unprepared model it admits (attention "upipe", no token mixer) gets `prepare_model`'s call checks
  (`hf_upipe.adapters.call_checks`) for its later calls, and a loss that refuses unshifted labels for this one;
  `output_attentions` is refused where the weights would be collected.
- The rotary embeddings of a model it admits refuse the whole row's position_ids with a shard's hidden states,
  naming the shard's length and the fix (`call_checks.shard_length_refusal`), on its first call too.
- `unprepared_refusal(model, allow_unverified)`: why `model`, not prepared by `prepare_model`, cannot run on
  shards (its token mixers, what the support gate refuses, its attention); None if it can (no token mixer, a type
  the gate admits, its attention modules, if any, "upipe").

Cost: the hook returns at once for a module that is not a transformers model (a dict lookup by class); a model it
admitted is remembered with its attention implementation (weakly), so a step pays one lookup per model call.

Random draws inside a transformers model under sequence parallelism: each rank of an SP group draws its own
stream, so no shard repeats another's masks; a draw that one process makes once for the whole sequence is refused.

Entry points:
- `sync_randomness(active)`: install (True) or remove (False) a global module forward pre-hook and an always-called
  forward hook. Importing this module (`import hf_upipe` does) has `hf_upipe.distributed` call it whenever the SP
  state changes: active while sp_size > 1.
- `rank_seed(base, sp_rank)`: the seed rank `sp_rank`'s stream starts from, for a `base` every rank drew alike.
- `random_refusal(model)`: why `model`'s training forward cannot run on shards (a draw made once per sequence), or
  None.

The problem. Every rank shares torch's seed (the Trainer's `set_seed` arranges it, and DDP relies on it). A draw
made on a shard (dropout on hidden states, PEFT's `lora_dropout`, a router's jitter or sampling, such as Mixtral's
`router_jitter_noise` or PhiMoE's sparsemixer) then gives every shard the same mask at the same local positions:
the training is not what one device does, even in distribution.

The design. The draws happen inside modules hf_upipe does not own, from torch's global generators, so they are
given a stream per rank. When the outermost transformers model is called in training mode under SP, the pre-hook
1. draws `base` from torch's CPU generator (every rank alike, so a new one every step),
2. saves the CPU generator's state and that of the model's accelerator (CUDA), and seeds both with
   `rank_seed(base, sp_rank)`,
and the forward hook, called even when the forward raises, puts the saved states back. After the forward every
rank's generators are again alike (advanced by the one draw), so whatever else draws from them (samplers, other
data-parallel ranks) is unchanged. Inside the forward each rank's draws are independent of the other ranks' and of
the previous steps': each element is dropped with probability p, independently, as on one device (the same
distribution; not the same numbers, which would need every rank to draw the whole sequence's masks).

Activation checkpointing: torch's checkpoint saves the generators' state when the checkpointed forward runs (inside
the rank's stream) and restores it for the recompute (`preserve_rng_state`, its default; a checkpoint without it is
refused for state mixers by `hf_upipe.adapters.mixers`), so the recompute draws the forward's masks again, on
every rank. A checkpoint around the whole model recomputes from the generator state before the pre-hook, so it draws
the same `base`.

Not covered here: the fused attention block's LoRA dropout draws its own masks, by global token position, the same
as one process's (`hf_upipe.ops.lora_dropout`); attention-probability dropout is refused under SP
(`hf_upipe.attention.state.check_call`). Refused in training under SP (`random_refusal`): LayerDrop
(OPT's `config.layerdrop`: one draw per layer skips it for the whole sequence, so the shards must agree; with a
stream per rank they would not, and a rank that skips a layer its neighbours run would wait for them forever), and
NEFTune (the Trainer's `neftune_noise_alpha`: its noise scale is alpha / sqrt(length * width) with the shard's
length, sqrt(sp_size) times one process's). Data-parallel replicas keep sharing their streams, as plain DDP does.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hf_upipe.adapters.call_checks import (
    check_loss_labels,
    install_call_checks,
    is_adopted,
    refuse_generation,
    shard_length_refusal,
)
from hf_upipe.adapters.mixers import is_installed, supported
from hf_upipe.adapters.support import config_refusal, model_refusal, refusal_error
from hf_upipe.distributed import get_sequence_parallel_state, on_state_change
from hf_upipe.ops.fake import simulating
from hf_upipe.ops.lora_dropout import splitmix64

__all__ = ["random_refusal", "rank_seed", "sync_guard", "sync_randomness", "unprepared_refusal"]

_HANDLES: list = []  # the installed global hooks' handles

_IS_MODEL: dict[type, bool] = {}  # class -> whether it is a transformers PreTrainedModel

_FORKED: list = []  # [(model, saved generator states)] while the outermost model's forward runs


def _is_transformers_model(cls: type) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in cls.__mro__
    )


def rank_seed(base: int, sp_rank: int) -> int:
    """A 63-bit seed for rank `sp_rank`'s stream from `base`: distinct ranks, distinct streams."""
    return splitmix64(base ^ splitmix64(sp_rank + 1)) >> 1


def random_refusal(model: nn.Module) -> str | None:
    """See the module docstring."""
    config, name = getattr(model, "config", None), type(model).__name__
    for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        value = getattr(config, key, None)
        if isinstance(value, float) and value > 0.0:
            return (
                f"{name} has config.{key}={value}: LayerDrop skips a whole layer for the whole sequence at random "
                f"in training, a draw the shards of a sequence would each make differently under sequence "
                f"parallelism. Set model.config.{key} = 0.0 to train it with sequence parallelism."
            )
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    alpha = getattr(embeddings, "neftune_noise_alpha", None)
    if alpha:
        return (
            f"NEFTune (neftune_noise_alpha={alpha}) scales its noise by the sequence length, which on a shard "
            f"is the shard's: under sequence parallelism the noise would be sqrt(sp_size) times one process's. "
            f"Train without NEFTune (TrainingArguments(neftune_noise_alpha=None))."
        )
    return None


def _accelerator(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter when it has its own generator (CUDA), else None."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return None
    return torch.device("cuda", p.device.index if p.device.index is not None else 0)


def _fork(module: nn.Module, args) -> None:
    """The global forward pre-hook: the outermost transformers model's training forward draws a stream per rank."""
    if _FORKED or not module.training:
        return None
    cls = type(module)
    is_model = _IS_MODEL.get(cls)
    if is_model is None:
        is_model = _IS_MODEL[cls] = _is_transformers_model(cls)
    state = get_sequence_parallel_state()
    if not is_model or state is None or state.sp_size == 1 or simulating():
        return None  # (a memory simulation's fake tensors carry no values, so no masks to draw)
    reason = random_refusal(module)
    if reason is not None:  # every rank alike (the same model and settings), before any collective
        raise NotImplementedError(reason)
    base = int(torch.randint(0, 2**62, (1,)).item())  # every rank alike: a new base every step
    device = _accelerator(module)
    saved = (torch.get_rng_state(), device, torch.cuda.get_rng_state(device) if device else None)
    seed = rank_seed(base, state.sp_rank)
    torch.default_generator.manual_seed(seed)
    if device is not None:
        torch.cuda.default_generators[device.index].manual_seed(seed)
    _FORKED.append((module, saved))
    return None


def _join(module: nn.Module, args, output) -> None:
    """The global forward hook (always called): the forked model's generators back to their shared state."""
    if _FORKED and _FORKED[-1][0] is module:
        _, (cpu, device, accelerator) = _FORKED.pop()
        torch.set_rng_state(cpu)
        if device is not None:
            torch.cuda.set_rng_state(accelerator, device)
    return None


def sync_randomness(active: bool) -> None:
    """Install the global hooks (active) or remove them; idempotent."""
    if active and not _HANDLES:
        _HANDLES.append(nn.modules.module.register_module_forward_pre_hook(_fork))
        _HANDLES.append(nn.modules.module.register_module_forward_hook(_join, always_call=True))
    elif not active and _HANDLES:
        for handle in _HANDLES:
            handle.remove()
        _HANDLES.clear()
        _FORKED.clear()


on_state_change(lambda state: sync_randomness(state is not None and state.sp_size > 1))

_HANDLE: list = [None]  # the installed global hook's handle


_ADMITTED: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # model -> (attn implementation, prepared)


def unprepared_refusal(model: nn.Module, allow_unverified: bool = False) -> str | None:
    """See the module docstring."""
    state = get_sequence_parallel_state()
    where = (
        f"{type(model).__name__} was called under sequence parallelism (sp_size="
        f"{state.sp_size if state is not None else '?'}) without hf_upipe.prepare_model"
    )
    mixers = sorted(
        {type(m).__name__ for m in model.modules() if supported(m) and not is_installed(m)}
    )
    if mixers:
        return (
            f"{where}: its {mixers} layers would each mix their rank's shard alone, from a zero state (every "
            "shard after the first silently wrong). Call model = hf_upipe.prepare_model(model) first "
            "(UPipeTrainer and UPipePlugin do), which makes them run across the shards."
        )
    # what the support gate refuses whether prepared or not (an unverified type, a mixer hf_upipe does not run)
    config = getattr(model, "config", None)
    reason = (
        config_refusal(config, allow_unverified=allow_unverified) if config is not None else None
    )
    reason = reason or model_refusal(model, allow_unverified=allow_unverified)
    if reason is not None:
        return str(refusal_error(reason))
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    attention = any(
        type(m).__name__.endswith("Attention") and not supported(m) for m in model.modules()
    )
    if attention and impl != "upipe":
        return (
            f"{where}, and its attn_implementation is {impl!r}: each rank would attend within its own shard "
            "only. Load it with attn_implementation='upipe', or call model = hf_upipe.prepare_model(model) "
            "(UPipeTrainer and UPipePlugin do). To run a model on whole sequences in this process, call it "
            "inside `with hf_upipe.without_sequence_parallel():`."
        )
    return None


def _check_rotary(module, args, kwargs) -> None:
    """A rotary embedding called as `rotary_emb(x, position_ids)` under SP with position_ids of a length no
    sequence-like dimension of x has (x: [B, s, hidden], [B, H, s, D] or [B, s, H, D]): the whole row's positions
    with a shard, named before the attention's own shape error."""
    x = args[0] if args else kwargs.get("x")
    positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
    state = get_sequence_parallel_state()
    if not (isinstance(x, torch.Tensor) and isinstance(positions, torch.Tensor) and x.dim() >= 3):
        return
    if state is None or state.sp_size == 1 or positions.shape[-1] in x.shape[1:-1]:
        return
    raise ValueError(
        shard_length_refusal("position_ids", positions, x.shape[-2], "this rank's shard")
    )


def _watch_rotary(model: nn.Module) -> None:
    """`_check_rotary` on the model's rotary embeddings (once each): they run in this call too, after this hook."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and not hasattr(module, _WATCHED):
            setattr(
                module, _WATCHED, module.register_forward_pre_hook(_check_rotary, with_kwargs=True)
            )


_WATCHED = "_upipe_rotary_check"


def _refuse_unprepared(module: nn.Module, args) -> None:
    """The global forward pre-hook (module docstring)."""
    cls = type(module)
    is_model = _IS_MODEL.get(cls)
    if is_model is None:
        is_model = _IS_MODEL[cls] = _is_transformers_model(cls)
    if not is_model:
        return None
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return None
    # what the verdict depends on: the attention implementation, and whether prepare_model prepared the model
    # (then its own checks ran) or unprepare_model released it since
    key = (
        getattr(getattr(module, "config", None), "_attn_implementation", None),
        is_adopted(module),
    )
    if _ADMITTED.get(module) == key:
        return None
    refuse_generation()
    if not key[1]:
        reason = unprepared_refusal(module, state.allow_unverified)
        if reason is not None:
            raise NotImplementedError(reason)
        check_loss_labels(module)  # this call's labels too: its loss runs after this hook
        _watch_rotary(module)  # this call's position_ids too
        install_call_checks(
            module, prepared=False
        )  # its later calls' arguments are refused as a prepared one's
    _ADMITTED[module] = key
    return None


def sync_guard(active: bool) -> None:
    """Install the global hook (active) or remove it; idempotent."""
    if active and _HANDLE[0] is None:
        _HANDLE[0] = nn.modules.module.register_module_forward_pre_hook(_refuse_unprepared)
    elif not active and _HANDLE[0] is not None:
        _HANDLE[0].remove()
        _HANDLE[0] = None
        _ADMITTED.clear()


on_state_change(lambda state: sync_guard(state is not None and state.sp_size > 1))
