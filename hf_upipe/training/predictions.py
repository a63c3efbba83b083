"""Per-token predictions of a sequence shard for `compute_metrics`, without full-vocabulary logits of a sequence.

Entry points:
- `shard_predictions(model, inputs, shift_labels, *, tiled, chunk_tokens, preprocess=None)`: run the model on this
  rank's shard; return its summed token loss (as `shard_loss_sum`) and its per-token predictions [B, s, ...]:
  the argmax id of every position, or what `preprocess(logits, targets)` returns for each tile of positions.
- `gather_sequence(local, state, seq_len)`: the [B, s, ...] predictions of every rank of the SP group in global
  sequence order, the padding `shard_batch` added removed: [B, seq_len, ...].
- `aligned_targets(labels)`: the targets `preprocess` gets in one process: labels shifted left by one.
- `predict_tile(logits, targets, preprocess)`: the per-token predictions of logits [B, T, V] (refused unless
  per-token).
- `one_process_preprocess(preprocess, padding)`: what `UPipeTrainer` hands the Trainer's own loop in one process.
- `mask_padding(preds, attention_mask)`: -100 on padding.
- `per_token_error(out, logits)`: why a `preprocess` output is not per-token (or None).
- `PredictionRecorder(runtime, preprocess)`: records an evaluation pass's predictions and labels on every rank and
  gathers them over data parallelism in one-process order; `concat_predictions(batches)` and
  `with_metrics(compute_metrics, ...)`: the Trainer's concatenation and metric naming.

Tiles: the logits of `chunk_tokens` positions ([B, c, V], c = chunk_tokens // B, at least 1) exist at a time, from the
final-norm hidden states the tiled loss records (`hf_upipe.training.loss.head_input`); with
`tiled_loss=False` the model computes its shard's logits [B, s, V] and the tiles are slices of them. Logits never
cross ranks: only the per-token predictions are gathered.

Alignment: position t of a sequence holds what the logits of token t give (the prediction of token t + 1), as
`transformers.Trainer` does in one process. `preprocess` gets each tile's logits with the aligned targets
(`targets[:, t]` is the token logits[:, t] predicts, -100 where there is none: padding, the end of a document or of
the sequence), because a shard has no access to the label after its last token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.trainer_pt_utils import nested_concat, nested_numpify
from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

from hf_upipe.distributed import SequenceParallelState
from hf_upipe.ops.ring import ring_positions
from hf_upipe.ops.tiled_loss import default_chunk_tokens, tiled_cross_entropy
from hf_upipe.training.loss import head_input, shard_loss_sum

__all__ = [
    "PredictionRecorder",
    "aligned_targets",
    "concat_predictions",
    "gather_sequence",
    "mask_padding",
    "one_process_preprocess",
    "per_token_error",
    "predict_tile",
    "shard_predictions",
    "with_metrics",
]


def aligned_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, S] unshifted labels -> [B, S] targets: targets[:, t] = labels[:, t + 1], the last one ignore_index."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)


def mask_padding(preds, mask: torch.Tensor | None, pad_index: int = -100):
    """Per-token predictions [B, S, ...] with `pad_index` where `attention_mask` [B, S] is 0 (padding predicts
    nothing; its logits depend on how attention treats padded queries). Anything else is returned unchanged."""
    if mask is None or not torch.is_tensor(preds) or tuple(preds.shape[:2]) != tuple(mask.shape):
        return preds
    pad = (mask == 0).to(preds.device).reshape(*mask.shape, *([1] * (preds.dim() - 2)))
    return preds.masked_fill(pad, pad_index)


def per_token_error(out, logits: torch.Tensor) -> str | None:
    """Why `out` (from preprocess_logits_for_metrics on logits [B, c, V]) is not a [B, c, ...] tensor, or None."""
    B, c = logits.shape[:2]
    if not torch.is_tensor(out):
        return f"it returned a {type(out).__name__}"
    if out.dim() < 2 or tuple(out.shape[:2]) != (B, c):
        return f"it returned shape {tuple(out.shape)} for logits of shape {tuple(logits.shape)}"
    return None


def predict_tile(logits: torch.Tensor, targets: torch.Tensor, preprocess) -> torch.Tensor:
    """Per-token predictions [B, c, ...] of logits [B, c, V] (argmax ids, or preprocess's answer)."""
    if preprocess is None:
        return logits.argmax(dim=-1)  # [B, c]
    out = preprocess(logits, targets)
    error = per_token_error(out, logits)
    if error is not None:
        raise ValueError(
            f"preprocess_logits_for_metrics must return one value per token with UPipeTrainer, a tensor "
            f"[B, T, ...] for logits [B, T, V] (e.g. logits.argmax(-1), or the log-probability of each target): "
            f"under sequence parallelism each rank sees only its tokens; {error}."
        )
    return out


def one_process_preprocess(preprocess, padding):
    """The Trainer's `preprocess_logits_for_metrics` in one process, predicting as with more: `predict_tile` with
    the aligned targets, then -100 where `padding()` (the batch's attention mask, or None) is 0."""

    def aligned(logits, labels):  # [B, S, V], [B, S] unshifted -> [B, S, ...]
        targets = None if labels is None else aligned_targets(labels)
        return mask_padding(predict_tile(logits, targets, preprocess), padding())

    return aligned


def shard_predictions(
    model,
    inputs: dict,
    shift_labels: torch.Tensor,
    *,
    tiled: bool = True,
    chunk_tokens: int | None = None,
    preprocess=None,
    ignore_index: int = -100,
    token_stats=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, fp32 scalar; per-token predictions [B, s, ...]) of this rank's shard (module docstring).

    Args:
        model, inputs, shift_labels, tiled, chunk_tokens, ignore_index, token_stats: as for `shard_loss_sum`.
        preprocess: `preprocess_logits_for_metrics(logits [B, c, V], targets [B, c]) -> [B, c, ...]`, or None
            for the argmax ids.

    Raises:
        ValueError: `preprocess` returned something that is not per-token.
    """
    B, s = shift_labels.shape
    if not tiled:
        loss_sum, outputs = shard_loss_sum(
            model,
            inputs,
            shift_labels,
            tiled=False,
            ignore_index=ignore_index,
            token_stats=token_stats,
        )
        return loss_sum, _tiles(
            lambda cols: outputs.logits[:, cols], shift_labels, chunk_tokens, preprocess
        )
    with head_input(model, inputs) as (hidden, head, bias, softcap, _, finish):  # hidden [B, s, Dm]
        loss_sum, _ = tiled_cross_entropy(
            hidden,
            head.weight,
            shift_labels,
            bias=bias,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
            logit_softcap=softcap,
            token_stats=token_stats,
        )

        def logits_of(cols: slice) -> torch.Tensor:  # [B, c, V], as the model computes them
            logits = F.linear(hidden[:, cols], head.weight, bias)
            return softcap * torch.tanh(logits / softcap) if softcap else logits

        return finish(loss_sum), _tiles(logits_of, shift_labels, chunk_tokens, preprocess)


def _tiles(logits_of, shift_labels: torch.Tensor, chunk_tokens, preprocess) -> torch.Tensor:
    """Per-token predictions [B, s, ...] of a shard, tile by tile; `logits_of(cols)`: the logits [B, c, V]."""
    B, s = shift_labels.shape
    first = logits_of(slice(0, 1))  # [B, 1, V]: the vocabulary size
    c = max(1, (chunk_tokens or default_chunk_tokens(first.shape[-1])) // B)  # positions per tile
    tiles = [
        predict_tile(logits_of(slice(i, i + c)), shift_labels[:, i : i + c], preprocess)
        for i in range(0, s, c)
    ]
    return torch.cat(tiles, dim=1)  # [B, s, ...]


def gather_sequence(
    local: torch.Tensor, state: SequenceParallelState, seq_len: int
) -> torch.Tensor:
    """Every SP rank's [B, s, ...] in global order, cut to the first `seq_len` positions: [B, seq_len, ...].

    Undoes `shard_batch`'s layout: contiguous shards (rank r: positions r*s .. r*s+s-1), or with a ring each rank's
    `ring_positions`; drops the padding to a multiple of sp_size. One all_gather over `state.sp_group`.
    """
    P = state.sp_size
    if P == 1:
        return local[:, :seq_len]
    s = local.shape[1]
    parts = [torch.empty_like(local) for _ in range(P)]
    dist.all_gather(parts, local.contiguous(), group=state.sp_group)  # P x [B, s, ...]
    ring = getattr(state, "ring_size", 1) or 1
    order = torch.cat(
        [ring_positions(r, s, P, ring, local.device) for r in range(P)]
    )  # [P*s]: the global position of each gathered column
    full = torch.empty(
        (local.shape[0], P * s, *local.shape[2:]), dtype=local.dtype, device=local.device
    )  # [B, S_padded, ...]
    full[:, order] = torch.cat(parts, dim=1)
    return full[:, :seq_len]


class PredictionRecorder:
    """Collects the per-token predictions of an evaluation pass, one batch at a time, on every rank.

    `forward(model, shard, batch)` (inside `UPipeRuntime.eval_sums`): the shard's summed loss; records the batch's
    predictions [B, S, ...] (global order, positions where `attention_mask` is 0 set to -100) and its `labels`
    [B, S] on the CPU. An error of `preprocess` on any rank of the SP group is agreed on (one tiny all_reduce per
    batch) and the pass goes on loss-only, so no collective is left waiting; `result()` raises it on every rank.
    `result()`: every data-parallel replica's batches in the one-process order (round by round, replica by
    replica), one all_gather_object over `state.dp_group`: (predictions, label_ids) lists per batch.
    """

    def __init__(self, runtime, preprocess=None, pad_index: int = -100):
        self.runtime, self.preprocess, self.pad_index = runtime, preprocess, pad_index
        self.batches: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.error: Exception | None = None

    def forward(self, model, shard: dict, batch: dict, stats=None) -> torch.Tensor:
        rt, state = self.runtime, self.runtime.state
        if self.error is not None:
            return rt.loss_sum(model, shard, stats)[0]
        inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
        error = None
        try:
            loss_sum, local = shard_predictions(
                model,
                inputs,
                shard["shift_labels"],
                tiled=rt.config.tiled_loss,
                chunk_tokens=rt.config.loss_chunk_tokens,
                preprocess=self.preprocess,
                token_stats=stats,
            )
        except ValueError as err:  # from preprocess, after the loss filled `stats`
            error, loss_sum = err, rt.loss_sum(model, shard)[0]
        if state.sp_size > 1:
            failed = torch.tensor([float(error is not None)], device=loss_sum.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=state.sp_group)
            if failed.item() and error is None:
                error = ValueError(
                    "preprocess_logits_for_metrics failed on another rank of this sequence-parallel group."
                )
        if error is not None:
            self.error = error
            return loss_sum
        ids = batch["input_ids"]  # [B, S]
        preds = gather_sequence(local, state, ids.shape[1]).cpu()  # [B, S, ...]
        preds = mask_padding(preds, batch.get("attention_mask"), self.pad_index)
        labels = batch.get("labels")
        self.batches.append((preds, None if labels is None else labels.detach().cpu()))
        return loss_sum

    def result(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every replica's batches in one-process order; raises a recorded error on every rank."""
        state = self.runtime.state
        mine = (self.batches, None if self.error is None else str(self.error))
        every = [mine]
        if state.dp_size > 1:
            every = [None] * state.dp_size
            dist.all_gather_object(every, mine, group=state.dp_group)
        errors = [e for _, e in every if e is not None]
        if errors:
            raise ValueError(errors[0])
        rounds = max(len(b) for b, _ in every)
        return [b[g] for g in range(rounds) for b, _ in every if g < len(b)]


def concat_predictions(batches, concat: bool = True):
    """Per-batch (predictions, labels) -> numpy arrays padded with -100 along the sequence, as the Trainer
    concatenates them (with `concat=False`, i.e. `eval_do_concat_batches=False`: lists of per-batch arrays)."""
    if not concat:
        labels = [lab for _, lab in batches]
        return [nested_numpify(p) for p, _ in batches], (
            None if any(lab is None for lab in labels) else [nested_numpify(x) for x in labels]
        )
    preds = labels = None
    for p, lab in batches:
        preds = p if preds is None else nested_concat(preds, p, padding_index=-100)
        if lab is not None:
            labels = lab if labels is None else nested_concat(labels, lab, padding_index=-100)
    return (
        None if preds is None else nested_numpify(preds),
        None if labels is None else nested_numpify(labels),
    )


def with_metrics(compute_metrics, preds, labels, metrics: dict, prefix: str) -> dict:
    """`metrics` plus `compute_metrics(EvalPrediction(preds, labels))` (when both exist), keys prefixed as the
    Trainer prefixes them."""
    if compute_metrics is None or preds is None or labels is None:
        return metrics
    computed = denumpify_detensorize(
        compute_metrics(EvalPrediction(predictions=preds, label_ids=labels))
    )
    computed.update(metrics)
    return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in computed.items()}
