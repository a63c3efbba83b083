"""Tiny random-weight models of the supported architectures, built from configs (no downloads)."""

import copy

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config}


def tiny_config(arch: str, heads: int = 8, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, **overrides):
    """A 2-layer config with the given head geometry and large random init (so attention is far from uniform)."""
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=1024, initializer_range=0.25, tie_word_embeddings=False, use_cache=False)
    if arch == "llama":
        kw["attention_bias"] = True  # exercise the q/k/v/o biases too
    kw.update(overrides)
    return ARCHS[arch](**kw)


def build_pair(config, impl: str, seed: int, dtype=torch.float32):
    """Reference model (sdpa) and a model with `impl` holding the same random weights."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
    model.load_state_dict(ref.state_dict())
    # make every bias and norm weight non-trivial so a wrong head or token order cannot hide
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            if p.dim() == 1:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.3
                p.add_(noise)
                q.add_(noise)
    return ref, model
