"""Worker bodies for distributed memory-feature tests: a few DDP / FSDP2 steps with and without the tiled MLP."""

from __future__ import annotations

import torch


def _model(lora: bool):
    from transformers import AutoModelForCausalLM

    from tests.integrations._models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", layers=2), attn_implementation="sdpa"
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                init_lora_weights=False,
                target_modules=["gate_proj", "up_proj", "down_proj"],
            ),
        )
    return model


def _wrap(model, wrapper: str):
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def steps(
    rank: int, world: int, wrapper: str, tiled: bool, lora: bool, checkpointing: bool
) -> dict:
    from torch.distributed.tensor import DTensor

    from hf_upipe.adapters.tiled_mlp import apply_tiled_mlp

    model = _model(lora)
    if checkpointing:
        model.activation_checkpointing_enable()
    if tiled:
        assert apply_tiled_mlp(model, chunk_tokens=6) == 2
    model.train()
    wrapped = _wrap(model, wrapper)
    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(
        100 + rank
    )  # each rank its own data: gradients must be reduced
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 29), generator=gen)
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = full.detach().numpy().copy()
    return {"losses": losses, "params": params}


def compare(rank: int, world: int, wrapper: str, lora: bool, checkpointing: bool) -> dict:
    plain = steps(rank, world, wrapper, False, lora, checkpointing)
    tiled = steps(rank, world, wrapper, True, lora, checkpointing)
    worst = max(abs(a - b) / abs(b) for a, b in zip(tiled["losses"], plain["losses"]))
    pworst = max(
        float(abs(tiled["params"][n] - v).max() / max(abs(v).max(), 1e-12))
        for n, v in plain["params"].items()
    )
    return {"loss_rel": worst, "param_rel": pworst, "n": len(plain["params"])}


CASES = [("ddp", False, False), ("ddp", True, True), ("fsdp2", False, True), ("fsdp2", True, False)]


def compare_all(rank: int, world: int) -> list[dict]:
    return [compare(rank, world, *case) for case in CASES]
