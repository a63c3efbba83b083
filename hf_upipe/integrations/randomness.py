"""Random draws inside a transformers model under sequence parallelism: each rank of an SP group draws its own
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
refused for state mixers by `hf_upipe.integrations.mixers`), so the recompute draws the forward's masks again, on
every rank. A checkpoint around the whole model recomputes from the generator state before the pre-hook, so it draws
the same `base`.

Not covered here: the fused attention block's LoRA dropout draws its own masks, by global token position, the same
as one process's (`hf_upipe.ops.lora_dropout`); attention-probability dropout is refused under SP
(`hf_upipe.integrations.sp_checks.check_call`). Refused in training under SP (`random_refusal`): LayerDrop
(OPT's `config.layerdrop`: one draw per layer skips it for the whole sequence, so the shards must agree; with a
stream per rank they would not, and a rank that skips a layer its neighbours run would wait for them forever), and
NEFTune (the Trainer's `neftune_noise_alpha`: its noise scale is alpha / sqrt(length * width) with the shard's
length, sqrt(sp_size) times one process's). Data-parallel replicas keep sharing their streams, as plain DDP does.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_upipe.distributed import get_sequence_parallel_state, on_state_change
from hf_upipe.ops.fake import simulating
from hf_upipe.ops.lora_dropout import splitmix64

__all__ = ["random_refusal", "rank_seed", "sync_randomness"]

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
