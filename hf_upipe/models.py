"""The model names every command understands, and how a name, a file or a Hub id becomes a transformers config.

Entry points:
- `PRESETS`: full-size geometries for planning ("llama3-8b", "qwen3-32b-shape", "llama3-70b"; Llama-shaped).
- `TINY`: the tiny geometry of the self-test; every architecture of the registry (`hf_upipe.architectures`:
  "llama", "mistral", "qwen3_moe", "deepseek_v3", ...; not the multimodal types verified for text only) is a name
  too, built at that size.
- `model_names()`: all of the above, sorted (what `--help` and errors list).
- `resolve(spec)`: (name, config) for `hf-upipe plan`: a preset (its geometry dict), a tiny architecture name, a
  transformers config, a config.json, a local model folder, or a Hub id.
- `runnable_config(spec)`: (name, config) for `hf-upipe selftest`, which runs the model on CPU: a preset keeps its
  architecture and head geometry at `TINY`'s width and depth; a tiny name or a file is used as it is; any other
  causal-LM `model_type` of the installed transformers ("gpt2", "qwen3_next", ...) is built by `tiny_config`.
- `tiny_config(model_type)`: any causal LM type of the installed transformers at a tiny size (`SMALL`: the usual
  names of widths, depths, heads, experts, latent-attention ranks and state sizes; text sub-configs too), for the
  architecture matrix. Some types do not build this small; they raise.

Names are looked up first, then local paths; only a spec of the form "org/name" that is neither can be a Hugging
Face Hub id, and the Hub is tried only then, after saying so on stderr (`HF_HUB_OFFLINE=1` keeps it offline).
Anything else is an error listing the names.
"""

from __future__ import annotations

import json
import os
import re
import sys

from hf_upipe.architectures import ARCHITECTURES

__all__ = ["PRESETS", "SMALL", "TINY", "model_names", "resolve", "runnable_config", "tiny_config"]

PRESETS = {  # hidden, intermediate, heads, kv_heads, head_dim, layers, vocab (keys of transformers.LlamaConfig)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=32,
        vocab_size=128256,
    ),
    "qwen3-32b-shape": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=64,
        vocab_size=151936,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=80,
        vocab_size=128256,
    ),
}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=4096,
    initializer_range=0.2,
    tie_word_embeddings=False,
    use_cache=False,
)
# every causal LM type at a tiny size: the common names of widths, depths and heads, and of the parts that MoE,
# latent-attention, state-space and linear-attention layers add (a config ignores names it does not use)
SMALL = dict(
    TINY,
    max_position_embeddings=512,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    moe_num_experts=4,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    qk_head_dim=16,
    state_size=8,
    ssm_state_size=8,
    mamba_d_state=8,
    mamba_n_heads=4,
    mamba_head_dim=16,
    mamba_d_head=16,
    mamba_d_conv=4,
    conv_kernel=4,
    mamba_expand=2,
    n_groups=1,
    mamba_n_groups=1,
    time_step_rank=8,
    n_group=1,
    topk_group=1,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    attention_dropout=0.0,
    pad_token_id=0,  # windows: each type's default
    rotary_dim=8,
    logits_scaling=4.0,
    logit_scale=0.5,  # not 1: a loss that forgot the model's logit scaling must show
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_names() -> list[str]:
    """The presets and the registry's text models (multimodal types verified for text only are built by
    `runnable_config` like any other causal-LM type, not planned by name; nor are the text configs of multimodal
    types, e.g. emu3_text_model, which transformers builds only inside their multimodal type)."""
    return sorted(PRESETS) + sorted(
        t for t, a in ARCHITECTURES.items() if not a.text_only and _is_causal_lm_type(t)
    )


def _unknown(spec) -> ValueError:
    return ValueError(
        f"model {spec!r} is not a name hf_upipe knows ({', '.join(model_names())}), a config.json or a "
        "model folder on this machine, or a Hugging Face Hub id of the form 'org/name'"
    )


def _tiny(model_type: str, **overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    _no_dropout(config)
    return config


def _from_path_or_hub(spec: str):
    from transformers import AutoConfig

    if os.path.isfile(spec):
        if os.path.basename(spec) == "config.json":
            return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(spec)))
        with open(spec) as f:
            return AutoConfig.for_model(**json.load(f))
    if os.path.isdir(spec):
        return AutoConfig.from_pretrained(spec)
    if not _HUB_ID.match(spec):
        raise _unknown(spec)
    print(
        f"hf_upipe: {spec!r} is not a name hf_upipe knows or a local path; reading its config from the Hugging "
        "Face Hub (set HF_HUB_OFFLINE=1 to stay offline)",
        file=sys.stderr,
    )
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model {spec!r}: not found locally and not readable from the Hub ({err})"
        ) from None


def resolve(spec):
    """(name, config) for planning: a preset's geometry dict, else a transformers config (module docstring)."""
    from transformers import PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        return spec.model_type, spec
    if isinstance(spec, dict):
        return "custom", dict(spec)
    if spec in PRESETS:
        return spec, dict(PRESETS[spec])
    if spec in ARCHITECTURES or _is_causal_lm_type(spec):
        return spec, tiny_config(spec)
    return spec, _from_path_or_hub(str(spec))


# Mamba2 hybrids that check mamba heads * head width == mamba_expand * hidden_size (2 * 64 = 4 * 32)
# (Falcon-H1's mamba_d_ssm None: its mixer width from mamba_expand)
_TYPE_SIZES = {
    "bamba": dict(mamba_d_head=32),
    "granitemoehybrid": dict(mamba_d_head=32),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=None),
    "mamba2": dict(num_heads=4, head_dim=32),
    "zamba2": dict(
        n_mamba_heads=4,
        mamba_headdim=32,
        layer_types=["linear_attention", "hybrid"],
        hybrid_layer_ids=[1],
    ),
}
# types whose defaults do not build at SMALL's sizes: per-layer-input embeddings of a 262k vocabulary and 512-wide
# global heads (Gemma 4: none of its layers share keys and values, as by default; the support gate refuses its KV
# sharing), KV sharing over more layers than there are (Gemma 3n: 4 layers, the last 2 sharing), no
# default layer_types (LFM2-MoE: a convolution, then attention), and DBRX, whose attention reads
# attn_config.rope_theta (absent from its config class; real checkpoints carry it) and clamps with clip_qkv, and
# whose ffn_config takes d_model before SMALL's hidden_size is applied
_PER_LAYER = dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8)
_TYPE_SIZES.update(
    {
        **{t: dict(_PER_LAYER, global_head_dim=16) for t in ("gemma4", "gemma4_text")},
        "gemma3n_text": dict(
            _PER_LAYER,
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
        # a gated-DeltaNet layer and an attention layer (its default pattern, 3 + 1, has none in 2 layers), whose
        # attention is always "indexed_attention" (the QSA indexer, which needs its sizes)
        **{
            t: dict(
                layer_types=["linear_attention", "full_attention"],
                indexer_n_heads=2,
                indexer_kv_heads=1,
                indexer_head_dim=16,
                indexer_budget=8,
                indexer_compress_ratio=4,
            )
            for t in ("qwen4_exp", "qwen4_exp_text")
        },
        "dbrx": dict(
            d_model=64,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        ),
    }
)


def tiny_config(model_type: str):
    """The installed transformers' config of `model_type` at `SMALL`'s sizes (its text sub-config too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    text = getattr(cls, "sub_configs", {}).get("text_config")
    text_cls = text if isinstance(text, type) and text.__name__ != "AutoConfig" else None
    small = dict(SMALL, **_TYPE_SIZES.get(model_type, {}))
    while True:
        try:
            if text is None:
                config = cls(**small)
            else:
                config = cls(text_config=text_cls(**small) if text_cls is not None else dict(small))
            break
        except (
            AttributeError
        ) as err:  # e.g. Falcon's head_dim, a read-only property: leave that name out
            name = next((k for k in small if f"'{k}'" in str(err)), None)
            if name is None:
                raise
            del small[name]
    config.use_cache = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if hasattr(
        type(text), "kv_lora_rank"
    ):  # latent attention (MLA): keys/values expand to every query head
        text.num_key_value_heads = text.num_attention_heads
    _no_dropout(config)
    return config


def _no_dropout(config) -> None:
    """Every dropout probability and router jitter of the config (and its sub-configs) to 0: comparisons need
    deterministic models."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "jitter")):
            setattr(config, key, 0.0)
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _no_dropout(sub)


def runnable_config(spec: str):
    """(name, config) for a run on CPU: presets shrunk to `TINY`'s width and depth with their own head geometry."""
    if spec in PRESETS:
        g = PRESETS[spec]
        return spec, _tiny(
            "llama",
            num_attention_heads=g["num_attention_heads"],
            num_key_value_heads=g["num_key_value_heads"],
            hidden_size=TINY["head_dim"] * g["num_attention_heads"],
        )
    name, config = resolve(spec)
    config.use_cache = False
    return name, config


def _is_causal_lm_type(name) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return isinstance(name, str) and name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
