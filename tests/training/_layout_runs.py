"""Worker bodies for the layout tests (spawned gloo ranks): the Trainer runs of `tests.training._runs`, and
UPipeTrainer and the custom loop of examples/finetune_long_context.py (`UPipePlugin`) under accelerate's own FSDP2,
which accelerate sets up on accelerators only: `accelerate_fsdp2_on_cpu` lets it run over gloo."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch

from tests.training._runs import _dataset, _model


@contextlib.contextmanager
def accelerate_fsdp2_on_cpu():
    """accelerate's own FSDP2 over gloo: accelerate sets up FSDP on accelerators only (an `AcceleratorState` on
    CPU keeps MULTI_CPU and drops its FSDP plugin), so while this is active an `AcceleratorState` created with an FSDP
    plugin on CPU becomes an FSDP one. Everything after that is accelerate's and transformers' own FSDP2 code:
    `fsdp2_prepare_model` (the decoder layers, the embeddings and the [final norm, lm_head] tail sharded over all
    ranks), its SHARDED_STATE_DICT save and load (torch distributed checkpoints), `get_state_dict`. On exit:
    accelerate's class, the environment (the FSDP plugin and TrainingArguments export ACCELERATE_USE_FSDP and
    FSDP_*) and accelerate's shared state are restored, so later runs in the process are DDP runs again."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    init, environ = AcceleratorState.__init__, dict(os.environ)

    def fsdp_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = fsdp_on_cpu
    try:
        yield
    finally:
        AcceleratorState.__init__ = init
        os.environ.clear()
        os.environ.update(environ)
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        if "distributed_type" in PartialState._shared_state:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU


def _example():
    """examples/finetune_long_context.py as a module: its `save_checkpoint` and `load_missing_random_states`."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "examples", "finetune_long_context.py")
    spec = importlib.util.spec_from_file_location("finetune_long_context", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full_params(model, rank: int) -> dict | None:
    """Rank 0's {name: array} of the trainable parameters, whole (DTensor shards gathered: a collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = whole.detach().numpy().copy()
    return out if rank == 0 else None


def plugin_fsdp2_run(rank: int, world: int, spec: dict) -> dict:
    """The custom loop of examples/finetune_long_context.py (`UPipePlugin.prepare`, `upipe.windows`, `upipe.loss`,
    the learning rate set from the step, its `save_checkpoint` and resume sequence) under accelerate's FSDP2
    (SHARDED_STATE_DICT) on gloo: steps [start, spec["steps"]) at SP spec["sp"] (ring spec.get("ring", 1)) with
    spec["rows"] rows per device and spec["ga"] accumulation steps; `spec["save_at"]`: the step to save at into
    `spec["save_to"]`; `spec["resume"]`: a checkpoint to resume from (any layout). Returns the global loss of
    each step, a digest of torch's generator before each step, rank 0's final trainable weights, or the
    refusal's message."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from hf_upipe import reset_sequence_parallel

    reset_sequence_parallel()
    with accelerate_fsdp2_on_cpu():
        return _plugin_fsdp2(rank, world, spec)


def _plugin_fsdp2(rank: int, world: int, spec: dict) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from hf_upipe import UPipePlugin
    from hf_upipe.training.checkpoint_layout import TrainingLayout, model_fingerprint

    fsdp = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=fsdp,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = _model(spec["lora"], seed=11)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0
    )
    data = _dataset(32, 29, 96, seed=4)  # rows [4k, 4k + 4): optimizer step k at every layout
    loader = DataLoader(
        data, batch_size=spec["rows"], collate_fn=default_data_collator, drop_last=True
    )
    plugin = UPipePlugin(sp_size=spec["sp"], ring_size=spec.get("ring", 1), loss_chunk_tokens=7)
    model, optimizer, loader, upipe = plugin.prepare(accelerator, model, optimizer, loader)
    state = upipe.state
    layout = TrainingLayout(
        state.sp_size,
        state.ring_size,
        state.dp_size,
        world,
        spec["rows"],
        spec["ga"],
        model_fingerprint(model),
    )
    step, out = 0, {}
    if spec.get("resume"):
        step, out = _resume(accelerator, spec["resume"], layout, rank)
        if "error" in out:
            return out
    return {
        **out,
        **_plugin_steps(accelerator, model, optimizer, loader, upipe, step, layout, spec),
    }


def _resume(accelerator, folder: str, layout, rank: int) -> tuple[int, dict]:
    """The example's resume sequence: (the saved step, {"rng_loaded": the generator's digest once loaded}), or
    (0, {"error": the refusal})."""
    from hf_upipe.training.checkpoint import CheckpointError, verify_checkpoint
    from hf_upipe.training.checkpoint_layout import check_resume_layout

    try:
        check_resume_layout(folder, layout)
    except CheckpointError as err:
        return 0, {"error": f"{type(err).__name__}: {err}"}
    verify_checkpoint(folder)
    accelerator.load_state(os.path.join(folder, "accelerate_state"))
    _example().load_missing_random_states(os.path.join(folder, "accelerate_state"), rank)
    with open(os.path.join(folder, "step.json")) as f:
        return json.load(f)["step"], {"rng_loaded": _rng_digest()}


def _rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def _plugin_steps(accelerator, model, optimizer, loader, upipe, step: int, layout, spec) -> dict:
    """The example's loop from `step` (its data skip, windows, no_sync, learning rate by step, save)."""
    ga, world = spec["ga"], accelerator.num_processes
    plain = loader.dataloader
    loader.dataloader = accelerator.skip_first_batches(plain, step * ga) if step else plain
    losses, rng = {}, []
    for window in upipe.windows(loader, ga):
        rng.append(_rng_digest())
        n, total = upipe.count(window), 0.0
        for i, shard in enumerate(window):
            last = i == len(window) - 1
            with (
                contextlib.nullcontext() if last else accelerator.no_sync(model),
                upipe.step(model),
            ):
                loss = upipe.loss(model, shard, n)
                accelerator.backward(loss)
            total += loss.item() / world
        for (
            group
        ) in optimizer.param_groups:  # the schedule, a function of the step (as the example's)
            group["lr"] = _learning_rate(step)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        losses[step] = accelerator.reduce(torch.tensor(total), "sum").item()
        if step == spec.get("save_at"):
            _example().save_checkpoint(accelerator, model, spec["save_to"], step, None, layout)
        if step >= spec["steps"]:
            break
    rng.append(_rng_digest())  # after the last step: what a save there holds
    return {"losses": losses, "rng": rng, "params": _full_params(model, accelerator.process_index)}


def _learning_rate(step: int) -> float:
    """2e-3 falling linearly by a quarter per step (0-based), so a resume at the wrong step shows."""
    return 2e-3 * (1 - step / 4)


FSDP2_TRAINER = dict(
    fsdp="full_shard",
    fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
)


def trainer_fsdp2_run(rank: int, world: int, spec: dict) -> dict:
    """`tests.training._runs.train_run` of UPipeTrainer under accelerate's FSDP2 (TrainingArguments fsdp=
    "full_shard", fsdp_config version 2, transformers' default state dict type unless spec["state_dict_type"])."""
    from tests.training._runs import train_run

    config = dict(FSDP2_TRAINER["fsdp_config"])
    if spec.get("state_dict_type"):
        config["state_dict_type"] = spec["state_dict_type"]
    with accelerate_fsdp2_on_cpu():
        return train_run(rank, world, {**spec, "args": dict(FSDP2_TRAINER, fsdp_config=config)})


def plugin_reference(lora: bool, steps: int = 4) -> dict:
    """One process, no hf_upipe: the plain model with transformers' own loss on the 4 rows of each step (the token
    mean over them), AdamW with `_learning_rate`: what `plugin_fsdp2_run` must compute at any layout."""
    model = _model(lora, seed=11)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.0
    )
    data, losses = _dataset(32, 29, 96, seed=4), {}
    for step in range(steps):
        rows = {k: torch.tensor(v) for k, v in data[4 * step : 4 * step + 4].items()}
        loss = model(**rows).loss
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step)
        optimizer.step()
        optimizer.zero_grad()
        losses[step + 1] = loss.item()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "params": params}


def layout_runs(rank: int, world: int, trainer_specs: list[dict], fsdp2_specs: list) -> dict:
    """The Trainer runs (`tests.training._runs.train_run`, DDP), then the accelerate FSDP2 runs (("trainer" |
    "plugin", spec) pairs: `trainer_fsdp2_run`, `plugin_fsdp2_run`), in the same processes."""
    from tests.training._runs import train_runs

    trainer = train_runs(rank, world, trainer_specs)
    run = {"trainer": trainer_fsdp2_run, "plugin": plugin_fsdp2_run}
    fsdp2 = [run[kind](rank, world, spec) for kind, spec in fsdp2_specs]
    return {"trainer": trainer, "fsdp2": fsdp2, "resharded_head": resharded_head(rank, world)}


def resharded_head(rank: int, world: int) -> str:
    """The tiled loss on a model whose lm_head FSDP2 reshards after its forward (`fully_shard(lm_head)` with its
    default reshard_after_forward=True): refused by name, on every rank, before any backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_upipe import (
        UPipeConfig,
        init_sequence_parallel,
        prepare_model,
        reset_sequence_parallel,
        shard_batch,
    )
    from hf_upipe.training.runtime import UPipeRuntime

    reset_sequence_parallel()
    model = _model(False, seed=11)
    cfg = UPipeConfig(sp_size=world, loss_chunk_tokens=7)
    state = init_sequence_parallel(world)
    prepare_model(model, cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    rows = {k: torch.tensor(v) for k, v in _dataset(2, 29, 96, seed=4)[:2].items()}
    shard = shard_batch(rows, state.sp_rank, state.sp_size)
    try:
        upipe.loss(model, shard, upipe.count([shard]))
    except NotImplementedError as err:
        return str(err)
    return "not refused"
