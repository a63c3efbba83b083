"""Tiny random-weight models of the supported architectures, built from configs (no downloads)."""

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# the fused architectures (hf_upipe.architectures.FUSED) and what each tiny config sets beyond the geometry, so
# that every variant the fused block handles is exercised: biases, MoE routing, Granite's multipliers, partial
# rotary (Phi-3), Gemma 3's sliding window (5 tokens, shorter than the tests' sequences) and its local RoPE,
# SmolLM3's NoPE layer, Cohere's logit scale
_EXPERTS = dict(num_experts_per_tok=2)
ARCHS = {
    "llama": dict(attention_bias=True),  # exercise the q/k/v/o biases too
    "mistral": {},
    "qwen2": {},
    "qwen3": dict(attention_bias=True),
    "mixtral": dict(num_local_experts=4, **_EXPERTS),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40, **_EXPERTS),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, attention_bias=True, **_EXPERTS),
    "granite": dict(attention_multiplier=0.2, residual_multiplier=0.7, embedding_multiplier=2.0, logits_scaling=4.0,
                    attention_bias=True),
    "granitemoe": dict(num_local_experts=4, attention_multiplier=0.2, logits_scaling=4.0, **_EXPERTS),
    "olmo2": dict(attention_bias=True),
    "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma": dict(attention_bias=True),
    "gemma3_text": dict(query_pre_attn_scalar=12, sliding_window=5, layer_types=["sliding_attention",
                                                                                 "full_attention"]),
    "smollm3": dict(no_rope_layers=[1, 0], pad_token_id=0),  # no biases: a NoPE layer's k bias has gradient 0
    "cohere": dict(logit_scale=0.5, attention_bias=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def tiny_config(arch: str, heads: int = 8, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, **overrides):
    """A 2-layer config with the given head geometry and large random init (so attention is far from uniform)."""
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
              max_position_embeddings=1024, initializer_range=0.25, tie_word_embeddings=False, use_cache=False,
              bos_token_id=1, eos_token_id=2)
    kw.update(ARCHS[arch])
    if "layer_types" in kw:
        kw["layer_types"] = (kw["layer_types"] * layers)[:layers]
    if "no_rope_layers" in kw:
        kw["no_rope_layers"] = (kw["no_rope_layers"] * layers)[:layers]
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


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


def sharded_errors(ref, model, ids: torch.Tensor, rank: int, world: int) -> tuple[dict, int]:
    """One training step of the one-process `ref` on `ids` [B, S] and of `model` on this rank's shard (shift labels,
    the loss summed over the SP group's tokens; with a ring, the shard in ring order): relative errors of the loss,
    this shard's logits and every trainable gradient (summed over the group). Returns (errors, number of trainable
    tensors)."""
    import torch.distributed as dist

    from hf_upipe.data import shard_batch
    from hf_upipe.distributed import get_sequence_parallel_state, without_sequence_parallel
    from hf_upipe.ops.ring import ring_positions

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    with without_sequence_parallel():  # the one-process reference runs on the whole sequence
        want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    kw = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens", "labels")}
    got = model(**kw, labels=shard["shift_labels"], shift_labels=shard["shift_labels"],
                num_items_in_batch=shard["num_label_tokens"])
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss)
    state = get_sequence_parallel_state()
    mine = ring_positions(rank, shard["input_ids"].shape[1], world, state.ring_size if state is not None else 1)
    errors = {"loss": rel(loss, want.loss), "logits": rel(got.logits, want.logits[:, mine])}
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, p in trained:
        g = p.grad.clone()
        dist.all_reduce(g)
        errors[name] = rel(g, grads[name])
    return errors, len(trained)


# per model type: its layers (2 mixers each), set through `layer_types` or, where that is derived (Bamba), the
# attention layers' indices
_ALTERNATING = ["linear_attention", "full_attention"] * 2
LAYERS = {"qwen3_next": _ALTERNATING, "olmo_hybrid": _ALTERNATING, "bailing_hybrid": _ALTERNATING,
          "bamba": _ALTERNATING,
          "granitemoehybrid": _ALTERNATING,
          "nemotron_h": ["linear_attention", "mlp", "full_attention", "linear_attention"],
          "falcon_h1": ["hybrid", "hybrid"], "lfm2": ["conv", "full_attention"] * 2,
          "zamba2": ["linear_attention", "hybrid"], "mamba2": None}  # mamba2: two Mamba2 layers, no attention


def hybrid_config(model_type):
    """`hf_upipe.models.tiny_config(model_type)` with the layers of `LAYERS`."""
    from hf_upipe.models import tiny_config as small_config

    config = small_config(model_type)
    layers = LAYERS[model_type]
    if layers is None:
        return config
    config.num_hidden_layers = len(layers)
    try:
        config.layer_types = layers
    except AttributeError:  # Bamba: layer_types is a property of attn_layer_indices
        config.attn_layer_indices = [i for i, t in enumerate(layers) if t != "linear_attention"]
    assert list(config.layer_types) == layers, (model_type, config.layer_types)
    if getattr(config, "mlp_layer_types", None):  # Bailing-Hybrid: one MLP kind per layer, cycled
        config.mlp_layer_types = [config.mlp_layer_types[i % len(config.mlp_layer_types)] for i in range(len(layers))]
    return config


def lora_exclusions(model_type) -> list[str] | None:
    """What PEFT refuses to adapt in a Mamba model (a Mamba2 mixer's out_proj; its conv1d is not linear anyway)."""
    return ["out_proj"] if model_type in ("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2",
                                          "mamba2") else None


def lora_pair(ref, model, exclude_modules=None):
    """`ref` and `model` wrapped in the same random PEFT LoRA adapters (rank 4 on every linear layer, B not zero, so
    the adapters change the outputs): (ref, model) with equal state dicts."""
    from peft import LoraConfig

    from hf_upipe.integrations.peft import get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear",
                     exclude_modules=exclude_modules)
    torch.manual_seed(5)
    ref = get_peft_model(ref, cfg)
    torch.manual_seed(5)
    model = get_peft_model(model, copy.deepcopy(cfg))
    model.load_state_dict(ref.state_dict())
    return ref, model
