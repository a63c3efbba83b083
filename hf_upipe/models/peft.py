"""PEFT models seen through their transformers model, without importing peft.

Entry points:
- `base_model(model)`: the transformers model inside a PEFT model (`get_base_model()`), or the model itself; the
  one place that knows how a PEFT model wraps its base (runtime checks, the fused block, the tiled loss, the
  planner and the self-test all ask here).
- `get_peft_model(model, config)`: `peft.get_peft_model`, imported when called, without the FutureWarning that
  peft 0.21 triggers by reading transformers' deprecated `is_gradient_checkpointing` (not this project's call).
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["base_model", "get_peft_model"]


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model of `model` (a PEFT `PeftModel`, or any other module, returned as is)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def get_peft_model(model: nn.Module, config) -> nn.Module:
    """`peft.get_peft_model(model, config)` (see the module docstring)."""
    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return peft.get_peft_model(model, config)
