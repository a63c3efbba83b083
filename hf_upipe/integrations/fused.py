"""`prepare_model(model)`: install the fused UPipe attention block on the attention modules it knows.

Entry points:
- `prepare_model(model)`: idempotent; works on a plain transformers model, a PEFT model, or any module tree.
- `FUSED_ATTENTION_CLASSES`: the attention classes handled (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with
  per-head q_norm/k_norm).
- `attention_weights(module)`: the module's tensors as `hf_upipe.ops.fused_attention.AttentionWeights`,
  reading PEFT LoRA layers (active adapters, scaling, dropout) on q_proj/k_proj/v_proj/o_proj.

The flow: `prepare_model` replaces each known attention module's `forward` by `fused_forward` (the original is
kept as `module._upipe_original_forward`) and switches the model to `attn_implementation="upipe"` (whose mask
function is what the layout checks read). `fused_forward`, under sequence parallelism, validates the batch like
the registered path (every rank raises the same error before any all-to-all) and calls
`fused_upipe_attention` on the normed hidden states (for packed rows, `upipe_cu_seqlens` in the kwargs, with the
kernel wrapped in `hf_upipe.ops.documents.DocumentKernel`, as the registered path does); without SP it calls the
original forward (exact "sdpa", which handles packing itself).
Attention modules of other classes keep the registered "upipe" path, with one log line saying so.

Composability: gradients are returned by one autograd Function per layer (never accumulated into `.grad` by
hand), so DDP/FSDP hooks and the model's non-reentrant activation checkpointing see an ordinary op. Not
supported in the fused path (raises): DoRA, LoRA bias, quantized base layers, merged-and-disabled adapters.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

from hf_upipe.integrations.transformers import (
    _active_state,
    _check_layout,
    _check_static,
    sliding_window_check,
    sp_kernel,
)
from hf_upipe.ops.fused_attention import AttentionWeights, HeadNorm, LoraAdapter, Projection, fused_upipe_attention
from hf_upipe.planning.simulate import is_fake

logger = logging.getLogger(__name__)

__all__ = ["FUSED_ATTENTION_CLASSES", "attention_weights", "fused_forward", "prepare_model"]

FUSED_ATTENTION_CLASSES = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")


def _projection(layer: nn.Module, training: bool) -> Projection:
    """nn.Linear or a PEFT LoRA Linear -> Projection (base weight/bias + the active adapters)."""
    if hasattr(layer, "base_layer") and hasattr(layer, "lora_A"):  # peft.tuners.lora.layer.Linear
        base = layer.get_base_layer()
        adapters = []
        if layer.merged and layer.disable_adapters:
            raise NotImplementedError("LoRA adapters are merged and disabled: unmerge them first (unmerge_adapter()).")
        if not layer.merged and not layer.disable_adapters:
            for name in layer.active_adapters:
                if name not in layer.lora_A:
                    continue
                if layer.use_dora.get(name, False):
                    raise NotImplementedError(f"DoRA (adapter {name!r}) is not supported by the fused UPipe path.")
                if getattr(layer, "lora_bias", {}).get(name, False):
                    raise NotImplementedError(f"LoRA bias (adapter {name!r}) is not supported by the fused UPipe path.")
                drop = layer.lora_dropout[name]
                p = drop.p if isinstance(drop, nn.Dropout) and training else 0.0
                adapters.append(LoraAdapter(layer.lora_A[name].weight, layer.lora_B[name].weight,
                                            float(layer.scaling[name]), p))
        layer = base
        extra = tuple(adapters)
    else:
        extra = ()
    if type(layer) is not nn.Linear:
        raise NotImplementedError(
            f"{type(layer).__name__} projections (quantized or custom layers) are not supported by the fused "
            "UPipe path; load the model without quantization."
        )
    return Projection(layer.weight, layer.bias, extra)


def attention_weights(module: nn.Module) -> AttentionWeights:
    """The attention module's tensors (PEFT adapters included) for `fused_upipe_attention`."""
    norms = {}
    for name in ("q_norm", "k_norm"):
        norm = getattr(module, name, None)
        if norm is not None:
            norms[name] = HeadNorm(norm, tuple(norm.parameters()))
    return AttentionWeights(
        q=_projection(module.q_proj, module.training), k=_projection(module.k_proj, module.training),
        v=_projection(module.v_proj, module.training), o=_projection(module.o_proj, module.training), **norms,
    )


def fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                  **kwargs):
    """Forward installed on known attention modules: the fused UPipe block under SP, the original otherwise."""
    state = _active_state()
    if state is None:
        return self._upipe_original_forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                            **kwargs)
    if past_key_values is not None and past_key_values.get_seq_length(self.layer_idx) > 0:
        raise NotImplementedError("A KV cache with past tokens is not supported under sequence parallelism; "
                                  "generate without SP (one process), or call the model with use_cache=False.")
    dropout = self.attention_dropout if self.training else 0.0
    _check_static(self, dropout, kwargs)
    if isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError("The fused UPipe path got a prepared attention mask tensor under sequence "
                                  "parallelism; pass a 2-D padding mask (right padding) or none.")
    B, s, _ = hidden_states.shape
    kernel = state.kernel
    if not is_fake(hidden_states):
        _check_layout(state, kwargs.get("position_ids"), attention_mask, B, s, hidden_states.device,
                      kwargs.get("upipe_cu_seqlens"))
        # packed rows: the kernel runs inside each document (DocumentKernel), like the registered path
        kernel = sp_kernel(state, kwargs, hidden_states.device, hidden_states.dtype, s * state.sp_size)
    window = getattr(self, "sliding_window", None)
    if window is None and type(self).__name__ == "MistralAttention":
        window = getattr(self.config, "sliding_window", None)
    sliding_window_check(window, s * state.sp_size)
    cos, sin = position_embeddings
    y = fused_upipe_attention(
        hidden_states, cos, sin, attention_weights(self),
        num_heads=self.config.num_attention_heads, num_kv_heads=self.config.num_key_value_heads,
        head_dim=self.head_dim, group=state.sp_group, heads_per_chunk=state.heads_per_chunk,
        kernel=kernel, scale=self.scaling,
    )
    return y, None


def prepare_model(model: nn.Module, upipe_config=None) -> nn.Module:
    """Install the fused UPipe attention block on every known attention module of `model` (idempotent).

    Args:
        model: a transformers model, a PEFT model wrapping one, or any module tree containing attention modules.
        upipe_config: an optional `hf_upipe.UPipeConfig`: `fused_attention=False` keeps the registered attention path
            (only `attn_implementation="upipe"` is set); `tiled_mlp=True` also tiles the MLPs and RMSNorms
            (`hf_upipe.memory.apply_tiled_mlp`, `mlp_chunk_tokens`). Offloading is per step: wrap each forward and
            backward in `hf_upipe.memory.offload_checkpoints(model, upipe_config.offload, ...)`
            (UPipeTrainer does).

    Returns:
        The same model, with `attn_implementation="upipe"` set where a config is found.
    """
    if upipe_config is not None and upipe_config.tiled_mlp:
        from hf_upipe.memory.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, upipe_config.mlp_chunk_tokens)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) != "upipe" \
            and hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation("upipe")
        logger.info("hf_upipe: attn_implementation set to 'upipe'")
    if upipe_config is not None and not upipe_config.fused_attention:
        return model
    fused, other = 0, set()
    for module in model.modules():
        name = type(module).__name__
        if name in FUSED_ATTENTION_CLASSES:
            if not hasattr(module, "_upipe_original_forward"):
                module._upipe_original_forward = module.forward
                module.forward = types.MethodType(fused_forward, module)
            fused += 1
        elif name.endswith("Attention") and hasattr(module, "q_proj"):
            other.add(name)
    logger.info("hf_upipe: fused UPipe attention on %d module(s)%s", fused,
                f"; {sorted(other)} keep the registered 'upipe' path" if other else "")
    return model
