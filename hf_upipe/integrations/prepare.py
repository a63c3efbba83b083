"""`prepare_model` / `unprepare_model`: apply the registry's adapters to a loaded model, and revert them exactly.

Entry points:
- `prepare_model(model, upipe_config=None)`: switch the model to `attn_implementation="upipe"`, install the fused
  attention block (`hf_upipe.integrations.fused`) and, with `upipe_config.tiled_mlp`, the tiled MLP/RMSNorm
  (`hf_upipe.memory.tiled_mlp`) on the modules of the architectures in `hf_upipe.architectures`, behind their
  version gate. Idempotent; a plain transformers model, a PEFT model, or any module tree.
- `unprepare_model(model)`: remove every adapter and restore the attention implementation the model had: its
  outputs and state_dict are those of the model before `prepare_model`.

One log line says what was applied; classes the gate kept off (the installed transformers changed their source)
get a warning naming them.
"""

from __future__ import annotations

import logging

from torch import nn

from hf_upipe.architectures import VERIFIED_ON
from hf_upipe.integrations.fused import install_fused_attention, remove_fused_attention
from hf_upipe.integrations.peft import base_model
from hf_upipe.memory.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp

logger = logging.getLogger(__name__)

__all__ = ["prepare_model", "unprepare_model"]

_PREVIOUS = "_upipe_previous_attn_implementation"


def prepare_model(model: nn.Module, upipe_config=None) -> nn.Module:
    """Install hf_upipe's adapters on `model` (see the module docstring).

    Args:
        model: a transformers model, a PEFT model wrapping one, or any module tree containing attention modules.
        upipe_config: an optional `hf_upipe.UPipeConfig`: `fused_attention=False` keeps the registered attention path
            (only `attn_implementation="upipe"` is set); `tiled_mlp=True` also tiles the MLPs and RMSNorms
            (`mlp_chunk_tokens`). Offloading is per step: wrap each forward and backward in
            `hf_upipe.memory.offload_checkpoints(model, upipe_config.offload, ...)` (UPipeTrainer does).

    Returns:
        The same model, with `attn_implementation="upipe"` set where a config is found.
    """
    if upipe_config is not None and upipe_config.tiled_mlp:
        apply_tiled_mlp(model, upipe_config.mlp_chunk_tokens)
    base = base_model(model)
    config = getattr(base, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if config is not None and current != "upipe" and hasattr(base, "set_attn_implementation"):
        setattr(base, _PREVIOUS, current)
        base.set_attn_implementation("upipe")
        logger.info("hf_upipe: attn_implementation set to 'upipe' (was %r)", current)
    if upipe_config is not None and not upipe_config.fused_attention:
        return model
    fused, changed, other = install_fused_attention(model)
    if changed:
        logger.warning("hf_upipe: %s keep the registered 'upipe' attention, not the fused block: the installed "
                       "transformers changed their source (the fused block was verified on transformers %s)",
                       sorted(changed), VERIFIED_ON)
    logger.info("hf_upipe: fused UPipe attention on %d module(s)%s", fused,
                f"; {sorted(other)} keep the registered 'upipe' path" if other else "")
    return model


def unprepare_model(model: nn.Module) -> nn.Module:
    """Remove every adapter `prepare_model` installed and restore the previous attention implementation."""
    remove_fused_attention(model)
    remove_tiled_mlp(model)
    base = base_model(model)
    if _PREVIOUS in base.__dict__:
        previous = base.__dict__.pop(_PREVIOUS)
        base.set_attn_implementation(previous)
    return model
