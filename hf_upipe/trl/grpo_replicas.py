"""TRL's GRPO bookkeeping over the data-parallel replicas, not over every process.

TRL's `GRPOTrainer` assumes each process holds its own rows: it gathers rewards over the processes to normalise
them per prompt group, slices its own advantages by `accelerator.process_index`, and gathers or reduces its
metrics over `accelerator.num_processes`. Under sequence parallelism the P ranks of an SP group hold the same rows
(the same prompts and completions), and only the dp_size SP groups hold different ones.

Entry points:
- `ReplicaAccelerator(accelerator, state)`: the trainer's accelerator as TRL's GRPO code should see it:
  `process_index` = the SP group's index, `num_processes` = dp_size, `gather` / `gather_for_metrics` /
  `reduce` / `pad_across_processes` over the data-parallel group (the ranks with this rank's SP rank), everything
  else the accelerator's own.
- `replica_view(trainer, state)`: a context manager that shows TRL's code that view (`trainer.accelerator`, and
  the `gather` / `gather_object` functions `trl.trainer.grpo_trainer` imported from accelerate) and restores them.

Every rank of an SP group makes the same calls with the same values, so the data-parallel gathers line up and
every rank gets one process's numbers of TRL's dp_size-process run.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["ReplicaAccelerator", "replica_view"]


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _gather_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate equal-shaped tensors of the group's ranks along dim 0, in group-rank order (0-dim: stacked)."""
    if _group_size(group) == 1:
        return x if x.dim() > 0 else x[None]
    flat = x[None] if x.dim() == 0 else x
    work = (
        flat.to(torch.uint8) if flat.dtype == torch.bool else flat
    )  # gloo has no bool collectives
    parts = [torch.empty_like(work) for _ in range(_group_size(group))]
    dist.all_gather(parts, work.contiguous(), group=group)
    out = torch.cat(parts, dim=0)
    return out.bool() if flat.dtype == torch.bool else out


def _gather(data, group):
    """accelerate's `gather` over `group`: tensors (and lists / tuples / dicts of them)."""
    if isinstance(data, torch.Tensor):
        return _gather_tensor(data, group)
    if isinstance(data, (list, tuple)):
        return type(data)(_gather(d, group) for d in data)
    if isinstance(data, dict):
        return {k: _gather(v, group) for k, v in data.items()}
    raise TypeError(f"cannot gather a {type(data).__name__} over the data-parallel group")


def _gather_object(obj, group) -> list:
    """accelerate's `gather_object` over `group`: the ranks' lists concatenated (other objects: one per rank)."""
    n = _group_size(group)
    if n == 1:
        return obj if isinstance(obj, list) else [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out


class ReplicaAccelerator:
    """An accelerator whose process count, index and collectives are the data-parallel replicas' (module
    docstring); every other attribute is read from (and written to) the wrapped accelerator."""

    def __init__(self, accelerator, state):
        object.__setattr__(self, "_inner", accelerator)
        object.__setattr__(self, "_state", state)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    @property
    def process_index(self) -> int:
        return self._state.dp_rank

    @property
    def num_processes(self) -> int:
        return self._state.dp_size

    def gather(self, tensor):
        return _gather(tensor, self._state.dp_group)

    def gather_for_metrics(self, input_data, use_gather_object=False):
        if use_gather_object or not isinstance(input_data, (torch.Tensor, list, tuple, dict)):
            return _gather_object(input_data, self._state.dp_group)
        return _gather(input_data, self._state.dp_group)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        out = tensor.clone()
        if _group_size(self._state.dp_group) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._state.dp_group)
        if reduction == "mean":
            out = out / self._state.dp_size
        return out * scale if scale != 1.0 else out

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        """Pad `tensor` along `dim` to the longest over the data-parallel group."""
        group = self._state.dp_group
        if _group_size(group) == 1:
            return tensor
        size = torch.tensor([tensor.shape[dim]], dtype=torch.long, device=tensor.device)
        longest = int(_gather_tensor(size, group).max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        fill = tensor.new_full(shape, pad_index)
        return torch.cat([fill, tensor] if pad_first else [tensor, fill], dim=dim)


@contextmanager
def replica_view(trainer, state):
    """While active, `trainer.accelerator` and `trl.trainer.grpo_trainer.gather` / `gather_object` work over the
    data-parallel replicas (module docstring). Nested uses keep the outer view."""
    from trl.trainer import grpo_trainer

    if isinstance(trainer.accelerator, ReplicaAccelerator):
        yield
        return
    accelerator = trainer.accelerator
    saved = grpo_trainer.gather, grpo_trainer.gather_object
    trainer.accelerator = ReplicaAccelerator(accelerator, state)
    grpo_trainer.gather = lambda data: _gather(data, state.dp_group)
    grpo_trainer.gather_object = lambda obj: _gather_object(obj, state.dp_group)
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        grpo_trainer.gather, grpo_trainer.gather_object = saved
