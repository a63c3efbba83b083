"""Tiny models for checking an adapter against transformers' own code on the installed release.

Entry points:
- `ADAPTER_CASES`: per fused architecture, what its tiny config sets beyond the geometry, so that every variant the
  adapters handle is exercised: q/k/v/o biases, MoE routing, Granite's multipliers and logit scaling, partial
  rotary (Phi-3), Gemma 3's sliding window (5 tokens, shorter than the checks' sequences) and its local RoPE,
  SmolLM3's NoPE layer, Cohere's logit scale. (The fused check also sets a 5-token window on the types that read
  it from their config: Mistral, Mixtral, Phi-3.)
- `case_config(model_type, heads, kv_heads, head_dim, layers, **overrides)`: that tiny config.
- `model_pair(config, impl, seed)`: a reference model ("sdpa") and a model with `impl`, the same random weights,
  every bias and norm weight perturbed (non-symmetric).
- `with_lora(model, seed)`: the model under PEFT LoRA on every projection (random, non-zero B), or None when peft
  is not installed.
- `compare(reference, model, ids)`: None when logits and every gradient agree (fp32), else what differed.

Used by the behaviour checks of `hf_upipe.models.verification` (and by the tests).
"""

from __future__ import annotations

import copy

import torch

__all__ = ["ADAPTER_CASES", "case_config", "compare", "model_pair", "with_lora"]

_EXPERTS = dict(num_experts_per_tok=2)
ADAPTER_CASES = {
    "llama": dict(attention_bias=True),
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(attention_bias=True),
    "mixtral": dict(num_local_experts=4, **_EXPERTS),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40, **_EXPERTS
    ),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, attention_bias=True, **_EXPERTS),
    "granite": dict(
        attention_multiplier=0.2,
        residual_multiplier=0.7,
        embedding_multiplier=2.0,
        logits_scaling=4.0,
        attention_bias=True,
    ),
    "granitemoe": dict(
        num_local_experts=4, attention_multiplier=0.2, logits_scaling=4.0, **_EXPERTS
    ),
    "olmo2": dict(attention_bias=True),
    "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma": dict(attention_bias=True),
    "gemma3_text": dict(
        query_pre_attn_scalar=12,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "smollm3": dict(
        no_rope_layers=[1, 0], pad_token_id=0
    ),  # no biases: a NoPE layer's k bias has gradient 0
    "cohere": dict(
        logit_scale=0.5, attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2
    ),
}


def case_config(
    model_type: str,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 8,
    layers: int = 2,
    **overrides,
):
    """A `layers`-layer config of `model_type` (its `ADAPTER_CASES` entry applied), large random init (attention
    far from uniform), no dropout, no cache."""
    from transformers import AutoConfig

    kw = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        initializer_range=0.25,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(ADAPTER_CASES.get(model_type, {}))
    for key in ("layer_types", "no_rope_layers"):
        if key in kw:
            kw[key] = (kw[key] * layers)[:layers]
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def model_pair(config, impl: str, seed: int, dtype=torch.float32):
    """Reference model (sdpa) and a model with `impl` holding the same random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype
    )
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl, dtype=dtype
    )
    model.load_state_dict(ref.state_dict())
    # make every bias and norm weight non-trivial so a wrong head or token order cannot hide
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for p, q in zip(ref.parameters(), model.parameters()):
            if p.dim() == 1:
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.3
                p.add_(noise)
                q.add_(noise)
    return ref, model


_LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
]


def with_lora(model, seed: int):
    """`model` under PEFT LoRA (r=4, random non-zero B, no dropout) on every projection; None without peft."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    torch.manual_seed(seed)
    return get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            init_lora_weights=False,
            target_modules=_LORA_TARGETS,
        ),
    )


def _outputs(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Logits and every trainable gradient of a sum-of-logits-squares loss (every output matters)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    (logits.double() ** 2).mean().backward()
    return logits.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


def _worst(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> float | None:
    """The largest |got - want| beyond the tolerance, relative to max |want|; None when within it. The absolute
    tolerance scales with max |want| above 1: fp32 rounding grows with the values' magnitude (a MoE's tiny logits
    of magnitude 6 differ by 26 units in the last place between two correct orders of summation)."""
    if got.shape != want.shape:
        return float("inf")
    scale = max(1.0, float(want.double().abs().max())) if want.numel() else 1.0
    bad = (got.double() - want.double()).abs() > atol * scale + rtol * want.double().abs()
    if not bool(bad.any()):
        return None
    return float(
        (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)
    )


def compare(
    reference, model, ids: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5
) -> str | None:
    """None when `model`'s logits and every gradient equal `reference`'s on `ids` (fp32), else the first that
    differs and by how much (relative to its largest value)."""
    (want, want_grads), (got, got_grads) = _outputs(reference, ids), _outputs(model, ids)
    worst = _worst(got, want, rtol / 10, atol)
    if worst is not None:
        return f"the logits differ by {worst:.2e} (relative)"
    if got_grads.keys() != want_grads.keys():
        return f"other trainable parameters ({sorted(set(got_grads) ^ set(want_grads))[:3]})"
    for name, grad in want_grads.items():
        worst = _worst(got_grads[name], grad, rtol, atol)
        if worst is not None:
            return f"the gradient of {name} differs by {worst:.2e} (relative)"
    return None
