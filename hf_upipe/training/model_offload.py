"""Model-state offload (`UPipeConfig.model_offload='cpu'`): FSDP2's host offload of parameters, gradients and the
optimizer step.

Entry points:
- `offload_policy()`: FSDP2's `CPUOffloadPolicy`, pinned only where CUDA is available (pinning needs CUDA).
- `fsdp_kwargs(config)`: the keyword arguments `fully_shard` takes for the setting (`{"offload_policy": ...}` for
  'cpu', `{}` for 'none'): for scripts that call `fully_shard` themselves.
- `check_model_offload(config, *, fsdp_version, deepspeed)`: a ValueError, raised the same on every rank before any
  collective, where the setting cannot apply: no FSDP (DDP, one process), DeepSpeed, FSDP1.
- `check_cpu_collectives(config)`: a ValueError where model_offload='cpu' meets a process group with no CPU backend
  (NCCL alone): the gradient shards then live on the host, and collectives over them (gradient clipping's norm)
  need one, as accelerate sets up (`cuda:nccl,cpu:gloo`) when its FSDP config offloads parameters.
- `apply_model_offload(fsdp_plugin, config)`: sets accelerate's FSDP2 plugin (`accelerator.state.fsdp_plugin`) to
  the policy before `accelerator.prepare` shards the model; `UPipePlugin.prepare` and `UPipeTrainer` call it.
- `trainer_fsdp_version(args)`: the FSDP version a `TrainingArguments` asks for (None: no FSDP).

What FSDP2 then does (torch's `fully_shard(offload_policy=CPUOffloadPolicy())`): each rank's fp32 parameter shards
live in host memory; before a layer's all-gather its shard is copied to the GPU; its reduced gradient shard is
copied back to host memory; the optimizer, built over the sharded parameters, steps on the CPU, with its states
there. The arithmetic is the same as without offload (the same fp32 values, reductions and update), so the result
is identical (`tests/training/test_model_offload.py`).
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_model_offload",
    "check_cpu_collectives",
    "check_model_offload",
    "fsdp_kwargs",
    "offload_policy",
    "trainer_fsdp_version",
]


def offload_policy():
    """`CPUOffloadPolicy(pin_memory=torch.cuda.is_available())`: pinned host memory needs CUDA."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def fsdp_kwargs(config) -> dict:
    """`fully_shard`'s keyword arguments for `config.model_offload`: the offload policy for 'cpu', none for 'none'."""
    return {"offload_policy": offload_policy()} if config.model_offload == "cpu" else {}


def check_model_offload(config, *, fsdp_version: int | None, deepspeed: bool) -> None:
    """Refuse model_offload='cpu' where FSDP2 does not shard the model (same error on every rank: the launch's
    settings are the same everywhere)."""
    if config.model_offload != "cpu":
        return
    if deepspeed:
        where = "DeepSpeed runs the model (use its own offload_param / offload_optimizer in the DeepSpeed config)"
    elif fsdp_version is None:
        where = "the model is not sharded by FSDP (DDP or one process)"
    elif fsdp_version != 2:
        where = f"the FSDP config asks for FSDP version {fsdp_version}"
    else:
        return
    raise ValueError(
        f"{config.describe('model_offload')} moves FSDP2's parameter, gradient and optimizer shards to host memory, "
        f"but {where}. Use an FSDP2 accelerate config (fsdp_version: 2, e.g. "
        "accelerate_configs/fsdp2_1node_8gpu.yaml; Trainer: fsdp='full_shard' with fsdp_config={'version': 2}), "
        f"or {config.spell('model_offload', 'none')}."
    )


def _has_cpu_backend() -> bool:
    """Whether the default process group can run collectives on CPU tensors (gloo, or `cuda:nccl,cpu:gloo`)."""
    import torch.distributed as dist

    try:
        dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    return True


def check_cpu_collectives(config) -> None:
    """Refuse model_offload='cpu' under a process group without a CPU backend (the same on every rank)."""
    import torch.distributed as dist

    if config.model_offload != "cpu" or not dist.is_initialized() or _has_cpu_backend():
        return
    raise ValueError(
        f"{config.describe('model_offload')} keeps the gradient shards in host memory, and collectives over them "
        f"(gradient clipping's norm) need a CPU backend, but the process group ({dist.get_backend()}) has none. "
        "Set fsdp_offload_params: true in the accelerate FSDP config (or FSDP_OFFLOAD_PARAMS=true before the "
        "Accelerator is created): accelerate then initialises cuda:nccl,cpu:gloo; or call "
        "torch.distributed.init_process_group('cuda:nccl,cpu:gloo') yourself first."
    )


def apply_model_offload(fsdp_plugin, config) -> None:
    """Set accelerate's FSDP2 plugin to host-offload the model (`offload_policy()`) when model_offload='cpu';
    model_offload='none' leaves the plugin's own setting (`fsdp_offload_params`) as it is."""
    if config.model_offload == "cpu" and fsdp_plugin is not None:
        fsdp_plugin.cpu_offload = offload_policy()


def trainer_fsdp_version(args) -> int | None:
    """The FSDP version `TrainingArguments` asks for (`fsdp` options with `fsdp_config['version']`, default 2),
    or None when it asks for no FSDP."""
    if args is None or not getattr(args, "fsdp", None):
        return None
    return int((getattr(args, "fsdp_config", None) or {}).get("version", 2))
