"""What hf_upipe reads off a model's config besides its type: its sizes and the scale of its logits.

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

__all__ = ["LOGIT_SCALES", "logit_multiplier", "model_geometry"]


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
