"""RoPE whose frequencies depend on the sequence length ("dynamic" NTK, "longrope"), from the GLOBAL sequence.

Entry points:
- `install_global_rope(model)` / `remove_global_rope(model)`: on every rotary-embedding module of the model whose
  class forward goes through transformers' `dynamic_rope_update` and whose rope type depends on the length, install
  (and remove, exactly) `global_rope_forward`. `hf_upipe.prepare_model` calls them.
- `global_rope_ready(config)`: whether a prepared model of this config has them installed; the support gate
  (`hf_upipe.adapters.support.config_refusal`) refuses length-dependent RoPE under SP otherwise.

Why: transformers takes the length from the position_ids the rotary module receives (max + 1). Under SP each rank
holds a shard, so rank 0 would pick the short-context frequencies while the last rank picks the long ones. Under
SP, `global_rope_forward` all-reduces the maximum position over the SP group (one tiny collective per model
forward, the same on every rank), runs the class's own forward once on that single position, which updates the
frequencies exactly as for the whole sequence, then computes cos/sin for the shard's real positions with the
undecorated forward. Packed rows: the length is the longest document's, as in transformers. Without SP the class's
forward runs as it is.

Verified sources: `rope_verdict()` accepts `dynamic_rope_update`'s source by its fingerprint in a verified release,
else by `rope_check()`, the shards' cos/sin against the whole sequence's on tiny "dynamic" and "longrope" models
(`hf_upipe.models.verification`). Unverified, nothing is installed and such models stay refused under SP.
"""

from __future__ import annotations

import copy
import inspect
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn

from hf_upipe.distributed import get_sequence_parallel_state, without_sequence_parallel
from hf_upipe.models.verification import Verdict, fingerprint, verify
from hf_upipe.ops.fake import is_fake

__all__ = [
    "ROPE_FINGERPRINTS",
    "global_rope_forward",
    "global_rope_ready",
    "install_global_rope",
    "installable",
    "remove_global_rope",
    "rope_check",
    "rope_update_fingerprint",
    "rope_verdict",
]

# transformers.modeling_rope_utils.dynamic_rope_update in the verified releases (5.23 and 5.24: the same source)
ROPE_FINGERPRINTS = ("c0bc145a218270ce",)
_READY: dict[
    int, weakref.ref
] = {}  # id(config) -> config, for prepared models with the global RoPE installed


def rope_update_fingerprint() -> str:
    from transformers import modeling_rope_utils

    return fingerprint(modeling_rope_utils.dynamic_rope_update)


def _length_dependent(module: nn.Module) -> bool:
    """A rotary module whose forward goes through `dynamic_rope_update` and whose rope type reads the length."""
    kinds = (
        module.rope_type.values()
        if isinstance(getattr(module, "rope_type", None), dict)
        else [getattr(module, "rope_type", "")]
    )
    if not any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
        return False
    fn = type(module).forward
    while fn is not None:  # the decorators copy the name; the code object keeps the wrapper's own
        if "dynamic_rope_update" in getattr(getattr(fn, "__code__", None), "co_qualname", ""):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def global_rope_forward(self, x, position_ids, *args, **kwargs):
    """Installed on length-dependent rotary modules: their frequencies from the global length under SP."""
    state = get_sequence_parallel_state()
    if state is None or state.sp_size == 1:
        return type(self).forward(self, x, position_ids, *args, **kwargs)
    longest = position_ids.max().reshape(1, 1)  # [1, 1]
    if not is_fake(position_ids):  # (a simulation's positions carry no values)
        longest = longest.clone()
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=state.sp_group)
    return _shard_rope(self, x, position_ids, longest, *args, **kwargs)


def _shard_rope(self, x, position_ids, longest, *args, **kwargs):
    """cos/sin of a shard's positions with the frequencies of a sequence whose largest position is `longest`."""
    decorated = type(self).forward
    decorated(
        self, x, longest, *args, **kwargs
    )  # updates the frequencies for the whole sequence; output unused
    with torch.no_grad():
        return inspect.unwrap(decorated)(self, x, position_ids, *args, **kwargs)


def rope_verdict() -> Verdict:
    """Whether `global_rope_forward` computes the whole sequence's cos/sin on the installed transformers: by the
    fingerprint of `dynamic_rope_update` in a verified release, else by `rope_check`
    (`hf_upipe.models.verification`)."""
    try:
        source = rope_update_fingerprint()
    except (ImportError, AttributeError, OSError, TypeError):
        source = None
    return verify("rope", "dynamic_rope_update", source, ROPE_FINGERPRINTS, rope_check)


def rope_check() -> str | None:
    """ "dynamic" (Llama) and "longrope" (Phi-3) rotary modules of tiny models, 40 positions past their original 16:
    two shards' cos/sin as `global_rope_forward` computes them equal the whole sequence's; None, else what
    differed."""

    from hf_upipe.models.probe import case_config

    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0],
        "long_factor": [7.0],
        "partial_rotary_factor": 0.5,
    }
    configs = (
        case_config(
            "llama",
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        case_config("phi3", max_position_embeddings=64, rope_parameters=longrope),
    )
    with without_sequence_parallel():  # the two shards run here in one process, as ranks would
        return _rope_check(configs)


def _rope_check(configs) -> str | None:
    from transformers import AutoModelForCausalLM

    for config in configs:
        model = AutoModelForCausalLM.from_config(config)
        rotary = next((m for m in model.modules() if _length_dependent(m)), None)
        if rotary is None:
            return f"{config.model_type}'s rotary module no longer goes through dynamic_rope_update"
        x, positions = torch.zeros(1, 40, 8), torch.arange(40)[None]  # [1, S, D], [1, S]
        with torch.no_grad():
            want = copy.deepcopy(rotary)(x, positions)
            shards = [
                _shard_rope(
                    copy.deepcopy(rotary),
                    x[:, r * 20 : (r + 1) * 20],
                    positions[:, r * 20 : (r + 1) * 20],
                    positions.max().reshape(1, 1),
                )
                for r in range(2)
            ]
        for name, w, *parts in zip(("cos", "sin"), want, *shards):
            got = torch.cat(parts, dim=1)
            if got.shape != w.shape or not torch.allclose(got, w, rtol=1e-6, atol=1e-6):
                return f"{config.model_type}'s {config.rope_parameters['rope_type']} {name} on two shards differs"
    return None


def installable(model: nn.Module) -> bool:
    """Whether `install_global_rope` handles this model's length-dependent rotary modules (at least one, and the
    verified `dynamic_rope_update`)."""
    return rope_verdict().ok and any(
        _length_dependent(m) or _is_installed(m) for m in model.modules()
    )


def _is_installed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is global_rope_forward


def install_global_rope(model: nn.Module) -> int:
    """Install `global_rope_forward` on the model's length-dependent rotary modules (idempotent); how many."""
    if not rope_verdict().ok:
        return 0
    count = 0
    for module in model.modules():
        if _length_dependent(module) and (
            "forward" not in module.__dict__ or _is_installed(module)
        ):
            module.forward = types.MethodType(global_rope_forward, module)
            config = getattr(module, "config", None)
            if config is not None:
                _READY[id(config)] = weakref.ref(config)
            count += 1
    config = getattr(model, "config", None)
    if count and config is not None:
        _READY[id(config)] = weakref.ref(config)
    return count


def remove_global_rope(model: nn.Module) -> int:
    """Give every such module its class's forward back; how many."""
    count = 0
    for module in model.modules():
        if _is_installed(module):
            del module.forward
            config = getattr(module, "config", None)
            _READY.pop(id(config), None)
            count += 1
    _READY.pop(id(getattr(model, "config", None)), None)
    return count


def global_rope_ready(config) -> bool:
    """Whether a model of this config object (or whose text config it is) has the global RoPE installed."""
    ref = _READY.get(id(config))
    return ref is not None and ref() is config
