"""model_offload='cpu' (FSDP2's host offload of parameters, gradients and the optimizer step).

- Exact: 2 AdamW steps of a tiny Llama under FSDP2 (`fully_shard` with `fsdp_kwargs(config)`, what accelerate's
  FSDP2 plugin gets from `apply_model_offload` on GPUs) at SP 2 and SP 2 x DP 2 (parameters sharded over all 4
  ranks), full fine-tune and LoRA, fp32 on gloo: the same losses and final weights with and without the offload,
  and the offload policy really in force (every FSDP parameter offloaded to the host, its gradient there).
- Refused where it cannot apply, with the fix: no FSDP (the plugin under a CPU/DDP accelerator, the Trainer without
  `fsdp`), DeepSpeed, FSDP1; `apply_model_offload` sets accelerate's FSDP2 plugin.
"""

from __future__ import annotations

import pytest
import torch

from hf_upipe import UPipeConfig
from hf_upipe.training.model_offload import (
    _has_cpu_backend,
    apply_model_offload,
    check_cpu_collectives,
    check_model_offload,
    fsdp_kwargs,
    trainer_fsdp_version,
)
from tests._dist import run_distributed


def _policy_in_force(model) -> list[bool]:
    """For every FSDP2 parameter group of `model`: its policy is a CPUOffloadPolicy and each parameter offloads."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    seen = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            seen.append(
                isinstance(group.offload_policy, CPUOffloadPolicy)
                and all(p.offload_to_cpu for p in group.fsdp_params)
            )
    return seen


def _steps(model, cfg, state, world: int) -> list[float]:
    """2 AdamW steps of the token-weighted SP loss on the same global batches of 4 rows; the global losses."""
    from hf_upipe import shard_batch
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.training._plugin_runs import _batches

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    rows, losses = 4 // state.dp_size, []
    for full in _batches(2, 4):
        mine = {k: v[state.dp_rank * rows : (state.dp_rank + 1) * rows] for k, v in full.items()}
        shard = shard_batch(mine, state.sp_rank, state.sp_size)
        loss = upipe.loss(model, shard, upipe.count([shard]))
        loss.backward()
        if cfg.model_offload == "cpu":  # the reduced gradient shards are where the policy puts them
            assert all(
                p.grad.to_local().device.type == "cpu"
                for p in model.parameters()
                if p.grad is not None
            )
        opt.step()
        opt.zero_grad()
        total = torch.tensor(loss.item() / world)
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    return losses


def offload_run(rank: int, world: int, lora: bool, model_offload: str) -> dict:
    """One FSDP2 run with SP 2 and `model_offload`: losses, final full weights, the policy of each group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_upipe import init_sequence_parallel, prepare_model
    from tests.training._runs import _model

    model = _model(lora, seed=11)
    cfg = UPipeConfig(sp_size=2, loss_chunk_tokens=7, model_offload=model_offload)
    state = init_sequence_parallel(2)
    prepare_model(model, cfg)
    assert _has_cpu_backend()  # gloo reduces CPU tensors: accepted
    check_cpu_collectives(cfg)
    mesh = init_device_mesh("cpu", (world,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs(cfg))
    fully_shard(model, mesh=mesh, **fsdp_kwargs(cfg))
    losses = _steps(model, cfg, state, world)
    weights = {n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "policy": _policy_in_force(model)}


def _all(rank: int, world: int) -> dict:
    return {
        (lora, mo): offload_run(rank, world, lora, mo)
        for lora in (False, True)
        for mo in ("none", "cpu")
    }


@pytest.fixture(scope="module")
def offload_runs():
    return {world: run_distributed(_all, world, timeout=300) for world in (2, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_model_offload_is_exact_and_in_force(offload_runs, lora):
    for world, ranks in offload_runs.items():
        for rank, out in enumerate(ranks):
            plain, off = out[(lora, "none")], out[(lora, "cpu")]
            assert off["policy"] and all(off["policy"]), (world, rank, off["policy"])
            assert not any(plain["policy"]), (world, rank)
            assert off["losses"] == plain["losses"], (world, rank, off["losses"], plain["losses"])
            assert plain["losses"][0] != plain["losses"][-1]  # the steps did train
            assert off["weights"].keys() == plain["weights"].keys()
            for name, w in plain["weights"].items():
                assert off["weights"][name] == w, (world, rank, name)


def test_fsdp_kwargs_and_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy

    (policy,) = fsdp_kwargs(UPipeConfig(model_offload="cpu")).values()
    assert isinstance(policy, CPUOffloadPolicy)
    assert policy.pin_memory == torch.cuda.is_available()  # pinning needs CUDA
    assert fsdp_kwargs(UPipeConfig()) == {}
    with pytest.raises(ValueError, match="model_offload='gpu'.*'none'.*'cpu'"):
        UPipeConfig(model_offload="gpu")


def test_model_offload_from_env(monkeypatch):
    monkeypatch.setenv("UPIPE_MODEL_OFFLOAD", "CPU")
    cfg = UPipeConfig()
    assert cfg.model_offload == "cpu"
    with pytest.raises(
        ValueError, match="UPIPE_MODEL_OFFLOAD=CPU.*the model is not sharded by FSDP"
    ):
        check_model_offload(cfg, fsdp_version=None, deepspeed=False)


@pytest.mark.parametrize(
    ("fsdp_version", "deepspeed", "where"),
    [
        (None, False, "not sharded by FSDP"),
        (None, True, "DeepSpeed runs"),
        (1, False, "FSDP version 1"),
    ],
)
def test_refused_where_it_cannot_apply(fsdp_version, deepspeed, where):
    cfg = UPipeConfig(model_offload="cpu")
    with pytest.raises(ValueError, match=where) as err:
        check_model_offload(cfg, fsdp_version=fsdp_version, deepspeed=deepspeed)
    assert "fsdp_version: 2" in str(err.value) and "model_offload='none'" in str(err.value)
    check_model_offload(cfg, fsdp_version=2, deepspeed=False)  # FSDP2: fine
    check_model_offload(UPipeConfig(), fsdp_version=None, deepspeed=True)  # 'none' is never refused


def test_plugin_refuses_without_fsdp_and_sets_fsdp2_plugin():
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from hf_upipe import UPipePlugin
    from tests.training._runs import _model

    with pytest.raises(
        ValueError, match="UPipePlugin\\(model_offload='cpu'\\).*not sharded by FSDP"
    ):
        UPipePlugin(model_offload="cpu").prepare(Accelerator(cpu=True), _model(False, 1))
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2)
    assert not isinstance(fsdp.cpu_offload, CPUOffloadPolicy)
    apply_model_offload(fsdp, UPipeConfig())  # 'none': accelerate's own setting stays
    assert not isinstance(fsdp.cpu_offload, CPUOffloadPolicy)
    apply_model_offload(fsdp, UPipeConfig(model_offload="cpu"))
    assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy)


def test_trainer_refuses_without_fsdp(tmp_path):
    from transformers import TrainingArguments

    from hf_upipe import UPipeTrainer
    from tests.training._runs import _model

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(
        ValueError, match="UPipeConfig\\(model_offload='cpu'\\).*not sharded by FSDP"
    ):
        UPipeTrainer(
            model=_model(False, 1), args=args, upipe_config=UPipeConfig(model_offload="cpu")
        )


def test_refused_without_a_cpu_backend(monkeypatch):
    """An NCCL-only process group (stood in for here: a CPU machine has no NCCL) cannot reduce the host-resident
    gradient shards (gradient clipping's norm): refused with the fix."""
    import torch.distributed as dist

    import hf_upipe.training.model_offload as model_offload

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(model_offload, "_has_cpu_backend", lambda: False)
    with pytest.raises(
        ValueError, match="process group \\(nccl\\) has none.*fsdp_offload_params: true"
    ):
        check_cpu_collectives(UPipeConfig(model_offload="cpu"))
    check_cpu_collectives(UPipeConfig())  # 'none': nothing on the host


def test_trainer_fsdp_version():
    from types import SimpleNamespace

    assert trainer_fsdp_version(SimpleNamespace(fsdp=[], fsdp_config={})) is None
    assert trainer_fsdp_version(SimpleNamespace(fsdp=["full_shard"], fsdp_config={})) == 2
    assert (
        trainer_fsdp_version(SimpleNamespace(fsdp=["full_shard"], fsdp_config={"version": 1})) == 1
    )
