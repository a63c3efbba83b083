"""Worker bodies for the plugin tests (spawned gloo ranks)."""

from __future__ import annotations

import os

import torch

from tests.training._runs import _dataset, _model


def _batches(n: int, batch: int):
    data = _dataset(n * batch, 29, 96, seed=4)
    for i in range(n):
        rows = data[i * batch : (i + 1) * batch]
        yield {k: torch.tensor(v) for k, v in rows.items()}


def fsdp2_steps(rank: int, world: int, lora: bool, sp: int) -> list[float]:
    """3 AdamW steps of a tiny Llama under FSDP2 (fully_shard over all ranks, CPU mesh) with SP `sp`, sharded by
    `shard_batch` and the plugin's token-weighted loss; every rank returns the global loss of each step. With
    world == 1 it is the independent reference: the plain model ("sdpa", untiled) with transformers' own loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_upipe import UPipeConfig, init_sequence_parallel, prepare_model, shard_batch
    from hf_upipe.training.runtime import NO_SP, UPipeRuntime

    model = _model(lora, seed=11)
    cfg = UPipeConfig(sp_size=sp, loss_chunk_tokens=7, tiled_mlp=True, mlp_chunk_tokens=6)
    state = init_sequence_parallel(sp) if world > 1 else NO_SP
    if world > 1:
        prepare_model(model, cfg)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in base.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    rows = (
        4 // state.dp_size
    )  # the same global batch of 4 rows whatever the layout: DP replicas split it
    out = []
    for full in _batches(3, 4):
        if world == 1:  # reference: transformers' loss on the whole batch
            loss = model(**full).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
            continue
        mine = {k: v[state.dp_rank * rows : (state.dp_rank + 1) * rows] for k, v in full.items()}
        shard = shard_batch(mine, state.sp_rank, state.sp_size)
        n = upipe.count([shard])
        loss = upipe.loss(model, shard, n)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = torch.tensor(loss.item() / world)
        torch.distributed.all_reduce(total)
        out.append(total.item())
    return out


def bad_settings(rank: int, world: int) -> dict:
    """UPipePlugin errors, on every rank, before any collective."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from accelerate import Accelerator

    from hf_upipe import UPipePlugin

    seen = {}
    for key, make in [
        ("kernel", lambda: UPipePlugin(kernel="flash9")),
        ("sp", lambda: UPipePlugin(sp_size=3).prepare(Accelerator(cpu=True), _model(False, 1))),
        (
            "offload",
            lambda: UPipePlugin(sp_size=2, offload="disk").prepare(
                Accelerator(cpu=True), _model(False, 1)
            ),
        ),
    ]:
        try:
            make()
        except ValueError as err:
            seen[key] = str(err)
    # heads that do not split over the SP group: 8 query / 2 kv heads cannot be cut into heads_per_chunk=3; raised
    # by prepare, before any forward
    try:
        UPipePlugin(sp_size=2, heads_per_chunk=3).prepare(Accelerator(cpu=True), _model(False, 1))
    except ValueError as err:
        seen["heads"] = str(err)
    # settings that differ between ranks (they would pair different all-to-alls): refused on both, by name
    try:
        UPipePlugin(
            sp_size=2, **({"fused_backward": "save", "overlap_comm": True} if rank == 0 else {})
        ).prepare(Accelerator(cpu=True), _model(False, 1))
    except ValueError as err:
        seen["differ"] = str(err)
    return seen


def fsdp2_eval(rank: int, world: int, lora: bool, sp: int) -> float:
    """`UPipeRuntime.evaluate` of 9 rows in batches of 2 through an accelerate-prepared loader, the model under
    FSDP2 with SP `sp`: rounds of 4, 4 and 1 rows at SP 2 x DP 2, so one replica runs out of batches and must run a
    throw-away forward (else FSDP's all-gathers hang). World 1: the reference, transformers' own loss on all 9 rows
    in one batch (the token mean over every label token)."""
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from hf_upipe import UPipeConfig, init_sequence_parallel, prepare_model
    from hf_upipe.training.runtime import UPipeRuntime

    model = _model(lora, seed=12)
    data = _dataset(9, 29, 96, seed=6)
    if world == 1:
        with torch.no_grad():
            return model(
                **next(iter(DataLoader(data, batch_size=9, collate_fn=default_data_collator)))
            ).loss.item()
    cfg = UPipeConfig(sp_size=sp, loss_chunk_tokens=7)
    state = init_sequence_parallel(sp)
    prepare_model(model, cfg)
    mesh = init_device_mesh("cpu", (world,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loader = Accelerator(cpu=True).prepare(
        DataLoader(data, batch_size=2, collate_fn=default_data_collator)
    )
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    return [upipe.evaluate(model, loader) for _ in range(2)]
