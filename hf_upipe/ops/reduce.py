"""Differentiable sums over the ranks of a process group, with the two gradient conventions a loss needs.

Entry points:
- `sum_over_group(x, group)`: all_reduce(SUM) of `x` in forward and all_reduce(SUM) of the incoming gradient in
  backward (`torch.distributed.nn.functional.all_reduce`'s convention, with the group passed explicitly), for
  values every rank then uses whole.
- `sp_token_mean(loss_sum, n_tokens, group)`: the token-weighted mean of a loss over the ranks of a
  sequence-parallel group, with an identity backward (each rank keeps the gradient of its own share).

When to use which sum: each rank of a sequence-parallel group holds a part (its shard's share) of a per-sequence
quantity, say the sum of a sequence's token log-probabilities, and every rank then computes the same loss L from
the summed values. The gradient of L with respect to rank r's part is dL/d(total); the backward all_reduce gives
each rank P x dL/d(total) (P ranks, each contributing the same dL/d(total)). A data-parallel gradient reducer that
averages over all W = P x dp_size ranks (DDP, FSDP) divides that factor P back out: the update equals the one of
the mean of the dp_size groups' losses, computed on one process. The identity-backward sum of
`sp_token_mean` is the other convention (each rank's own share of a loss that is itself a
sum over ranks, then scaled by W).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["sp_token_mean", "sum_over_group"]


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


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) in forward; identity in backward (each rank keeps the gradient of its own share)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone().contiguous()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sp_token_mean(
    loss_sum: torch.Tensor, n_tokens: torch.Tensor | int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Token-weighted mean of the loss over the ranks of `group`: sum of loss_sum / max(sum of n_tokens, 1).

    Every rank returns the same global mean. Gradient convention: rank r gets d mean / d loss_sum_r = 1 / N, so
    each shard's activation gradients equal the single-process ones and the parameter gradients, summed over the
    group, equal the single-process gradients. (`torch.distributed.nn.functional.all_reduce` / `all_gather` would
    give P / N instead: their backward sums the P ranks' identical upstream gradients, a factor meant to be undone
    by a gradient reducer that averages over the SP ranks too.)

    Args:
        loss_sum: scalar sum of the loss over this rank's label tokens (differentiable).
        n_tokens: number of label tokens on this rank (scalar tensor on the collective's device, or int).
        group: the sequence-parallel group; None (or a group of one rank) means no reduction.

    Returns:
        The scalar mean, 0 (not NaN) when no rank has a label token.
    """
    if not torch.is_tensor(n_tokens):
        n_tokens = torch.tensor(n_tokens, device=loss_sum.device)
    n_total = n_tokens.detach().to(torch.int64).clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(n_total, op=dist.ReduceOp.SUM, group=group)
        loss_sum = _SumOverRanks.apply(loss_sum, group)
    return loss_sum / n_total.clamp(min=1).to(loss_sum.dtype)
