"""Kernel replacements as Liger and Hub kernels apply them, with plain torch functions, for CI (no GPU, no
liger-kernel): the same kind of patch at the same place, so the composition and refusal logic is what is tested.

- `simulate_liger(model, ...)`: what `liger_kernel.transformers.apply_liger_kernel_to_llama(model=...)` does to an
  instance: an instance `forward` (and `_get_name`) bound on every RMSNorm (`_patch_rms_norm_module`), on every MLP
  (`_patch_swiglu_module`), on Qwen3's q_norm/k_norm, and with `flce` the causal LM's forward (fused linear
  cross-entropy: `model.forward = MethodType(lce_forward, model)`).
- `simulate_hub_kernels(model, real=False)`: what `kernels.kernelize` does to every RMSNorm: `module.forward =
  MethodType(layer.forward, module)`, with the class's own forward where no kernel exists for the device (CPU), or
  a kernel layer's forward (`real=True`).
- `FakeLinear4bit`: an `nn.Linear` subclass holding frozen 4-bit levels and a per-row scale, dequantized in its
  forward, as bitsandbytes' `Linear4bit` (also an `nn.Linear` subclass) presents itself to PEFT and hf_upipe.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn

# The simulated kernels compute a per-token function deliberately unequal to transformers' (a factor KERNEL), so
# a path that dropped a kernel (ran the class's forward instead) differs from the one-process reference.
KERNEL = 1.25


def liger_rms_forward(self, hidden_states):  # Liger's RMSNorm: llama casting, offset 0
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.float() * x * KERNEL).to(hidden_states.dtype)


def liger_swiglu_forward(self, x):  # Liger's SwiGLU MLP
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x) * KERNEL)


def liger_lce_forward(self, input_ids=None, labels=None, shift_labels=None, **kwargs):
    out = type(self).forward(
        self, input_ids=input_ids, labels=labels, shift_labels=shift_labels, **kwargs
    )
    if labels is not None and self.training:
        out.logits = None  # the fused loss never materialises logits
    return out


def not_per_token_forward(self, x):  # a kernel that mixes tokens: a running mean over the sequence
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)).cumsum(1) / 4


def gpu_only_forward(self, x):  # what a Triton kernel does on a CPU tensor
    raise RuntimeError("0 active drivers ([]). There should only be one.")


def _bind(module, name, fn):
    module.__dict__[name] = fn.__get__(module, type(module))


def simulate_liger(model, *, rms_norm=True, swiglu=True, flce=False, mlp=liger_swiglu_forward):
    base = getattr(model, "get_base_model", lambda: model)()
    for path, module in base.named_modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm"):
            _bind(module, "forward", liger_rms_forward)
            _bind(module, "_get_name", lambda self: "LigerRMSNorm")
        if swiglu and name.endswith("MLP"):
            _bind(module, "forward", mlp)
            _bind(module, "_get_name", lambda self: "LigerSwiGLUMLP")
    if flce:
        base.forward = types.MethodType(liger_lce_forward, base)
    return model


def kernel_rms_forward(self, x):  # a Hub kernel layer's RMSNorm forward
    v = x.float().pow(2).mean(-1, keepdim=True)
    return self.weight * (x.float() * KERNEL / torch.sqrt(v + self.variance_epsilon)).to(x.dtype)


def kernel_rope(rope):
    """A RoPE kernel in place of transformers' function (what Liger's `liger_rotary_pos_emb` is): per token."""

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q, k = rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return q * KERNEL, k * KERNEL

    return liger_rotary_pos_emb


def simulate_hub_kernels(model, *, real=False):
    base = getattr(model, "get_base_model", lambda: model)()
    for module in base.modules():
        if type(module).__name__.endswith("RMSNorm"):
            forward = kernel_rms_forward if real else type(module).forward
            module.forward = types.MethodType(forward, module)
    return model


class FakeLinear4bit(nn.Linear):
    """4-bit symmetric per-row quantization of a Linear's weight: 15 levels times a row scale, frozen."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        w = linear.weight.detach()
        scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 7  # [out, 1]
        del self.weight
        self.register_buffer("levels", torch.round(w / scale).clamp(-7, 7).to(torch.int8))
        self.register_buffer("scale", scale)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self):
        return self.levels.float() * self.scale

    def forward(self, x):
        return F.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


def quantize(
    model, names=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
):
    """Every Linear named in `names` -> FakeLinear4bit (the lm_head stays, as bitsandbytes leaves it)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in names and type(child) is nn.Linear:
                setattr(module, name, FakeLinear4bit(child))
    return model
