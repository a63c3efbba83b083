"""The model names every command understands, and how a name, a file or a Hub id becomes a transformers config.

Entry points:
- `PRESETS`: full-size presets, each a real model's published config.json values (the source named beside each
  row): Llama 3 8B/70B and 3.2 1B/3B, Qwen3 0.6B to 32B and 30B-A3B (MoE), Mistral 7B, Mixtral 8x7B, Gemma 3 1B
  and the language models of 4B/12B/27B, Phi-3-mini and Phi-4. `preset_config(name)`: one as a transformers config.
- `TINY`: the tiny geometry of the self-test. Tiny test models are named "tiny-<model_type>" ("tiny-llama",
  "tiny-qwen3_moe", ...: any causal LM type of the installed transformers), never by a real model's name.
- `model_names()`: the presets, sorted (what `--help` lists); `tiny_names()`: the registry's tiny names.
- `resolve(spec)`: (name, config) for `hf-upipe plan`: a preset, a tiny name, a transformers config, a config.json,
  a local model folder, or a Hub id. A bare model_type ("qwen3") is refused with the closest presets.
- `runnable_config(spec)`: (name, config) for `hf-upipe selftest`, which runs the model on CPU: a preset keeps its
  architecture and head geometry at a tiny width and depth; a tiny name, or a bare model_type (the self-test's
  architecture names, always tiny there), at `SMALL`'s size; a file is used as it is.
- `tiny_config(model_type)`: any causal LM type of the installed transformers at a tiny size (`SMALL`: the usual
  names of widths, depths, heads, experts, latent-attention ranks and state sizes; text sub-configs too), for the
  architecture matrix. Some types do not build this small; they raise.

Names are looked up first, then local paths; only a spec of the form "org/name" that is neither can be a Hugging
Face Hub id, and the Hub is tried only then, after saying so on stderr (`HF_HUB_OFFLINE=1` keeps it offline).
Anything else is an error naming the closest presets (difflib).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys

from hf_upipe.models.architectures import ARCHITECTURES

__all__ = [
    "PRESETS",
    "SMALL",
    "TINY",
    "TINY_PREFIX",
    "model_names",
    "preset_config",
    "resolve",
    "runnable_config",
    "tiny_config",
    "tiny_names",
]

# Full-size presets: each row is the published config.json of a real model (the keys that decide what is built and
# how big: widths, depths, heads, vocabulary, tied embeddings, sliding windows, experts; RoPE scaling and theta
# change no tensor's size and are left at the type's default). model_type first, then the values.
_PRESET_ROWS = {
    # meta-llama/Meta-Llama-3-8B (= Llama-3.1-8B's shape), config.json
    "llama3-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=32,
            vocab_size=128256,
        ),
    ),
    # meta-llama/Meta-Llama-3-70B (= Llama-3.1/3.3-70B's shape), config.json
    "llama3-70b": (
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=80,
            vocab_size=128256,
        ),
    ),
    # meta-llama/Llama-3.2-1B, config.json (tied embeddings)
    "llama3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=16,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    # meta-llama/Llama-3.2-3B, config.json (tied embeddings)
    "llama3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=28,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen/Qwen3-0.6B, -1.7B, -4B (tied embeddings), -8B, -14B, -32B: config.json
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=28,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-1.7b": (
        "qwen3",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=28,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-4b": (
        "qwen3",
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=36,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=36,
            vocab_size=151936,
        ),
    ),
    "qwen3-14b": (
        "qwen3",
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=40,
            vocab_size=151936,
        ),
    ),
    "qwen3-32b": (
        "qwen3",
        dict(
            hidden_size=5120,
            intermediate_size=25600,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=64,
            vocab_size=151936,
        ),
    ),
    # Qwen/Qwen3-30B-A3B, config.json: 128 experts of 768, 8 per token, every layer sparse
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=48,
            vocab_size=151936,
        ),
    ),
    # mistralai/Mistral-7B-v0.3, config.json (no sliding window)
    "mistral-7b": (
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=32,
            vocab_size=32768,
            sliding_window=None,
        ),
    ),
    # mistralai/Mixtral-8x7B-v0.1, config.json: 8 experts, 2 per token
    "mixtral-8x7b": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=32,
            vocab_size=32000,
            sliding_window=None,
        ),
    ),
    # google/gemma-3-1b-pt, config.json (text only; 512-token sliding windows, 5 of every 6 layers)
    "gemma3-1b": (
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            num_hidden_layers=26,
            vocab_size=262144,
            sliding_window=512,
            query_pre_attn_scalar=256,
        ),
    ),
    # google/gemma-3-4b-pt, -12b-pt, -27b-pt: their config.json's text_config, the language model alone (a model
    # folder of the full model also counts its vision tower)
    "gemma3-4b-text": (
        "gemma3_text",
        dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            num_hidden_layers=34,
            vocab_size=262208,
            sliding_window=1024,
            query_pre_attn_scalar=256,
        ),
    ),
    "gemma3-12b-text": (
        "gemma3_text",
        dict(
            hidden_size=3840,
            intermediate_size=15360,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            num_hidden_layers=48,
            vocab_size=262208,
            sliding_window=1024,
            query_pre_attn_scalar=256,
        ),
    ),
    "gemma3-27b-text": (
        "gemma3_text",
        dict(
            hidden_size=5376,
            intermediate_size=21504,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            num_hidden_layers=62,
            vocab_size=262208,
            sliding_window=1024,
            query_pre_attn_scalar=168,
        ),
    ),
    # microsoft/Phi-3-mini-4k-instruct, config.json (sliding window 2047)
    "phi3-mini": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=32,
            num_hidden_layers=32,
            vocab_size=32064,
            sliding_window=2047,
        ),
    ),
    # microsoft/phi-4, config.json (model_type phi3)
    "phi4": (
        "phi3",
        dict(
            hidden_size=5120,
            intermediate_size=17920,
            num_attention_heads=40,
            num_key_value_heads=10,
            num_hidden_layers=40,
            vocab_size=100352,
            sliding_window=None,
        ),
    ),
}
# name -> the preset's config keys, with its model_type (a dict `resolve` turns into the transformers config)
PRESETS = {name: {"model_type": t, **values} for name, (t, values) in _PRESET_ROWS.items()}
# self-test and test models: "tiny-<model_type>" (e.g. "tiny-llama"), any causal LM type at TINY's size
TINY_PREFIX = "tiny-"
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
    """The presets, sorted: every one a real model's published shape (what `--help` lists). Tiny test models are
    named "tiny-<model_type>" (`tiny_names()`), never by a real model's name."""
    return sorted(PRESETS)


def tiny_names() -> list[str]:
    """ "tiny-<model_type>" of every text model of the registry (`hf_upipe.models.architectures`); any other
    causal-LM type
    of the installed transformers is accepted under the same prefix."""
    return sorted(
        TINY_PREFIX + t
        for t, a in ARCHITECTURES.items()
        if not a.text_only and _is_causal_lm_type(t)
    )


def _tiny_type(spec) -> str | None:
    """The model_type of a "tiny-<model_type>" name, else None."""
    if isinstance(spec, str) and spec.startswith(TINY_PREFIX):
        return spec[len(TINY_PREFIX) :]
    return None


def _unknown(spec) -> ValueError:
    """The error of a name that is neither a preset, a tiny name, a path nor a Hub id: the closest presets."""
    text = str(spec).lower()
    close = difflib.get_close_matches(text, model_names(), n=4, cutoff=0.4)
    close += [n for n in model_names() if n.startswith(text.split("-")[0]) and n not in close][:4]
    hint = (
        f"closest presets: {', '.join(close[:6])}"
        if close
        else f"none close; hf-upipe plan --help lists the {len(PRESETS)} presets"
    )
    tiny = (
        f"; for a tiny random test model of that type: {TINY_PREFIX}{spec}"
        if spec in ARCHITECTURES or _is_causal_lm_type(spec)
        else ""
    )
    return ValueError(
        f"model {spec!r} is not a preset ({hint}{tiny}), a config.json or a model folder on this machine, or a "
        "Hugging Face Hub id of the form 'org/name'"
    )


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


def preset_config(name: str):
    """The transformers config of a preset (`PRESETS`), at its published size."""
    from transformers import AutoConfig

    values = dict(PRESETS[name])
    return AutoConfig.for_model(values.pop("model_type"), **values)


def resolve(spec):
    """(name, config) for planning: a preset's transformers config, "tiny-<model_type>", a file, a folder or a Hub
    id (module docstring). A bare model_type ("qwen3") is refused, with the closest presets."""
    from transformers import PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        return spec.model_type, spec
    if isinstance(spec, dict):
        return "custom", dict(spec)
    if isinstance(spec, str) and spec.lower() in PRESETS:  # (case aside: "Qwen3-8B")
        return spec.lower(), preset_config(spec.lower())
    if (tiny := _tiny_type(spec)) is not None:
        if not (tiny in ARCHITECTURES or _is_causal_lm_type(tiny)):
            raise _unknown(spec)
        return spec, tiny_config(tiny)
    if not os.path.exists(str(spec)) and (spec in ARCHITECTURES or _is_causal_lm_type(spec)):
        raise _unknown(spec)
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
    """(name, config) for a run on CPU: presets shrunk to `TINY`'s width and depth with their own type and head
    geometry; "tiny-<model_type>" and a bare model_type (the self-test's architecture names) at `SMALL`'s size;
    files, folders and Hub ids as they are."""
    if isinstance(spec, str) and spec.lower() in PRESETS:
        spec = spec.lower()
        g = PRESETS[spec]
        config = tiny_config(g["model_type"])
        text = config.get_text_config()
        heads, kv = g["num_attention_heads"], g["num_key_value_heads"]
        text.num_attention_heads, text.num_key_value_heads = heads, kv
        text.head_dim = TINY["head_dim"]
        text.hidden_size = TINY["head_dim"] * heads
        return spec, config
    if not os.path.exists(str(spec)) and (spec in ARCHITECTURES or _is_causal_lm_type(spec)):
        spec = TINY_PREFIX + spec
    name, config = resolve(spec)
    config.use_cache = False
    return name, config


def _is_causal_lm_type(name) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return isinstance(name, str) and name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
