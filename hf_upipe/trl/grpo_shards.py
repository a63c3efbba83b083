"""GRPO's per-token log-probabilities under sequence parallelism: one prompt + completion batch, sharded, scored.

Entry points:
- `completion_rows(input_ids, attention_mask, completion_length)`: TRL's GRPO batch (left-padded prompts, then
  right-padded completions: `[B, P + C]`) rearranged into right-padded rows `hf_upipe.shard_batch` can cut
  (`CompletionRows`: the rows, their labels, and where each completion token's log-probability lands).
- `gather_sequence(x, group, sp_rank)`: the shards' per-token values [B, s] of the SP group concatenated into
  [B, P*s], differentiable: the backward sums the incoming gradient over the group (every rank computes the same
  loss from the whole tensor) and keeps this rank's slice.
- `CompletionRows.pick(full)`: the whole-sequence values [B, S'] back in TRL's completion layout [B, C] (0 where
  `completion_mask` is 0, as TRL's fused LM head returns).

Why the rearrangement: TRL left-pads the prompts and right-pads the completions; `shard_batch` takes right padding
only. Each row keeps its real tokens in order, moved to the front, with position ids 0.. (TRL's forward numbers a
left-padded row from the first pad; rotary embeddings see only relative positions, so the scores are the same up
to rounding). The completion token j of row i, at position L_i + j in the new row (L_i: the row's prompt tokens),
is scored by the prediction at position L_i + j - 1.

Gradient convention (as `hf_upipe.ops.reduce.sum_over_group`): each rank's shard receives P x the gradient of
the loss with respect to its values; DDP/FSDP average over all W = P x dp ranks, so the update is the mean over
the dp groups' losses, as TRL's DDP over dp processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CompletionRows", "completion_rows", "gather_sequence"]


@dataclass(frozen=True)
class CompletionRows:
    """A GRPO batch as right-padded rows (`completion_rows`).

    Attributes:
        input_ids: [B, T] each row's real tokens (prompt, then completion), then padding (T: the longest row).
        attention_mask: [B, T] 1 on the real tokens.
        labels: [B, T] the completion tokens (where TRL scores them), -100 elsewhere (unshifted).
        index: [B, C] the position in the shifted whole-sequence values that scores completion token j.
        valid: [B, C] bool, TRL's scored tokens (`completion_mask` within the attention mask).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor

    def pick(self, full: torch.Tensor) -> torch.Tensor:
        """[B, S'] whole-sequence shifted values (S' >= T - 1) -> [B, C] in TRL's completion layout, 0 where not
        scored."""
        index = self.index.clamp(max=full.shape[1] - 1)  # [B, C]; clamped entries are not valid
        picked = full.gather(1, index)  # [B, C]
        return torch.where(self.valid, picked, torch.zeros_like(picked))


def completion_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, pad_token_id: int
) -> CompletionRows:
    """TRL's `[B, P + C]` GRPO batch (`input_ids`, `attention_mask` = prompt mask then completion mask) ->
    right-padded rows and the completion positions (module docstring).

    Raises:
        ValueError: a row without prompt tokens (its first completion token would have no prediction), or a mask
            that is not left padding then prompt then completion then right padding.
    """
    B, S = input_ids.shape
    P, C = S - completion_length, completion_length
    keep = attention_mask.bool()  # [B, S]
    prompt_tokens = keep[:, :P].sum(dim=1)  # [B] L_i
    if bool((prompt_tokens == 0).any()):
        raise ValueError(
            "UPipeGRPOTrainer: a prompt with no tokens (attention mask all 0 over the prompt); every completion "
            "token needs a prompt token before it."
        )
    completion = keep[:, P:]  # [B, C]
    positions = torch.arange(S, device=input_ids.device)  # [S]
    # stable: the real tokens keep their order, moved before the padding
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # [B, S]
    T = int(keep.sum(dim=1).max())
    order = order[:, :T]  # [B, T]
    ids = input_ids.gather(1, order)  # [B, T]
    mask = keep.gather(1, order)  # [B, T]
    is_completion = mask & (order >= P)  # [B, T]
    ids = torch.where(mask, ids, torch.full_like(ids, pad_token_id))
    labels = ids.masked_fill(~is_completion, -100)  # [B, T]
    j = positions[:C]  # [C]
    # completion token j of row i is at L_i + j; the prediction of it at L_i + j - 1
    index = prompt_tokens[:, None] - 1 + j[None, :]  # [B, C]
    return CompletionRows(
        input_ids=ids,
        attention_mask=mask.long(),
        labels=labels,
        index=index.long(),
        valid=completion,
    )


class _GatherSequence(torch.autograd.Function):
    """all_gather along the sequence in forward; all_reduce(SUM) of the gradient, then this rank's slice, in
    backward."""

    @staticmethod
    def forward(ctx, x, group, sp_rank):
        ctx.group, ctx.rank, ctx.width = group, sp_rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.detach().contiguous(), group=group)
        return torch.cat(parts, dim=1)  # [B, P*s]

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # [B, P*s]
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group, sp_rank: int) -> torch.Tensor:
    """The SP group's contiguous shards [B, s] -> the whole sequence [B, P*s] (module docstring). Every rank of
    the group calls it, in the same order, with tensors of the same shape."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherSequence.apply(x, group, sp_rank)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return torch.cat(parts, dim=1)
