"""The support gate: a model runs under sequence parallelism only if hf_upipe handles every part of it exactly.

Entry points:
- `config_refusal(config, seq_len=None, *, allow_unverified=False)`: why a model of this config cannot run exactly
  under SP, or None. From the config alone: `layer_types` of attention hf_upipe does not implement (indexed,
  compressed, relative-bias attention), Qwen4-Exp's PLE layers, Gemma 4's KV sharing; an architecture the registry
  (`hf_upipe.models.architectures`) does not list as verified, named by the mechanism that refuses it where one is
  known (a
  module or an attention that `model_refusal` finds in a model of the config built on the meta device, or one the
  architecture matrix measured), else as not verified; the convolution or linear-attention layers of a hybrid (even
  of a verified family) that `prepare_model` has not prepared; RoPE whose frequencies depend on the sequence length
  ("dynamic", "longrope"), which every rank would derive from its own shard, unless `prepare_model` made the
  model's rotary modules take the global length (`hf_upipe.adapters.rope`). (Sliding windows are implemented:
  `hf_upipe.ops.windowed`; `seq_len`, the full length, is accepted for the callers' sake.) What the mask and
  attention functions check at the first call of a forward.
- `model_refusal(model, *, allow_unverified=False)`: the same for a loaded model, naming the module that is not
  handled (a Mamba/SSM layer, a linear-attention or short-convolution layer, attention that does not go through
  transformers' attention interface, a forward another library replaced that hf_upipe cannot see through:
  `hf_upipe.adapters.replaced`, e.g. Liger's fused linear cross-entropy, or a kernel that does not run here)
  where there is one. What `prepare_model` and the Trainer/plugin setup check.
- `sdpa_refusal(config)`: without SP "upipe" is "sdpa"; a model class that does not support "sdpa" is refused by
  "upipe" too, as transformers refuses it for "sdpa".
- `refusal_error(reason)`: the NotImplementedError to raise, with what to do.

The registry lists an architecture as verified once `benchmarks/architecture_matrix.py` (and its test) found it
exact at SP 2 against one process; everything else is refused until verified. `hf-upipe selftest --model <yours>`
verifies a model; `UPipeConfig(allow_unverified=True)` / `UPIPE_ALLOW_UNVERIFIED=1` /
`init_sequence_parallel(allow_unverified=True)` then runs an unverified architecture (the feature checks above
still apply).
"""

from __future__ import annotations

import functools

from torch import nn

from hf_upipe.adapters.delta_rule import DELTA_KERNELS
from hf_upipe.adapters.mixers import (
    HALO_MIXERS,
    MIXER_LAYER_TYPES,
    MIXERS,
    mixer_verdict,
    mixers_ready,
    supported,
)
from hf_upipe.adapters.replaced import base_refusal
from hf_upipe.adapters.rope import global_rope_ready, installable, rope_verdict
from hf_upipe.models.architectures import ARCHITECTURES, REFUSED_VISION_TYPES, vlm_type_refusal
from hf_upipe.models.peft import base_model
from hf_upipe.models.verification import TESTED_RANGE, VERIFIED_RELEASES, installed_version

__all__ = ["config_refusal", "model_refusal", "refusal_error", "sdpa_refusal"]

# class-name fragments of token mixers other than attention, and why they cannot run on a shard alone
_MIXERS = (
    ("Mamba", "a Mamba/SSM layer mixes tokens across the whole sequence outside attention"),
    (
        "GatedDeltaNet",
        "a gated-DeltaNet (linear attention) layer carries a state across the whole sequence",
    ),
    ("DeltaNet", "a DeltaNet (linear attention) layer carries a state across the whole sequence"),
    ("LinearAttention", "a linear-attention layer carries a state across the whole sequence"),
    ("Lightning", "a lightning-attention layer carries a state across the whole sequence"),
    ("ShortConv", "a short convolution mixes neighbouring tokens across shard boundaries"),
    ("Recurrent", "a recurrent layer carries a state across the whole sequence"),
    ("Rwkv", "an RWKV layer carries a state across the whole sequence"),
    ("xLSTM", "an xLSTM layer carries a state across the whole sequence"),
    ("Mixer", "a token-mixing layer other than attention"),
)
_LENGTH_ROPE = ("dynamic", "longrope")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_type(config) -> str | None:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict):
            for value in (params, *[v for v in params.values() if isinstance(v, dict)]):
                kind = value.get("rope_type") or value.get("type")
                if kind:
                    return str(kind)
    return None


_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
_PER_TOKEN_LAYERS = (
    "mlp",
    "moe",
)  # Nemotron-H's layers with only an MLP or MoE block: nothing mixes tokens


# layer types whose attention hf_upipe does not implement, and what they are (the rest are named generically)
_LAYER_MECHANISMS = {
    "indexed_attention": "sparse attention whose indexer picks each query's keys from the whole sequence and "
    "combines its picks with the mask (DeepSeek V3.2's lightning indexer, Qwen4-Exp's QSA)",
    "compressed_sparse_attention": "DeepSeek V4's compressed sparse attention (keys and values compressed over "
    "blocks of tokens, and an indexer over the compressed blocks)",
    "heavily_compressed_attention": "DeepSeek V4's heavily compressed attention (keys and values compressed over "
    "blocks of 128 tokens of the whole sequence)",
    "hybrid_sliding": "Inkling's sliding-window attention with a learned relative position bias (passed as "
    "`position_bias`, which 'upipe' does not implement)",
}
# mechanisms the matrix measured opted in that no check of the config or of the built modules finds: the model's
# own code does what 'upipe' cannot serve under SP (model_type -> mechanism)
_MEASURED = {
    "doge": "its own masking code computes with attention_mask as a tensor (attention_mask.dtype), but under sequence "
    "parallelism 'upipe' hands the layers a description of the mask, not an [S, S] tensor",
    "dory": "its lm_head is a DoryLMHead, not a plain nn.Linear, whose weight hf_upipe's tiled loss cannot read, so "
    "the architecture matrix could not compare it under sequence parallelism (with tiled_loss=False it is "
    "unmeasured: check it with `hf-upipe selftest` before opting in)",
}
_UNVERIFIED = "hf_upipe has not verified model_type"
_SLICED_KV_SHARING = (
    "gemma4_text",
    "gemma4_unified_text",
)  # `_maybe_slice_kv_shared_inputs` slices the masks


def config_refusal(
    config, seq_len: int | None = None, *, allow_unverified: bool = False, prepared: bool = False
) -> str | None:
    """See the module docstring. `prepared`: the caller runs the model through `prepare_model` first (which makes
    supported mixers run across shards and length-dependent RoPE take the global length, and checks that it could:
    `model_refusal`); otherwise both need a prepared model of `config`.

    For an unverified type (not opted in) the reason names the mechanism that refuses it where one is known (its
    layer types, a module or an attention that `model_refusal` finds in a model of `config` built on the meta
    device, or `_MEASURED`), else says that it is not verified: deterministic, the same on every rank."""
    return _config_refusal(config, allow_unverified, prepared, scanned=False)


def _config_refusal(config, allow_unverified: bool, prepared: bool, scanned: bool) -> str | None:
    """`config_refusal`; `scanned`: the caller (`model_refusal`) already looked for a mechanism in the modules."""
    model_type = getattr(
        config, "model_type", None
    )  # the whole model's: a multimodal model is its own type
    whole = config
    global_rope, mixers = prepared or global_rope_ready(config), prepared or mixers_ready(config)
    config = _text_config(config)
    global_rope, mixers = global_rope or global_rope_ready(config), mixers or mixers_ready(config)
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(
        {
            t
            for t in layer_types
            if t not in _ATTENTION_LAYERS + _PER_TOKEN_LAYERS + MIXER_LAYER_TYPES
        }
    )
    if other:  # a mechanism whatever the registry says
        return _layer_types_reason(other)
    if (
        getattr(config, "num_kv_shared_layers", 0)
        and getattr(config, "model_type", None) in _SLICED_KV_SHARING
    ):
        return (
            f"its last {config.num_kv_shared_layers} layers share keys and values, and at the first of them "
            "transformers' Gemma 4 code slices the attention masks as tensors, but under sequence parallelism "
            "'upipe' hands the layers a description of the mask, not an [S, S] tensor (measured: a TypeError)"
        )
    if getattr(
        config, "ple_layer_ids", None
    ):  # measured wrong at SP 2 (the architecture matrix's qwen4_exp, PLE on)
        return (
            "its ple_layer_ids layers add n-gram embeddings of the previous tokens' ids and a convolution over "
            "them (Qwen4-Exp's PLE), which reach across shard boundaries: hf_upipe does not run them under "
            "sequence parallelism"
        )
    arch = ARCHITECTURES.get(model_type)
    if (arch is None or not arch.verified) and not allow_unverified:
        return _unverified_reason(whole, model_type, scanned)
    pending = sorted({t for t in layer_types if t in MIXER_LAYER_TYPES}) if not mixers else []
    if pending:
        return _layer_types_reason(pending) + (
            " (its gated-DeltaNet, Mamba2 or short-convolution layers run across "
            "shards once hf_upipe.prepare_model(model) prepared it)"
        )
    rope = _rope_type(config)
    if rope in _LENGTH_ROPE and not global_rope:
        return (
            f"RoPE of type {rope!r} derives its frequencies from the sequence length, which each rank would take "
            "from its own shard: call hf_upipe.prepare_model(model) (the Trainer and the plugin do), which makes "
            "it take the global length"
        )
    return None


def _layer_types_reason(other: list[str]) -> str:
    known = "; ".join(f"{t!r}: {_LAYER_MECHANISMS[t]}" for t in other if t in _LAYER_MECHANISMS)
    return (
        f"its layer_types include {other}: layers other than full or sliding-window attention (token mixers "
        "such as convolutions or linear attention, or attention of another kind), which hf_upipe does not "
        "implement under sequence parallelism and which would run on each rank's shard alone"
        + (f" ({known})" if known else "")
    )


def _unverified_reason(config, model_type, scanned: bool) -> str:
    """The mechanism that refuses an unverified type, or that it is not verified (`config_refusal`)."""
    # a vision-language type that hf_upipe.vlm does not shard
    vision = getattr(config, "vision_config", None) is not None
    if vision and model_type in REFUSED_VISION_TYPES:
        return vlm_type_refusal(model_type)
    mechanism = _MEASURED.get(model_type) or (None if scanned else _built_mechanism(config))
    if mechanism is not None:
        return mechanism
    if vision:
        return vlm_type_refusal(model_type)
    return (
        f"{_UNVERIFIED} {model_type!r} under sequence parallelism (it is not in the architecture registry, "
        "hf_upipe/models/architectures.py)"
    )


def _built_mechanism(config) -> str | None:
    """What `model_refusal` (opted in) finds in a model of `config` built on the meta device: no weights, no random
    numbers drawn, the same on every rank; None when nothing is found or transformers cannot build it."""
    import copy
    import logging

    import torch

    try:
        from transformers import AutoModelForCausalLM

        quiet = logging.getLogger("transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # the config's own warnings were given when it was made
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        finally:
            quiet.setLevel(level)
    except Exception:  # noqa: BLE001  (not a causal LM transformers builds from this config: nothing to name)
        return None
    return model_refusal(model, allow_unverified=True) or _head_mechanism(model)


def _head_mechanism(model: nn.Module) -> str | None:
    """An lm_head that is not a plain nn.Linear (Ergo's fp32-output head, Dory's): the tiled loss cannot read its
    weight, so the architecture matrix could not compare the type under SP; None for a plain head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or type(head) is nn.Linear:
        return None
    return (
        f"its lm_head is a {type(head).__name__}, not a plain nn.Linear, whose weight hf_upipe's tiled loss cannot "
        "read, so the architecture matrix could not compare it under sequence parallelism (with tiled_loss=False "
        "it is unmeasured: check it with `hf-upipe selftest` before opting in)"
    )


def _hybrid_on_interface(base: nn.Module) -> bool:
    """A hybrid (transformers marks hybrids not backend-compatible) whose token mixers are ones hf_upipe runs across
    shards and whose every other *Attention module (if any) calls transformers' attention interface in its forward."""
    import inspect

    modules = list(base.modules())
    if not any(supported(m) for m in modules):
        return False
    attention = {
        type(m) for m in modules if type(m).__name__.endswith("Attention") and not supported(m)
    }
    try:
        return all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward) for cls in attention)
    except (OSError, TypeError):
        return False


def _version_note(verdict) -> str:
    return (
        f": it is not verified on transformers {installed_version()} ({verdict.detail}); it is verified on "
        f"{', '.join(VERIFIED_RELEASES)}: pip install '{TESTED_RANGE}'"
    )


def _unverified_mixer(module: nn.Module) -> str:
    """Why a mixer of a class hf_upipe runs across shards is not run here: the installed transformers, or its
    kernel; "" for a class hf_upipe does not run."""
    name = type(module).__name__
    if name not in MIXERS and name not in HALO_MIXERS:
        return ""
    verdict = mixer_verdict(type(module))
    if not verdict.ok:
        return f". hf_upipe runs {name} across shards, but{_version_note(verdict)[1:]}"
    return (
        f". hf_upipe runs {name} across shards, but its forward no longer calls the kernel it wraps "
        f"({DELTA_KERNELS.get(name)}): load the model with transformers' own kernels"
    )


def model_refusal(model: nn.Module, *, allow_unverified: bool = False) -> str | None:
    """See the module docstring."""
    base = base_model(model)
    replaced = base_refusal(base)  # PEFT unwrapped once, here
    if replaced is not None:
        return replaced
    # a mixer run across shards once prepared (hf_upipe.adapters.mixers), its own submodules (its gated norm),
    # and what holds one (its decoder layer, a pure Mamba2 model) are not refused by their names
    mixers = {id(m) for m in base.modules() if supported(m)}
    inside = {id(m) for mixer in base.modules() if id(mixer) in mixers for m in mixer.modules()}
    for module in base.modules():
        if id(module) in inside or any(id(m) in mixers for m in module.modules()):
            continue
        name = type(module).__name__
        for fragment, why in _MIXERS:
            if fragment in name and not name.endswith(("Attention", "Norm", "RMSNorm")):
                return f"{name}: {why}{_unverified_mixer(module)}"
    config = getattr(base, "config", None)
    if config is None:
        return None
    is_compatible = getattr(type(base), "is_backend_compatible", None)
    if callable(is_compatible) and not is_compatible() and not _hybrid_on_interface(base):
        return (
            f"{type(base).__name__}'s attention does not go through transformers' attention interface, so "
            "attn_implementation='upipe' never runs in it"
        )
    text = _text_config(config)
    linear = sum(t in MIXER_LAYER_TYPES for t in getattr(text, "layer_types", None) or ())
    handled = sum(supported(m) for m in base.modules())
    if linear and handled < linear:  # every mixer layer needs a mixer hf_upipe runs across shards
        return (
            f"{linear} of its layer_types are {list(MIXER_LAYER_TYPES)} but only {handled} of its modules are "
            "mixers hf_upipe runs across shards (hf_upipe/adapters/mixers.py); the others would see their "
            "shard alone"
        )
    rope = _rope_type(text)
    if rope in _LENGTH_ROPE and not installable(base):
        verdict = rope_verdict()
        return (
            f"RoPE of type {rope!r} derives its frequencies from the sequence length, which each rank would take "
            "from its own shard, and hf_upipe cannot make this model's rotary modules take the global length "
            f"(hf_upipe/adapters/rope.py){'' if verdict.ok else _version_note(verdict)}"
        )
    return _config_refusal(config, allow_unverified, prepared=True, scanned=True)


@functools.lru_cache(maxsize=256)
def _supports_sdpa(model_type: str) -> bool:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return bool(getattr(cls, "_supports_sdpa", True)) if cls is not None else True


def sdpa_refusal(config) -> str | None:
    """See the module docstring."""
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and not _supports_sdpa(model_type):
        return (
            f"model_type {model_type!r} does not support 'sdpa', and 'upipe' without sequence parallelism is "
            "'sdpa': load it with its own attention implementation (e.g. 'eager') when not using SP"
        )
    return None


def refusal_error(reason: str) -> NotImplementedError:
    """The error for `reason`; for an unverified architecture it says how to verify and opt in."""
    advice = (
        "Check it with `hf-upipe selftest --model <your model>`, then opt in with "
        "UPipeConfig(allow_unverified=True) / UPIPE_ALLOW_UNVERIFIED=1 / init_sequence_parallel("
        "allow_unverified=True); or train without sequence parallelism (sp_size=1)."
        if reason.startswith(_UNVERIFIED)
        else "Train it without sequence parallelism (sp_size=1), or change what the reason names."
    )
    return NotImplementedError(
        f"This model cannot run under sequence parallelism with hf_upipe: {reason}. Nothing "
        f"was computed. {advice}"
    )
