"""What the fused UPipe attention block reads off a transformers attention module, and what it cannot read.

Entry points:
- `attention_weights(module, arch)`: the module's tensors as `hf_upipe.ops.fused_attention.AttentionWeights`,
  reading PEFT LoRA layers (active adapters, scaling, dropout) on q_proj/k_proj/v_proj (or qkv_proj)/o_proj.
  Not supported (raises): DoRA, LoRA bias, merged-and-disabled adapters, projections other than `nn.Linear`.
- `unfused_reason(module)`: why a module keeps the registered path (a setting the block does not compute:
  bidirectional attention, logit soft-capping, Cohere's per-head LayerNorm q/k norms; or a layer it does not read:
  quantized projections such as bitsandbytes' `Linear4bit`, under PEFT LoRA or not; an OLMo 2 q/k norm whose
  forward another library replaced), or None.
"""

from __future__ import annotations

from torch import nn

from hf_upipe.architectures import fused_attention_classes
from hf_upipe.integrations.replaced import own_forward
from hf_upipe.ops.fused_attention import (
    AttentionWeights,
    HeadNorm,
    LoraAdapter,
    Projection,
    ProjectionNorm,
    RopeStyle,
)

__all__ = ["attention_weights", "unfused_reason"]


def _projection(layer: nn.Module, training: bool) -> Projection:
    """nn.Linear or a PEFT LoRA Linear -> Projection (base weight/bias + the active adapters)."""
    if hasattr(layer, "base_layer") and hasattr(layer, "lora_A"):  # peft.tuners.lora.layer.Linear
        base = layer.get_base_layer()
        adapters = []
        if layer.merged and layer.disable_adapters:
            raise NotImplementedError(
                "LoRA adapters are merged and disabled: unmerge them first (unmerge_adapter())."
            )
        if not layer.merged and not layer.disable_adapters:
            for name in layer.active_adapters:
                if name not in layer.lora_A:
                    continue
                if layer.use_dora.get(name, False):
                    raise NotImplementedError(
                        f"DoRA (adapter {name!r}) is not supported by the fused UPipe path."
                    )
                if getattr(layer, "lora_bias", {}).get(name, False):
                    raise NotImplementedError(
                        f"LoRA bias (adapter {name!r}) is not supported by the fused UPipe path."
                    )
                drop = layer.lora_dropout[name]
                p = drop.p if isinstance(drop, nn.Dropout) and training else 0.0
                adapters.append(
                    LoraAdapter(
                        layer.lora_A[name].weight,
                        layer.lora_B[name].weight,
                        float(layer.scaling[name]),
                        p,
                    )
                )
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


def _split_rows(proj: Projection, sizes: list[int]) -> list[Projection]:
    """A fused projection (rows q | k | v) -> one Projection per part: row views of the weight, bias and LoRA B;
    the LoRA A is shared (one tensor, so its gradient and dropout mask are one, as in PEFT)."""
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        out.append(
            Projection(
                proj.weight[rows],
                None if proj.bias is None else proj.bias[rows],
                tuple(LoraAdapter(a.A, a.B[rows], a.scaling, a.dropout) for a in proj.adapters),
            )
        )
        start += n
    return out


def attention_weights(module: nn.Module, arch) -> AttentionWeights:
    """The attention module's tensors (PEFT adapters included) for `fused_upipe_attention`."""
    training = module.training
    if arch.qkv_fused:
        D, cfg = module.head_dim, module.config
        q, k, v = _split_rows(
            _projection(module.qkv_proj, training),
            [cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.num_key_value_heads * D],
        )
    else:
        q, k, v = (_projection(getattr(module, f"{n}_proj"), training) for n in "qkv")
    norms = {}
    for name in ("q_norm", "k_norm"):
        norm = getattr(module, name, None)
        if norm is None:
            continue
        if (
            arch.projection_norm
        ):  # the registry's fingerprint covers this norm's forward, re-implemented here
            norms[name] = ProjectionNorm(norm.weight, float(norm.variance_epsilon))
        else:
            norms[name] = HeadNorm(norm, tuple(norm.parameters()))
    rope = RopeStyle(arch.rope_interleaved, arch.rope_fp32, bool(getattr(module, "use_rope", True)))
    return AttentionWeights(
        q=q, k=k, v=v, o=_projection(module.o_proj, training), **norms, rope=rope
    )


def unfused_reason(module: nn.Module) -> str | None:
    """Why this attention module keeps the registered path (a setting or a layer the fused block does not
    compute), or None."""
    if not getattr(module, "is_causal", True):
        return "bidirectional attention"
    if getattr(module, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(module, "use_qk_norm", False):
        return "per-head LayerNorm q/k norms"
    for name in _PROJECTIONS:
        layer = getattr(module, name, None)
        base = layer.get_base_layer() if hasattr(layer, "base_layer") else layer
        if layer is not None and type(base) is not nn.Linear:  # bitsandbytes' Linear4bit, ...
            return f"{type(base).__name__} projections (quantized or custom layers)"
    arch = fused_attention_classes().get(type(module).__name__)
    if arch is not None and arch.projection_norm:  # its norm math is re-implemented, not called
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            if norm is not None and own_forward(norm) is not None:
                return f"a replaced {name} forward ({own_forward(norm).by})"
    return None


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
