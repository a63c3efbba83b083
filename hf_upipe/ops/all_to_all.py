"""All-to-all between the sequence-sharded and the head-sharded layouts.

Entry points:
- `seq_to_head(x5, group)`: [B, s, P, h, D] (block p of dim 2 is for rank p) -> [B, S, h, D], no autograd.
- `head_to_seq(y, group)`: [B, S, h, D] -> [B, s, P, h, D] (block p of dim 2 came from rank p), no autograd.
- `start_seq_to_head(x5, group, async_op)` / `start_head_to_seq(y, group, async_op)`: the same, returning a
  `Pending` whose `wait()` gives the result. With `async_op` the collective is in flight until then (NCCL runs it
  on its own stream, gloo on its worker thread), so the caller can compute meanwhile; without, it is done at once.
- `SeqToHead` / `HeadToSeq` (autograd Functions) and `all_to_all_seq_to_head(x, group)` /
  `all_to_all_head_to_seq(y, group)`: the same on [B, s, H, D] <-> [B, S, H/P, D], backward = the inverse.

Legend: B batch, s = S/P local tokens, S full sequence, P ranks in `group`, h heads per rank, H = P*h, D head dim.
Rank r owns tokens [r*s, (r+1)*s) in the sequence layout and heads [r*h, (r+1)*h) in the head layout.

Buffers: the send buffer is laid out [P, s, B, h, D] so that the receive buffer [P*s, B, h, D] is the full
sequence in order with no further copy; its [B, S, h, D] view has strides (h*D, B*h*D, D, 1), which the attention
kernels accept. gloo needs contiguous buffers and silently writes a non-contiguous output in contiguous order, so
both buffers are always fresh contiguous tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "HeadToSeq",
    "SeqToHead",
    "all_to_all_head_to_seq",
    "Pending",
    "all_to_all_seq_to_head",
    "group_size",
    "head_to_seq",
    "seq_to_head",
    "start_head_to_seq",
    "start_seq_to_head",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; 1 when there is no group or torch.distributed is not initialised."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class Pending:
    """An all-to-all in flight: `wait()` (once) hands over its result, a view of the receive buffer; the send buffer
    is kept alive until then. Waiting on NCCL orders the current stream after the collective, it does not block the
    host."""

    __slots__ = ("_work", "_result", "_send")

    def __init__(self, result: torch.Tensor, work=None, send: torch.Tensor | None = None):
        self._result, self._work, self._send = result, work, send if work is not None else None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        result, self._result, self._work, self._send = self._result, None, None, None
        if result is None:
            raise RuntimeError("Pending.wait() was already called: it hands over its result once")
        return result


def _exchange(send: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """all_to_all_single along dim 0 of a contiguous [P, ...] buffer: (receive buffer, work or None)."""
    assert send.is_contiguous()
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return recv, work


def start_seq_to_head(
    x5: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> Pending:
    """`seq_to_head`, in flight until `Pending.wait()` when `async_op`."""
    B, s, P, h, D = x5.shape
    if P == 1:
        return Pending(x5[:, :, 0])
    send = x5.permute(2, 1, 0, 3, 4).contiguous()  # [P, s, B, h, D]
    recv, work = _exchange(send, group, async_op)  # [P(src), s, B, h, D] = [S, B, h, D]
    return Pending(recv.view(P * s, B, h, D).transpose(0, 1), work, send)  # [B, S, h, D]


def start_head_to_seq(
    y: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> Pending:
    """`head_to_seq`, in flight until `Pending.wait()` when `async_op`."""
    B, S, h, D = y.shape
    P = group_size(group)
    if P == 1:
        return Pending(y.unsqueeze(2))
    s = S // P
    send = (
        y.transpose(0, 1).reshape(P, s, B, h, D).contiguous()
    )  # [P(dst), s, B, h, D]; no copy if y is [S,B,h,D]
    recv, work = _exchange(send, group, async_op)  # [P(src), s, B, h, D]
    return Pending(recv.permute(2, 1, 0, 3, 4), work, send)  # [B, s, P, h, D]


def seq_to_head(x5: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send block p of dim 2 to rank p; receive every rank's tokens for this rank's heads.

    Args:
        x5: [B, s, P, h, D], any strides (e.g. a head-slice view of q).
    Returns:
        [B, S, h, D], a view of the receive buffer [S, B, h, D].
    """
    return start_seq_to_head(x5, group).wait()


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send rows [p*s, (p+1)*s) of the full sequence to rank p; receive every rank's heads for this rank's tokens.

    Args:
        y: [B, S, h, D], any strides.
    Returns:
        [B, s, P, h, D], a view of the receive buffer [P, s, B, h, D]: [:, :, p] holds rank p's heads.
    """
    return start_head_to_seq(y, group).wait()


class SeqToHead(torch.autograd.Function):
    """[B, s, H, D] sequence-sharded -> [B, S, H/P, D] head-sharded; backward is `HeadToSeq`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        B, s, H, D = x.shape
        P = group_size(group)
        return seq_to_head(x.view(B, s, P, H // P, D), group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx5 = head_to_seq(dy, ctx.group)  # [B, s, P, h, D]
        B, s, P, h, D = dx5.shape
        return dx5.reshape(B, s, P * h, D), None


class HeadToSeq(torch.autograd.Function):
    """[B, S, H/P, D] head-sharded -> [B, s, H, D] sequence-sharded; backward is `SeqToHead`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x5 = head_to_seq(y, group)  # [B, s, P, h, D]
        B, s, P, h, D = x5.shape
        return x5.reshape(B, s, P * h, D)

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        B, s, H, D = dx.shape
        P = group_size(ctx.group)
        return seq_to_head(dx.view(B, s, P, H // P, D), ctx.group), None


def all_to_all_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable [B, s, H, D] -> [B, S, H/P, D] (rank r gets heads [r*H/P, (r+1)*H/P))."""
    if x.shape[2] % group_size(group):
        raise ValueError(f"{x.shape[2]} heads cannot be split over {group_size(group)} ranks.")
    return SeqToHead.apply(x, group)


def all_to_all_head_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable [B, S, H/P, D] -> [B, s, H, D], the inverse of `all_to_all_seq_to_head`."""
    if y.shape[1] % group_size(group):
        raise ValueError(
            f"sequence length {y.shape[1]} cannot be split over {group_size(group)} ranks."
        )
    return HeadToSeq.apply(y, group)
