"""Liger kernels on a model hf_upipe prepares: `TrainingArguments(use_liger_kernel=True)` in `UPipeTrainer`.

Entry point:
- `apply_liger(model, kernel_config=None)`: apply Liger's kernels to the model's own modules (its RMSNorms and
  SwiGLU MLPs, through liger-kernel's per-model-type function with `model=`), before `prepare_model`, and return
  the settings used. Three of Liger's replacements are switched off, with one log line: its fused linear
  cross-entropy and its cross-entropy (hf_upipe's tiled loss computes the loss of a shard, without logits; Liger's
  would replace the causal LM's forward, which the support gate refuses under SP), and its RoPE (a replacement of
  transformers' module-level function for every model of the family: the fused block computes RoPE inside its
  chunk loop). Whatever Liger rebinds in transformers' modeling modules (`modeling_llama.LlamaRMSNorm =
  LigerRMSNorm`, ...) is put back, so models built later and hf_upipe's registry see transformers' classes.

What runs then: each replaced RMSNorm / MLP forward is checked per-token by behaviour where the model meets SP
(`hf_upipe.adapters.replaced.sequence_local`, on its device: Liger's Triton kernels need a GPU, so on CPU the
check fails and the model is refused under SP), and `tiled_mlp=True` tiles Liger's forwards
(`hf_upipe.adapters.tiled_mlp`). Transformers' Trainer would apply Liger again inside `train()`, after
`prepare_model` (undoing the tiled modules, with its fused linear cross-entropy on): `UPipeTrainer` hands the
Trainer a copy of its arguments with `use_liger_kernel=False` once it has applied them here.
"""

from __future__ import annotations

import logging
import sys

from torch import nn

from hf_upipe.models.peft import base_model

__all__ = ["apply_liger"]

logger = logging.getLogger(__name__)

# Liger's settings hf_upipe switches off, and why (one log line names them)
OFF = {
    "fused_linear_cross_entropy": "hf_upipe's tiled loss computes the loss",
    "cross_entropy": "hf_upipe's tiled loss computes the loss",
    "rope": "the fused block computes RoPE in its chunk loop",
}


def apply_liger(model: nn.Module, kernel_config: dict | None = None) -> dict:
    """See the module docstring. Returns the keyword arguments given to liger-kernel.

    Raises:
        ImportError: liger-kernel is not installed.
    """
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise ImportError(
            "TrainingArguments(use_liger_kernel=True) needs liger-kernel: pip install liger-kernel "
            f"(it could not be imported: {err})"
        ) from None
    settings = {**(kernel_config or {}), **dict.fromkeys(OFF, False)}
    base = base_model(model)
    names = {type(m).__module__ for m in base.modules()}
    saved = {n: dict(vars(sys.modules[n])) for n in names if n.startswith("transformers.")}
    try:
        _apply_liger_kernel_to_instance(model=base, **settings)
    finally:
        for name, before in saved.items():  # transformers' modeling modules as they were
            module = sys.modules[name]
            for key in set(vars(module)) - set(before):
                delattr(module, key)
            for key, value in before.items():
                if vars(module).get(key) is not value:
                    setattr(module, key, value)
    asked = [k for k in OFF if (kernel_config or {}).get(k, k != "cross_entropy")]
    logger.info(
        "hf_upipe: Liger kernels applied to %s's modules; off: %s",
        type(base).__name__,
        "; ".join(f"{k} ({OFF[k]})" for k in asked) or "nothing",
    )
    return settings
