"""The fused UPipe attention block on transformers' attention modules: installed, counted and removed.

Entry points:
- `install_fused_attention(model)` / `remove_fused_attention(model)`: replace (and restore, exactly) the forward of
  every attention module of the registry's fused architectures (`hf_upipe.architectures.FUSED`: the Llama-shaped
  families, with q/k/v biases, per-head or whole-projection q/k norms, a fused qkv projection, interleaved or
  partial RoPE, NoPE layers, sliding windows), once it is verified on the installed transformers. A module with a
  setting the block does not compute or a layer it does not read (`unfused_reason`) keeps the registered path,
  which runs the module's own forward, with one log line per reason naming the classes. `hf_upipe.prepare_model`
  calls them.
- `count_fused(model)`: how many of the model's attention modules run the fused block.

Re-exported from the modules that hold them:
- `fused_forward` (`hf_upipe.integrations.fused_call`): the forward installed on those modules.
- `attention_weights`, `unfused_reason` (`hf_upipe.integrations.fused_weights`): what the block reads off a module,
  and why a module keeps the registered path.
- `fused_verdict`, `fused_check`, `fused_unavailable` (`hf_upipe.integrations.fused_checks`): whether the block is
  verified on the installed transformers, and why it would not be installed.

The installed forward is an instance attribute; removing it is deleting that attribute, which leaves the module
exactly as it was. Not supported in the fused path (raises): DoRA, LoRA bias, merged-and-disabled adapters
(quantized base layers are left on the registered path at installation, above).
"""

from __future__ import annotations

import logging
import types

from torch import nn

from hf_upipe.architectures import fused_attention_classes
from hf_upipe.integrations.fused_call import OPTIONS_ATTRIBUTE, fused_forward
from hf_upipe.integrations.fused_checks import fused_check, fused_unavailable, fused_verdict
from hf_upipe.integrations.fused_weights import attention_weights, unfused_reason
from hf_upipe.integrations.zero3 import forget_children

logger = logging.getLogger(__name__)

__all__ = [
    "attention_weights",
    "count_fused",
    "fused_check",
    "fused_forward",
    "fused_unavailable",
    "fused_verdict",
    "install_fused_attention",
    "remove_fused_attention",
]


def _is_fused(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is fused_forward


def install_fused_attention(
    model: nn.Module, save: bool = False, overlap: bool = False
) -> tuple[int, set[str], set[str]]:
    """Install `fused_forward` on every attention module of the registry's fused architectures (idempotent), with
    its backward in save mode when `save` and its all-to-alls overlapped when `overlap`
    (`hf_upipe.ops.fused_attention`).

    Returns:
        (modules fused, attention classes left on the registered path because the fused block failed its check on
        the installed transformers (`fused_verdict`), other attention classes found).
    """
    classes = fused_attention_classes()
    fused, changed, other, kept = 0, set(), set(), {}
    for module in model.modules():
        name = type(module).__name__
        arch = classes.get(name)
        if arch is None:
            if name.endswith("Attention") and hasattr(module, "q_proj"):
                other.add(name)
            continue
        if not fused_verdict(arch).ok or ("forward" in module.__dict__ and not _is_fused(module)):
            changed.add(
                name
            )  # a changed class, or an instance whose forward someone else replaced: not stacked
            continue
        if (reason := unfused_reason(module)) is not None:
            kept.setdefault(reason, set()).add(name)
            other.add(name)
            continue
        module.forward = types.MethodType(fused_forward, module)
        module.__dict__[OPTIONS_ATTRIBUTE] = {"save_attention": save, "overlap": overlap}
        fused += 1
    for reason, names in sorted(kept.items()):
        logger.info(
            "hf_upipe: %s keep the registered 'upipe' path, not the fused block: %s",
            sorted(names),
            reason,
        )
    return fused, changed, other


def remove_fused_attention(model: nn.Module) -> int:
    """Give every fused attention module its class's forward back (exactly). Returns how many were restored."""
    count = 0
    for module in model.modules():
        if _is_fused(module):
            del module.forward
            module.__dict__.pop(OPTIONS_ATTRIBUTE, None)
            forget_children(module)
            count += 1
    return count


def count_fused(model: nn.Module) -> int:
    """How many of `model`'s attention modules run the fused block (the others keep the registered path)."""
    return sum(_is_fused(module) for module in model.modules())
