"""PEFT models seen through their transformers model, without importing peft.

Entry point:
- `base_model(model)`: the transformers model inside a PEFT model (`get_base_model()`), or the model itself; the
  one place that knows how a PEFT model wraps its base (runtime checks, the fused block, the tiled loss, the
  planner and the self-test all ask here).
"""

from __future__ import annotations

from torch import nn

__all__ = ["base_model"]


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model of `model` (a PEFT `PeftModel`, or any other module, returned as is)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
