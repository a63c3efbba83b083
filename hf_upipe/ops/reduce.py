"""A differentiable sum over the ranks of a process group, for values every rank then uses whole.

Entry point:
- `sum_over_group(x, group)`: all_reduce(SUM) of `x` in forward and all_reduce(SUM) of the incoming gradient in
  backward (`torch.distributed.nn.functional.all_reduce`'s convention, with the group passed explicitly).

When to use which sum: each rank of a sequence-parallel group holds a part (its shard's share) of a per-sequence
quantity, say the sum of a sequence's token log-probabilities, and every rank then computes the same loss L from
the summed values. The gradient of L with respect to rank r's part is dL/d(total); the backward all_reduce gives
each rank P x dL/d(total) (P ranks, each contributing the same dL/d(total)). A data-parallel gradient reducer that
averages over all W = P x dp_size ranks (DDP, FSDP) divides that factor P back out: the update equals the one of
the mean of the dp_size groups' losses, computed on one process. The identity-backward sum of
`hf_upipe.ops.tiled_loss.sp_token_mean` is the other convention (each rank's own share of a loss that is itself a
sum over ranks, then scaled by W).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["sum_over_group"]


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) forward; all_reduce(SUM) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.detach().clone().contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The elementwise sum of `x` over the ranks of `group` (same shape), differentiable (module docstring).

    `group` None, or a group of one rank, returns `x` unchanged. Every rank of the group must call it, in the same
    order, with tensors of the same shape and dtype."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    if not torch.is_grad_enabled() or not x.requires_grad:
        total = x.detach().clone().contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total
    return _SumOverGroup.apply(x, group)
