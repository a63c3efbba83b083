"""The model names every command understands, and how a name, a file or a Hub id becomes a transformers config.

Entry points:
- `PRESETS`: full-size geometries for planning ("llama3-8b", "qwen3-32b-shape", "llama3-70b"; Llama-shaped).
- `TINY`: the tiny geometry of the self-test; every architecture of the registry (`hf_upipe.architectures`:
  "llama", "mistral", "qwen2", "qwen3") is a name too, built at that size.
- `model_names()`: all of the above, sorted (what `--help` and errors list).
- `resolve(spec)`: (name, config) for `hf-upipe plan`: a preset (its geometry dict), a tiny architecture name, a
  transformers config, a config.json, a local model folder, or a Hub id.
- `runnable_config(spec)`: (name, config) for `hf-upipe selftest`, which runs the model on CPU: a preset keeps its
  architecture and head geometry at `TINY`'s width and depth; a tiny name or a file is used as it is.

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

__all__ = ["PRESETS", "TINY", "model_names", "resolve", "runnable_config"]

PRESETS = {  # hidden, intermediate, heads, kv_heads, head_dim, layers, vocab (keys of transformers.LlamaConfig)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=32, vocab_size=128256),
    "qwen3-32b-shape": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=128, num_hidden_layers=64, vocab_size=151936),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=80, vocab_size=128256),
}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, initializer_range=0.2,
            tie_word_embeddings=False, use_cache=False)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_names() -> list[str]:
    return sorted(PRESETS) + sorted(ARCHITECTURES)


def _unknown(spec) -> ValueError:
    return ValueError(f"model {spec!r} is not a name hf_upipe knows ({', '.join(model_names())}), a config.json or a "
                      "model folder on this machine, or a Hugging Face Hub id of the form 'org/name'")


def _tiny(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


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
    print(f"hf_upipe: {spec!r} is not a name hf_upipe knows or a local path; reading its config from the Hugging "
          "Face Hub (set HF_HUB_OFFLINE=1 to stay offline)", file=sys.stderr)
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise ValueError(f"model {spec!r}: not found locally and not readable from the Hub ({err})") from None


def resolve(spec):
    """(name, config) for planning: a preset's geometry dict, else a transformers config (module docstring)."""
    from transformers import PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        return spec.model_type, spec
    if isinstance(spec, dict):
        return "custom", dict(spec)
    if spec in PRESETS:
        return spec, dict(PRESETS[spec])
    if spec in ARCHITECTURES:
        return spec, _tiny(spec)
    return spec, _from_path_or_hub(str(spec))


def runnable_config(spec: str):
    """(name, config) for a run on CPU: presets shrunk to `TINY`'s width and depth with their own head geometry."""
    if spec in PRESETS:
        g = PRESETS[spec]
        return spec, _tiny("llama", num_attention_heads=g["num_attention_heads"],
                           num_key_value_heads=g["num_key_value_heads"],
                           hidden_size=TINY["head_dim"] * g["num_attention_heads"])
    name, config = resolve(spec)
    config.use_cache = False
    return name, config
