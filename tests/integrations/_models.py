"""Tiny random-weight models of the supported architectures, built from configs (no downloads)."""

import copy

import torch

from hf_upipe.models.probe import ADAPTER_CASES, case_config, model_pair

# the fused architectures (hf_upipe.models.architectures.FUSED) and what each tiny config sets beyond the geometry
# (hf_upipe.models.probe.ADAPTER_CASES: biases, MoE routing, multipliers, partial rotary, windows, NoPE, ...)
ARCHS = ADAPTER_CASES
tiny_config = case_config
build_pair = model_pair


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
        return (
            (a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)
        ).item()

    with without_sequence_parallel():  # the one-process reference runs on the whole sequence
        want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    kw = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens", "labels")}
    got = model(
        **kw,
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=shard["num_label_tokens"],
    )
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss)
    state = get_sequence_parallel_state()
    mine = ring_positions(
        rank, shard["input_ids"].shape[1], world, state.ring_size if state is not None else 1
    )
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
LAYERS = {
    "qwen3_next": _ALTERNATING,
    "olmo_hybrid": _ALTERNATING,
    "bailing_hybrid": _ALTERNATING,
    "bamba": _ALTERNATING,
    "granitemoehybrid": _ALTERNATING,
    "nemotron_h": ["linear_attention", "mlp", "full_attention", "linear_attention"],
    "falcon_h1": ["hybrid", "hybrid"],
    "lfm2": ["conv", "full_attention"] * 2,
    "zamba2": ["linear_attention", "hybrid"],
    "mamba2": None,
}  # mamba2: two Mamba2 layers, no attention


def hybrid_config(model_type):
    """`hf_upipe.models.presets.tiny_config(model_type)` with the layers of `LAYERS`."""
    from hf_upipe.models.presets import tiny_config as small_config

    config = small_config(model_type)
    layers = LAYERS[model_type]
    if layers is None:
        return config
    depth = config.num_hidden_layers
    config.num_hidden_layers = len(layers)
    try:
        config.layer_types = layers
    except AttributeError:  # Bamba: layer_types is a property of attn_layer_indices
        config.attn_layer_indices = [i for i, t in enumerate(layers) if t != "linear_attention"]
    assert list(config.layer_types) == layers, (model_type, config.layer_types)
    # every other per-layer list, cycled to the new depth (Bailing-Hybrid's MLP kinds; its SwiGLU limits on 5.25)
    for key, value in list(vars(config).items()):
        if key != "layer_types" and isinstance(value, list) and len(value) == depth:
            setattr(config, key, [value[i % depth] for i in range(len(layers))])
    return config


def lora_exclusions(model_type) -> list[str] | None:
    """What PEFT refuses to adapt in a Mamba model (a Mamba2 mixer's out_proj; its conv1d is not linear anyway)."""
    return (
        ["out_proj"]
        if model_type
        in ("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2", "mamba2")
        else None
    )


def lora_pair(ref, model, exclude_modules=None):
    """`ref` and `model` wrapped in the same random PEFT LoRA adapters (rank 4 on every linear layer, B not zero, so
    the adapters change the outputs): (ref, model) with equal state dicts."""
    from peft import LoraConfig

    from hf_upipe.models.peft import get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        target_modules="all-linear",
        exclude_modules=exclude_modules,
    )
    torch.manual_seed(5)
    ref = get_peft_model(ref, cfg)
    torch.manual_seed(5)
    model = get_peft_model(model, copy.deepcopy(cfg))
    model.load_state_dict(ref.state_dict())
    return ref, model
