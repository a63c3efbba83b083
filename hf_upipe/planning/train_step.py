"""Per-rank memory of one whole FSDP2 training step, by category: the measurement behind `hf_upipe.plan`.

Entry points:
- `StepSettings`, `StepCase`, `device_twin` (defined in `hf_upipe.planning.model_step`): the knobs of a step and
  what it runs.
- `measure_train_step(case, settings)`: on this rank of an initialised world, builds the model of `case`
  (`StepCase`: model config, depth, length, SP degree, compute dtype, LoRA, kernel) with its decoder layers,
  shards it with FSDP2 (`fully_shard` on every decoder layer and on the root, over all ranks; fp32 master weights,
  `dtype` compute with fp32 gradient reduction unless `dtype` is fp32; or LoRA adapters on a frozen base), creates
  AdamW's states, then runs one step under `MemoryTracker`: forward and backward of this rank's sequence shard with
  activation checkpointing on every layer, then `optimizer.step()`.
- `simulate_train_step(case, settings, *, world_size)`: the same as rank 0 of a fake `world_size`-rank world on fake
  tensors, in one process.

What is counted, per rank: the FSDP2 shards of the parameters, their gradients and the optimizer states (already
there when the step starts: steady state), and everything the step allocates: FSDP2's all-gather buffers and
unsharded parameters, reduce-scatter buffers, activations, checkpointed inputs, the loss, the optimizer's
temporaries. With `StepSettings.model_offload='cpu'` (FSDP2's `CPUOffloadPolicy`) the shards, the reduced
gradient shards, AdamW's states and its step are counted in host memory instead (`host_peak`), and each shard's
copy to the device for its all-gather on the device (`_host_model_state`). Returned by category (`CATEGORIES`):
"parameters" (shards and unsharded copies), "gradients", "optimizer", and those of `hf_upipe.planning.categories` for
the activations. Not counted (a GPU adds them; the planner predicts them: hf_upipe.planning.reserved): the CUDA
context, NCCL buffers, kernel workspaces, allocator rounding and caching.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hf_upipe import distributed as _sp
from hf_upipe.ops.ring import ring_positions
from hf_upipe.planning import categories as _cat
from hf_upipe.planning.hollow_step import step_attention
from hf_upipe.planning.model_step import (
    StepCase,
    StepSettings,
    build_step_model,
    device_twin,
    impl_context,
)
from hf_upipe.planning.simulate import fake_tensors, simulated_world
from hf_upipe.planning.tracker import (
    MemoryTracker,
    allocation_stream,
    checkpoint_label,
    host_memory,
    storage_label,
    to_host,
)

__all__ = [
    "CATEGORIES",
    "StepCase",
    "StepSettings",
    "device_twin",
    "measure_train_step",
    "simulate_train_step",
]

CATEGORIES = ("parameters", "gradients", "optimizer", *_cat.CATEGORIES)


@contextlib.contextmanager
def _restored_checkpoint():
    """The offload's copies back to the device: counted as checkpoints, on the stream the offload allocates them."""
    from hf_upipe.training.offload import RESTORE_STREAM

    with checkpoint_label(), allocation_stream(RESTORE_STREAM):
        yield


def _fsdp_labels(model) -> contextlib.ExitStack:
    """Labels FSDP2's allocations: unshard (all-gathers) -> "parameters", post-backward (reduce-scatter) -> "gradients".

    FSDP2 offers no public hook for this; the wrappers sit on each module's FSDPParamGroup instance and are removed
    on exit.
    """
    from torch.distributed.fsdp import FSDPModule

    stack = contextlib.ExitStack()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for name, label in (
            ("unshard", "parameters"),
            ("wait_for_unshard", "parameters"),
            ("post_backward", "gradients"),
        ):
            original = getattr(group, name)

            def wrapped(*args, _original=original, _label=label, **kwargs):
                with storage_label(_label):
                    return _original(*args, **kwargs)

            setattr(group, name, wrapped)
            stack.callback(delattr, group, name)  # the class method again
    return stack


@contextlib.contextmanager
def _host_model_state(model, model_offload: str):
    """With model_offload='cpu', what a GPU does under FSDP2's `CPUOffloadPolicy` that a CPU step cannot show, since
    its host and device are the same memory: each parameter shard's copy to the device before its all-gather (a
    `clone` where the CPU's `.to(device)` returns the shard itself; freed once cast or gathered, as on the GPU), and
    each reduced gradient shard moved to host memory after its group's post-backward (`to_host`: the GPU copies it
    to the host and frees the device's). Nothing with 'none'."""
    if model_offload != "cpu":
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    original = FSDPParam.all_gather_inputs

    def all_gather_inputs(self):
        if self.sharded_state != ShardedState.SHARDED or hasattr(
            self._sharded_local_tensor, "fsdp_pre_all_gather"
        ):
            return original.fget(self)
        return [_to_dtype_if_needed(self._sharded_param_data.clone(), self.param_dtype)]

    groups = []
    for module in model.modules():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        if group is not None:
            groups.append((group, group.__dict__.get("post_backward")))

            def post_backward(*args, _group=group, _original=group.post_backward, **kwargs):
                out = _original(*args, **kwargs)
                to_host(
                    *(
                        p.sharded_param.grad
                        for p in _group.fsdp_params
                        if p.sharded_param.grad is not None
                    )
                )
                return out

            group.post_backward = post_backward
    FSDPParam.all_gather_inputs = property(all_gather_inputs)
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = original
        for group, previous in groups:  # the wrapper of `_fsdp_labels` again, or the class method
            if previous is None:
                del group.post_backward
            else:
                group.post_backward = previous


def fsdp_mesh():
    """The 1-D FSDP mesh over all ranks (built outside fake mode: it reads tensor values)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(model, dtype: torch.dtype, mesh, model_offload: str = "none") -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    # the policy a run gets (hf_upipe.training.model_offload), unpinned: fake tensors cannot be pinned
    offload = (
        {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if model_offload == "cpu" else {}
    )
    for layer in _cat.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, **offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, **offload)


def _local(tensors) -> list[torch.Tensor]:
    """This rank's shards of (D)tensors, skipping non-tensors and None."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors if torch.is_tensor(t)]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (FSDP2's gradients are views of shared buffers)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _optimizer_with_states(model) -> torch.optim.Optimizer:
    """AdamW (foreach, as on GPUs) whose states exist already: the steady state of training."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, foreach=True)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _step_model(case: StepCase, settings: StepSettings, group):
    """`build_step_model` for a tracked FSDP2 step: fp32 master weights (LoRA: the base in `dtype`), gradients kept."""
    dtype = torch.float32 if case.lora is None else case.dtype
    return build_step_model(case, settings, group, dtype=dtype, drop_grads=False)


def _step_inputs(rank: int, s: int, sp_size: int, ring_size: int) -> tuple[dict, torch.Tensor]:
    """(inputs, labels) of this rank's `s` tokens; not counted: token ids, positions, labels, mask."""
    ids = torch.zeros(1, s, dtype=torch.long)  # [1, s]
    positions = ring_positions(rank, s, sp_size, ring_size)  # [s]: contiguous, or in ring order
    inputs = {
        "input_ids": ids,
        "position_ids": positions.unsqueeze(0),  # [1, s]
        "attention_mask": torch.ones(1, s, dtype=torch.long),
    }
    labels = torch.zeros(1, s, dtype=torch.long)
    return inputs, labels


def _track_static(tracker: MemoryTracker, model, optimizer, on_host: bool = False) -> dict:
    """Tracks this rank's parameter and optimizer-state shards, already there when the step starts (in host memory
    when `on_host`): their bytes."""
    static = {}
    for label, tensors in (
        ("parameters", list(model.parameters())),
        ("optimizer", [t for st in optimizer.state.values() for t in st.values()]),
    ):
        before = tracker.current_bytes + tracker.host_bytes
        with storage_label(label), host_memory() if on_host else contextlib.nullcontext():
            tracker.track(*_local(tensors))
        static[label] = tracker.current_bytes + tracker.host_bytes - before
    return static


def measure_train_step(
    case: StepCase, settings: StepSettings, *, mesh=None, around_step=None
) -> dict:
    """One tracked FSDP2 training step on this rank (see the module docstring).

    Args:
        case: what the step runs (`StepCase`: model config, depth, length, SP degree, dtype, LoRA, kernel).
        settings: the step's `StepSettings`.
        mesh: the FSDP device mesh over all ranks (default: built here; under fake tensors build it before).
        around_step: a context entered around the step (after the build and the optimizer's states).

    Returns:
        {"peak": bytes, "by_category": {category: bytes live at the peak}, "phase_peaks": {"forward", "backward",
        "optimizer"}, "static": {"parameters", "gradients", "optimizer": bytes of this rank's shards},
        "host_peak": the peak of host memory (`settings.model_offload='cpu'`: the shards, the optimizer's step;
        else 0)}. With model_offload='cpu' the device's numbers exclude what is in host memory.
    """
    from hf_upipe.training.loss import shard_loss_sum
    from hf_upipe.training.offload import offload_checkpoints

    seq_len, sp_size, kernel = case.seq_len, case.sp_size, case.kernel
    if seq_len % sp_size:
        raise ValueError(f"seq_len={seq_len} is not divisible by sp_size={sp_size}")
    previous = _sp.get_sequence_parallel_state()
    attention = step_attention(settings.impl, kernel)  # (validates kernel for DeepSpeed's impl)
    state = _sp.init_sequence_parallel(
        sp_size, heads_per_chunk=settings.heads_per_chunk, kernel=kernel
    )
    group = state.sp_group if state.sp_group is not None else dist.group.WORLD
    s, r = seq_len // sp_size, state.sp_rank
    try:
        with (
            impl_context(
                settings.impl,
                group,
                seq_len,
                sp_size,
                settings.heads_per_chunk,
                settings.ring_size,
                kernel=kernel,
            ),
            attention,
        ):
            model = _step_model(case, settings, group)
            _shard(
                model, case.dtype, mesh if mesh is not None else fsdp_mesh(), settings.model_offload
            )
            optimizer = _optimizer_with_states(model)
            inputs, labels = _step_inputs(r, s, sp_size, settings.ring_size)
            with (
                around_step if around_step is not None else contextlib.nullcontext(),
                _cat.StepCategories(model) as cats,
                MemoryTracker(labeler=cats.label) as tracker,
                _fsdp_labels(model),
                _host_model_state(model, settings.model_offload),
            ):
                cats.attach(tracker)
                on_host = settings.model_offload == "cpu"
                static = _track_static(tracker, model, optimizer, on_host)
                with offload_checkpoints(
                    model, settings.offload, min_bytes=0, restore_context=_restored_checkpoint
                ):
                    loss, _ = shard_loss_sum(
                        model,
                        inputs,
                        labels,
                        tiled=settings.tiled_loss,
                        chunk_tokens=settings.loss_chunk_tokens,
                    )
                    cats.label_loss(loss)
                    tracker.mark("forward")
                    loss.backward()
                    del loss
                    tracker.mark("backward")
                static["gradients"] = _storage_bytes(_local(p.grad for p in model.parameters()))
                with (
                    storage_label("optimizer"),
                    host_memory() if on_host else contextlib.nullcontext(),
                ):
                    optimizer.step()
                tracker.mark("optimizer")
    finally:
        _sp.set_sequence_parallel_state(previous)
    return {
        "peak": tracker.peak_bytes,
        "by_category": tracker.peak_by_label,
        "phase_peaks": dict(tracker.phase_peaks),
        "static": static,
        "host_peak": tracker.host_peak_bytes,
    }


def simulate_train_step(case: StepCase, settings: StepSettings, *, world_size: int) -> dict:
    """`measure_train_step` as rank 0 of a fake `world_size`-rank world on fake tensors (one process, no data).
    offload="disk" is simulated as its `device_twin` (fake tensors cannot be written to files)."""
    with simulated_world(world_size):
        mesh = fsdp_mesh()
        with fake_tensors(torch.float32):
            return measure_train_step(case, device_twin(settings), mesh=mesh)
