"""DeepSpeed ZeRO-3: whole parameters for the code that reads weights outside their own module's forward.

Under ZeRO-3 every parameter is partitioned over the ranks (an empty tensor locally) and gathered by DeepSpeed's
forward pre-hook of the module that owns it, and again by a hook on that module's outputs before its backward.
hf_upipe reads weights where those hooks do not see it:

- the fused attention block reads q/k/v/o_proj (and their LoRA adapters) inside the attention module's forward
  without calling them, and the tiled MLP recomputes gate/up/down_proj inside its own backward, from parameters
  it captured in its forward. Both call `gather_children(module)` in their forward: the submodules' parameters
  become "external parameters" of the module (`deepspeed.zero.register_external_parameter`), which DeepSpeed
  gathers for the module's forward and again before its backward, and releases after each. On the first call they
  are gathered right there (as DeepSpeed's own discovery of such reads does). The gradients stay those of the
  parameters, reduced by DeepSpeed's per-parameter hooks.
- the tiled loss reads the lm_head's weight after the model's forward (`gathered_head`): it is gathered for the
  loss's forward and, through two identity autograd nodes around it, again for its backward and released after.

Entry points: `partitioned(params)`, `gather_children(module)` / `forget_children(module)`,
`gathered_head(hidden, params)`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["forget_children", "gather_children", "gathered_head", "partitioned"]

_REGISTERED = (
    "_upipe_external_params"  # ids hf_upipe registered, so that removing them restores the module
)


def partitioned(params) -> list[torch.Tensor]:
    """The parameters among `params` that ZeRO-3 partitions (they carry DeepSpeed's `ds_id`)."""
    return [p for p in params if p is not None and hasattr(p, "ds_id")]


def gather_children(module: nn.Module) -> None:
    """ZeRO-3 (a no-op otherwise): the parameters of `module`'s submodules become external parameters of `module`,
    gathered by DeepSpeed for its forward and backward; called inside `module`'s forward, it gathers now those
    that are still partitioned (the first call)."""
    params = partitioned(p for name, p in module.named_parameters() if "." in name)
    if not params:
        return
    from deepspeed.runtime.zero.partition_parameters import (
        ZeroParamStatus,
        register_external_parameter,
    )

    mine = module.__dict__.setdefault(_REGISTERED, set())
    for p in params:
        if id(p) not in getattr(module, "_external_params", {}):
            register_external_parameter(module, p)
            mine.add(id(p))
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather(param_list=missing)


def forget_children(module: nn.Module) -> None:
    """Undo `gather_children`'s registrations on `module`."""
    external = getattr(module, "_external_params", None)
    for key in module.__dict__.pop(_REGISTERED, ()):
        if external is not None:
            external.pop(key, None)


class _GatherInBackward(torch.autograd.Function):
    """Identity on x; its backward gathers (`gather=True`) or releases ZeRO-3 parameters, before passing the
    gradient on. Placed on the loss (its backward runs first) and on the loss's input (its backward runs last)."""

    @staticmethod
    def forward(ctx, x, params, gather):
        ctx.params, ctx.gather = params, gather
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        first = ctx.params[0]
        if ctx.gather:
            first.all_gather(param_list=ctx.params)
        else:
            first.partition(param_list=ctx.params, has_been_updated=False)
        return grad, None, None


@contextlib.contextmanager
def gathered_head(hidden: torch.Tensor, params):
    """Gather the ZeRO-3-partitioned `params` (the lm_head's weight and bias) for the body of the block, which
    computes the loss from `hidden`; yields (hidden to use, finish), where `finish(loss)` returns the loss to use.
    Under autograd the parameters are gathered again before the loss's backward and released after it. Without
    partitioned parameters: nothing is gathered, hidden and loss pass through."""
    params = partitioned(params)
    if not params:
        yield hidden, lambda loss: loss
        return
    import deepspeed

    track = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in params)
    )
    if track:  # released once the loss's backward has produced the gradient of `hidden`
        if not hidden.requires_grad:  # (a frozen trunk) so that the node releasing them runs
            hidden = hidden.detach().requires_grad_()
        hidden = _GatherInBackward.apply(hidden, params, False)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield (
            hidden,
            (lambda loss: _GatherInBackward.apply(loss, params, True))
            if track
            else (lambda loss: loss),
        )
