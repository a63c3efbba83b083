"""The exact evaluation of one run: the token-weighted eval loss over every rank, no example counted twice.

Entry points (`hf_upipe.runtime.UPipeRuntime.eval_sums` and `.evaluate` call these with the runtime):
- `eval_sums(runtime, model, loader, *, shards=None, context=..., token_stats=False, forward=None)`: the per-round
  sums of an evaluation pass over an accelerate-prepared loader (what `UPipeTrainer` reports from).
- `evaluate(runtime, model, loader)`: the eval loss, the token mean over the whole eval set, in eval mode.
- `EvalSums`: those sums, with `token_mean()` and transformers' `batch_mean()`.

Every rank runs the same number of forwards (a data-parallel replica whose batches ran out runs throw-away ones
on a one-token shard: FSDP needs every rank's), and the sums cross ranks in one all_reduce at the end.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_upipe.data import shard_batch
from hf_upipe.integrations.loaders import eval_rounds, share_batches_within_sp
from hf_upipe.ops.tiled_loss import TokenStats

__all__ = ["EvalSums", "eval_sums", "evaluate"]


@dataclass
class EvalSums:
    """Per evaluation round g (the g-th batch of every data-parallel replica, what one process sees as its g-th
    batch): summed token loss and label tokens over all ranks, and the examples of the round (None when not
    recorded: one process)."""

    loss: list[float]
    tokens: list[float]
    examples: list[int] | None
    # with `eval_sums(token_stats=True)`: per round, the summed entropy and argmax hits of the label tokens
    entropy: list[float] | None = None
    correct: list[float] | None = None

    def token_mean(self) -> float:
        """The mean loss over every label token of the eval set (NaN when it has none)."""
        total = sum(self.tokens)
        return sum(self.loss) / total if total else float("nan")

    def batch_mean(self, nan_filter: bool = True) -> float:
        """transformers.Trainer's `eval_loss`: each round's token mean weighted by its examples; with `nan_filter`
        (`logging_nan_inf_filter`), rounds without label tokens are left out unless no round has any."""
        means = [s / t if t else float("nan") for s, t in zip(self.loss, self.tokens)]
        weights = self.examples if self.examples is not None else [1] * len(means)
        keep = [i for i, m in enumerate(means) if math.isfinite(m)]
        if not (nan_filter and keep):
            keep = list(range(len(means)))
        total = sum(weights[i] for i in keep)
        return sum(weights[i] * means[i] for i in keep) / total if total else float("nan")


def _throwaway_forward(runtime, model, context) -> None:
    """A forward on a one-token shard, for a replica with no batch left in a round (FSDP needs every rank's)."""
    P = runtime.state.sp_size
    ids = torch.zeros(
        1, P, dtype=torch.long, device=runtime.device
    )  # [1, P]: one token per SP rank
    shard = shard_batch(
        {"input_ids": ids, "labels": torch.full_like(ids, -100)}, runtime.state.sp_rank, P
    )
    with torch.no_grad(), context():
        runtime.loss_sum(model, shard)


def eval_sums(
    runtime,
    model,
    loader,
    *,
    shards=None,
    context=contextlib.nullcontext,
    token_stats: bool = False,
    forward=None,
) -> EvalSums:
    """Per-round loss sums of an evaluation pass over an accelerate-prepared `loader` (no repeated examples).

    Args:
        runtime: the run's `hf_upipe.runtime.UPipeRuntime`.
        model: the model to call (eval mode is the caller's choice).
        loader: the accelerate-prepared loader (re-pointed here for evaluation; idempotent).
        shards: this rank's shards of `loader`'s batches, on the device (default: `runtime.shard` of each batch).
        context: a context-manager factory for each forward (e.g. autocast).
        token_stats: also sum each round's entropy and argmax hits of the label tokens (`TokenStats`).
        forward: `forward(shard, token_stats) -> summed token loss` of one shard (default: `runtime.loss_sum`'s);
            UPipeTrainer's records the shard's predictions too (`hf_upipe.integrations.predictions`).

    Every rank runs the same number of forwards (a replica whose batches ran out runs throw-away ones), and the
    sums cross ranks in one all_reduce at the end.
    """
    share_batches_within_sp(loader, runtime.state, evaluation=True)
    rows = []
    for shard in shards if shards is not None else (runtime.shard(b) for b in loader):
        stats = TokenStats(device=shard["shift_labels"].device) if token_stats else None
        with torch.no_grad(), context():
            loss_sum = (
                runtime.loss_sum(model, shard, stats)[0]
                if forward is None
                else forward(shard, stats)
            )
        count = torch.tensor(runtime.own_count(shard), dtype=torch.float64, device=loss_sum.device)
        row = [loss_sum.detach().to(torch.float64).reshape(()), count]
        if stats is not None:
            row += [stats.entropy_sum.to(loss_sum.device), stats.correct.to(loss_sum.device)]
        rows.append(torch.stack(row))
    distributed = runtime.world_size > 1 and dist.is_initialized()
    examples = eval_rounds(loader, runtime.state.dp_size) if distributed else None
    rounds = len(examples) if examples is not None else len(rows)
    if len(rows) > rounds:
        raise RuntimeError(
            f"evaluation: {len(rows)} batches on this rank but {rounds} rounds recorded"
        )
    for _ in range(rounds - len(rows)):
        _throwaway_forward(runtime, model, context)
    # [G, (loss, tokens)] or [G, (loss, tokens, entropy, correct)]
    sums = torch.zeros(rounds, 4 if token_stats else 2, dtype=torch.float64, device=runtime.device)
    if rows:
        sums[: len(rows)] = torch.stack(rows).to(runtime.device)
    if distributed:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    columns = sums.t().tolist() if rounds else [[] for _ in range(sums.shape[1])]
    stats = dict(entropy=columns[2], correct=columns[3]) if token_stats else {}
    return EvalSums(loss=columns[0], tokens=columns[1], examples=examples, **stats)


def evaluate(runtime, model, loader) -> float:
    """The exact eval loss of `loader` (accelerate-prepared) with `runtime` (its `eval_sums`), `model` in eval
    mode meanwhile: the token mean over every label token of the eval set, the same on every rank."""
    training = model.training
    model.eval()
    try:
        return runtime.eval_sums(model, loader).token_mean()
    finally:
        model.train(training)
