"""Worker body for the FSDP2 layout tests (spawned gloo ranks): a tiny Llama under hf_upipe's SP and FSDP2
(`fully_shard` over all ranks, as accelerate's FSDP2 does), saved and resumed with torch distributed checkpoints
(what accelerate's FSDP2 `SHARDED_STATE_DICT` save uses), which reshard on load."""

from __future__ import annotations

import json
import os

import torch

from tests.training._runs import _dataset, _model

GLOBAL_BATCH = 4


def _rows(step: int) -> dict:
    """The global batch of optimizer step `step` (0-based): 4 rows of 29 tokens, a function of the step."""
    data = _dataset(32, 29, 96, seed=4)
    rows = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
    return {k: torch.tensor(v) for k, v in rows.items()}


def fsdp2_layout_run(rank: int, world: int, spec: dict) -> dict:
    """Steps [start, spec["steps"]) of AdamW at SP spec["sp"] (DP = world / sp; 4 / DP rows per replica), the
    model and optimizer sharded by FSDP2 over all ranks. `spec["resume"]`: a folder saved by this function (any
    world); `spec["save_at"]`: the step after which to save into `spec["save_to"]`. Returns the global loss of each
    step, or the refusal's message."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_upipe import UPipeConfig, init_sequence_parallel, prepare_model, shard_batch
    from hf_upipe.training.checkpoint import CheckpointError, verify_checkpoint
    from hf_upipe.training.checkpoint_layout import (
        TrainingLayout,
        check_resume_layout,
        model_fingerprint,
    )
    from hf_upipe.training.runtime import UPipeRuntime

    sp = spec["sp"]
    model = _model(spec["lora"], seed=11)
    cfg = UPipeConfig(sp_size=sp, loss_chunk_tokens=7)
    state = init_sequence_parallel(sp)
    prepare_model(model, cfg)
    mesh = init_device_mesh("cpu", (world,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    rows = spec.get("rows", GLOBAL_BATCH // state.dp_size)
    layout = TrainingLayout(sp, 1, state.dp_size, world, rows, 1, model_fingerprint(model))
    start = 0
    if spec.get("resume"):
        try:
            check_resume_layout(spec["resume"], layout)
        except CheckpointError as err:
            return {"error": str(err)}
        verify_checkpoint(spec["resume"])
        model_sd, optim_sd = get_state_dict(model, opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=os.path.join(spec["resume"], "dcp"))
        set_state_dict(
            model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        with open(os.path.join(spec["resume"], "step.json")) as f:
            start = json.load(f)["step"]
    losses = {}
    for step in range(start, spec["steps"]):
        full = _rows(step)
        mine = {k: v[state.dp_rank * rows : (state.dp_rank + 1) * rows] for k, v in full.items()}
        shard = shard_batch(mine, state.sp_rank, state.sp_size)
        loss = upipe.loss(model, shard, upipe.count([shard]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor(loss.item() / world)
        torch.distributed.all_reduce(total)
        losses[step + 1] = total.item()
        if step + 1 == spec.get("save_at"):
            _save(spec["save_to"], step + 1, model, opt, layout, rank)
    return {"losses": losses}


def _save(folder: str, step: int, model, opt, layout, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hf_upipe.training.checkpoint import write_manifest
    from hf_upipe.training.checkpoint_layout import write_layout

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
    if rank == 0:
        write_layout(folder, layout)
        with open(os.path.join(folder, "step.json"), "w") as f:
            json.dump({"step": step}, f)
    torch.distributed.barrier()
    write_manifest(folder)


def layout_runs(rank: int, world: int, trainer_specs: list[dict], fsdp2_specs: list[dict]) -> dict:
    """The Trainer runs (`tests.training._runs.train_run`), then the FSDP2 runs, in the same processes."""
    from hf_upipe import reset_sequence_parallel
    from tests.training._runs import train_runs

    trainer = train_runs(rank, world, trainer_specs)
    fsdp2 = []
    for spec in fsdp2_specs:
        reset_sequence_parallel()
        fsdp2.append(fsdp2_layout_run(rank, world, spec))
    return {"trainer": trainer, "fsdp2": fsdp2}
