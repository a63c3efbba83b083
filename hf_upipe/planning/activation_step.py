"""Per-rank activation memory of a training step of a Llama model under sequence parallelism (no FSDP2, no
optimizer: the activations alone; `hf_upipe.planning.train_step` measures the whole step).

Entry points:
- `measure_model_step(case, settings, *, group=None)`: one forward + backward of the model of `case` (a
  `hf_upipe.planning.model_step.StepCase`: config, length, SP degree, layers, dtype) with `settings` (its
  `StepSettings`: impl, head chunk, tiled MLP and loss, offload) on this rank's shard, with activation
  checkpointing on every layer (non-reentrant), under `MemoryTracker`. Works on real tensors in a real process
  group or on fake tensors in a simulated world.
- `simulate_model_step(case, settings)`: the same as rank 0 of a fake `case.sp_size`-rank world, in one process,
  at any length.
- `measure_layer_step(case, settings, *, group=None)` / `simulate_layer_step(case, settings)`: forward + backward
  of ONE decoder layer alone (no checkpointing, no embeddings or loss); like the attention-block benchmark, the
  layer input x and the incoming gradient are not counted.

The model and its implementations come from `hf_upipe.planning.model_step` (`build_step_model`, `impl_context`).

Counted: every tensor created during the step: embeddings, checkpointed layer inputs, one layer's recompute and
backward, the loss, all-to-all buffers and transient weight gradients. Not counted: parameters, and persistent
parameter gradients and optimizer states (each weight gradient is dropped as soon as it is accumulated, as FSDP2
does after its reduce-scatter; their sharded sizes are the planner's business). So "peak" is the activation peak.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from hf_upipe.planning.model_step import StepCase, StepSettings, build_step_model, impl_context
from hf_upipe.planning.simulate import fake_tensors, simulated_world
from hf_upipe.planning.tracker import MemoryTracker, checkpoint_label

__all__ = [
    "measure_layer_step",
    "measure_model_step",
    "simulate_layer_step",
    "simulate_model_step",
]


def measure_model_step(
    case: StepCase,
    settings: StepSettings,
    *,
    group: dist.ProcessGroup | None = None,
    snapshot: bool = False,
    categories: bool = False,
) -> dict:
    """Tracked training step (forward + backward) of a `case.layers`-layer model on this rank's shard, parameters
    and activations in `case.dtype`.

    `settings`: the impl, its head chunk, the tiled MLP and loss with their tiles (None: the defaults), the offload
    of the checkpointed inputs. With `categories`, also `"by_category"`: what was live at the peak, by
    `hf_upipe.planning.categories.CATEGORIES`.

    Returns:
        {"forward_peak", "peak", "unit"} in bytes; unit = s * hidden * bytes, one local activation.
    """
    from hf_upipe.planning.categories import StepCategories
    from hf_upipe.training.loss import shard_loss_sum
    from hf_upipe.training.offload import offload_checkpoints

    group = dist.group.WORLD if group is None else group
    s, rank = case.seq_len // case.sp_size, dist.get_rank(group)
    with impl_context(settings.impl, group, case.seq_len, case.sp_size, settings.heads_per_chunk):
        model = build_step_model(case, settings, group, dtype=case.dtype)
        ids = torch.zeros(1, s, dtype=torch.long)  # not counted: token ids, positions, labels
        positions = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0)  # [1, s] global
        labels = torch.zeros(1, s, dtype=torch.long)
        # an all-ones 2-D mask: transformers then builds no packed-sequence mask from the (fake) positions
        mask = torch.ones(1, s, dtype=torch.long)
        inputs = {"input_ids": ids, "position_ids": positions, "attention_mask": mask}
        labels_ctx = StepCategories(model) if categories else contextlib.nullcontext()
        with (
            labels_ctx as cats,
            MemoryTracker(snapshot_at_peak=snapshot, labeler=cats and cats.label) as tracker,
            offload_checkpoints(
                model, settings.offload, min_bytes=0, restore_context=checkpoint_label
            ),
        ):
            if cats:
                cats.attach(tracker)
            loss, _ = shard_loss_sum(
                model,
                inputs,
                labels,
                tiled=settings.tiled_loss,
                chunk_tokens=settings.loss_chunk_tokens,
            )
            if cats:
                cats.label_loss(loss)
            tracker.mark("forward")
            loss.backward()
            tracker.mark("backward")
            del loss
    result = {
        "forward_peak": tracker.phase_peaks["forward"],
        "peak": tracker.peak_bytes,
        "unit": s * case.model_config["hidden_size"] * torch.finfo(case.dtype).bits // 8,
    }
    if snapshot:
        result["peak_snapshot"] = tracker.peak_snapshot
    if categories:
        result["by_category"] = tracker.peak_by_label
    return result


def measure_layer_step(
    case: StepCase, settings: StepSettings, *, group: dist.ProcessGroup | None = None
) -> dict:
    """Tracked forward + backward of one decoder layer of `case.model_config` (in `case.dtype`, whatever
    `case.layers`) with `settings`' impl, head chunk and tiled MLP on this rank's shard.

    Returns:
        {"forward_peak", "peak", "unit"} in bytes (x and the incoming gradient not counted).
    """
    group = dist.group.WORLD if group is None else group
    case, dtype = dataclasses.replace(case, layers=1), case.dtype
    s, rank = case.seq_len // case.sp_size, dist.get_rank(group)
    with impl_context(settings.impl, group, case.seq_len, case.sp_size, settings.heads_per_chunk):
        model = build_step_model(case, settings, group, dtype=dtype, checkpointing=False)
        layer = model.model.layers[0]
        hidden = case.model_config["hidden_size"]
        x = torch.randn(1, s, hidden, dtype=dtype, requires_grad=True)
        positions = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0)  # [1, s] global
        cos, sin = model.model.rotary_emb(x, positions)
        grad_y = torch.ones_like(x)
        with MemoryTracker() as tracker:
            y = layer(
                x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin)
            )
            y = y[0] if isinstance(y, tuple) else y  # [1, s, hidden]
            tracker.mark("forward")
            y.backward(grad_y)
            tracker.mark("backward")
            del y
    return {
        "forward_peak": tracker.phase_peaks["forward"],
        "peak": tracker.peak_bytes,
        "unit": s * hidden * torch.finfo(dtype).bits // 8,
    }


def simulate_layer_step(case: StepCase, settings: StepSettings) -> dict:
    """`measure_layer_step` as rank 0 of a fake `case.sp_size`-rank world on fake tensors."""
    with simulated_world(case.sp_size) as world, fake_tensors(case.dtype):
        return measure_layer_step(case, settings, group=world)


def simulate_model_step(case: StepCase, settings: StepSettings, **kwargs) -> dict:
    """`measure_model_step` as rank 0 of a fake `case.sp_size`-rank world on fake tensors (one process, no data);
    `kwargs`: its `snapshot` and `categories`."""
    with simulated_world(case.sp_size) as world, fake_tensors(case.dtype):
        return measure_model_step(case, settings, group=world, **kwargs)
