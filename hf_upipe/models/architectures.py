"""Everything hf_upipe knows about each transformers architecture, in one registry keyed by `model_type`.

Entry points:
- `ARCHITECTURES`: model_type -> `Architecture`, assembled from the per-family entries of `hf_upipe.models.families`
  (`FUSED`, `VERIFIED_REGISTERED`, `TEXT_ONLY` with `TEXT_MODEL_TYPES`, `VISION`, `ACROSS_DOCUMENTS`: what each
  records is said there, with how an adapter's source is verified). `keeps_documents_apart(config)`.
- `architecture_of(model_or_config)`: the entry of a model (plain or PEFT) or config, or None.
- `fused_attention_classes()`, `tiled_mlp_classes()`, `tiled_norm_classes()`: the module classes
  `hf_upipe.prepare_model` acts on.
- `source_fingerprint(arch, adapter)`: the installed transformers source's fingerprint of what an adapter replaces.
- Re-exported from `hf_upipe.models.architectures`: `model_geometry(config)` (what the planner reads of a model:
  hidden size,
  heads, key-value heads, layers, vocabulary, model_type) and `logit_multiplier(config)` (the factor some
  architectures apply to the lm_head's output, which the tiled loss applies too; `LOGIT_SCALES`).

This module imports no third-party package at import time but torch (through `hf_upipe.models.peft`);
transformers only inside `source_fingerprint`.

What hf_upipe reads off a model's config besides its type: its sizes and the scale of its logits.

Entry points:
- `model_geometry(config)`: what the planner reads of a model (hidden size, heads, key-value heads, layers,
  vocabulary, model_type).
- `logit_multiplier(config)`: the factor some architectures apply to the lm_head's output before the softmax
  (Granite divides by `logits_scaling`, HyperCLOVA X multiplies by it, Cohere multiplies by `logit_scale`), which the
  tiled loss must apply too; 1.0 for the others. The tiled loss checks it against the model's own logits once.
  `LOGIT_SCALES`: model_type -> (config key, power).

Both read a multimodal model's language model (its text config). This module imports nothing.
"""

from __future__ import annotations

import importlib

from hf_upipe.models.families import (
    ACROSS_DOCUMENTS,
    FUSED,
    TEXT_MODEL_TYPES,
    TEXT_ONLY,
    VERIFIED_REGISTERED,
    VISION,
    VISION_TEXT,
    Architecture,
)
from hf_upipe.models.peft import base_model
from hf_upipe.models.verification import fingerprint, underlying

__all__ = [
    "ACROSS_DOCUMENTS",
    "ARCHITECTURES",
    "Architecture",
    "FUSED",
    "LOGIT_SCALES",
    "TEXT_MODEL_TYPES",
    "TEXT_ONLY",
    "VERIFIED_REGISTERED",
    "REFUSED_VISION_TYPES",
    "VISION",
    "architecture_of",
    "fused_attention_classes",
    "keeps_documents_apart",
    "logit_multiplier",
    "model_geometry",
    "source_fingerprint",
    "tiled_mlp_classes",
    "tiled_norm_classes",
    "vlm_type_refusal",
]


# model_type -> (config key, +1: logits * value, -1: logits / value), as each ForCausalLM.forward applies it
LOGIT_SCALES = {
    **{
        t: ("logits_scaling", -1)
        for t in (
            "granite",
            "granitemoe",
            "granitemoeshared",
            "granitemoehybrid",
            "granite_swa",
            "granitemoe_swa",
        )
    },
    "hyperclovax": ("logits_scaling", 1),
    **{t: ("logit_scale", 1) for t in ("cohere", "cohere2", "cohere2_moe", "cohere_compass")},
}


def logit_multiplier(config) -> float:
    """See the module docstring (`config`: a transformers config, of a plain or multimodal model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    key, power = LOGIT_SCALES.get(getattr(config, "model_type", None), (None, 1))
    value = getattr(config, key, None) if key else None
    return 1.0 if value is None else float(value) ** power


def model_geometry(config) -> dict:
    """hidden, heads, kv_heads, layers, vocab and model_type of a transformers config (its language model's, for a
    multimodal one), or of a dict of its keys."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": get("num_key_value_heads") or heads,
        "layers": get("num_hidden_layers"),
        "vocab": get("vocab_size"),
        "model_type": get("model_type", "llama"),
    }


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        *FUSED,
        *(Architecture(model_type, fused=False, tiled=False) for model_type in VERIFIED_REGISTERED),
        *(
            Architecture(model_type, fused=False, tiled=False, text_only=True)
            for model_type in TEXT_ONLY
        ),
        *(Architecture(model_type, fused=False, tiled=False, vision=True) for model_type in VISION),
        *(Architecture(model_type, fused=False, tiled=False) for model_type in VISION_TEXT),
        *(
            Architecture(model_type, fused=False, tiled=False, packed_documents=False)
            for model_type in ACROSS_DOCUMENTS
        ),
    )
}


def keeps_documents_apart(config) -> bool:
    """`Architecture.packed_documents` of a config (True for a type hf_upipe does not know: its mask decides)."""
    arch = architecture_of(config) if config is not None else None
    return arch is None or arch.packed_documents


def _config_of(obj):
    config = getattr(base_model(obj), "config", obj)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def architecture_of(model_or_config) -> Architecture | None:
    """The registry entry of a transformers model (plain or PEFT) or config, by `model_type`; None if unknown."""
    return ARCHITECTURES.get(getattr(_config_of(model_or_config), "model_type", None))


def fused_attention_classes() -> dict[str, Architecture]:
    """Attention class name -> architecture, for the architectures with the fused adapter."""
    return {a.attention: a for a in ARCHITECTURES.values() if a.fused}


def tiled_mlp_classes() -> dict[str, Architecture]:
    """MLP class name -> architecture, for the architectures with the tiled adapter."""
    return {a.mlp: a for a in ARCHITECTURES.values() if a.tiled and a.mlp}


def tiled_norm_classes() -> dict[str, Architecture]:
    """Norm class name -> architecture, for the architectures with the tiled adapter."""
    return {a.norm: a for a in ARCHITECTURES.values() if a.tiled and a.norm}


def source_fingerprint(arch: Architecture, adapter: str) -> str | None:
    """The installed transformers' fingerprint of what `adapter` ("fused" or "tiled") replaces or relies on; None
    when part of it cannot be read (then the adapter is checked by behaviour, `hf_upipe.models.verification.verify`).

    Classes are found by name in the family's modeling module, as `prepare_model` finds the modules it adapts.
    Helpers a class's forward calls by name (the RoPE functions) are found where that forward finds them at run
    time, its own globals, not where transformers keeps them; a decorator or a callable wrapper object (a Hub-kernel
    `Func`) is read through to the function it runs (`underlying`). A helper reached another way (an attribute of
    another module, say) is not found: the fingerprint is None, and the adapter's check decides."""
    name = arch.module or arch.model_type
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        sources = arch.fused_sources() if adapter == "fused" else arch.tiled_sources()
        owner = getattr(module, arch.attention, None) if adapter == "fused" else None
        scope = vars(module)
        if owner is not None:  # where the attention's forward looks its helpers up
            scope = getattr(underlying(owner.forward), "__globals__", scope)
        objects = []
        for source in sources:
            head, *rest = source.split(".")
            obj = scope[head] if not rest and head in scope else getattr(module, head)
            for part in rest:
                obj = getattr(obj, part)
            objects.append(obj)
        return fingerprint(*objects)
    except (ImportError, AttributeError, KeyError, OSError, TypeError):
        return None


# vision-language types known not to fit: model_type -> why (the support gate names it)
REFUSED_VISION_TYPES = {
    "qwen3_vl": (
        "Qwen3-VL's deepstack adds visual features inside the first decoder layers at the image tokens' "
        "positions (visual_pos_masks), which the whole-sequence merge does not carry into each shard"
    ),
    "qwen3_vl_moe": (
        "Qwen3-VL-MoE's deepstack adds visual features inside the first decoder layers at the image tokens' "
        "positions (visual_pos_masks), which the whole-sequence merge does not carry into each shard"
    ),
}


def vlm_type_refusal(model_type) -> str | None:
    """Why a vision-language `model_type` cannot run under SP with its images merged whole, or None (the support
    gate names it for an unverified multimodal type)."""
    if model_type in REFUSED_VISION_TYPES:
        return f"{model_type}: {REFUSED_VISION_TYPES[model_type]}"
    if model_type not in VISION:
        return (
            f"{model_type!r} is not a vision-language type verified under sequence parallelism with its images "
            f"merged whole before the sequence is sharded (verified: {list(VISION)}; hf_upipe.vlm)"
        )
    return None
