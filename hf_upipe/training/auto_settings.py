"""`UPipeConfig(auto=True)`: the planner chooses the memory settings of a launch, before it starts.

Entry point:
- `apply_auto_settings(config, model, *, world_size, local_world_size=None)`: with `config.auto`, plans the
  model for `config.plan_seq_len` tokens on this launch's GPUs (`hf_upipe.planning.planner.plan` with no settings
  given: the candidate with the shortest predicted step that fits) and returns (a copy of `config` with the choice:
  heads_per_chunk, fused_attention, fused_backward, overlap_comm, tiled_mlp, mlp_chunk_tokens, tiled_loss,
  loss_chunk_tokens, offload; the planner's answer).
  Without `auto` it returns (config, None). The given config is never changed.

The runtime never imports the planner: the simulation needs a process without a process group, and a launched job
has one, so rank 0 runs the planner in a child process (`python -m hf_upipe.cli plan ... --json`) and broadcasts
the result; every rank applies the same settings, or raises the same error (the plan does not fit: the message has
the planner's table), before any other collective. A PEFT LoRA model is planned as LoRA (its rank and target
modules: frozen base in the compute dtype, fp32 adapters, AdamW on them); any other model as a full fine-tune.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from hf_upipe.allocator import conf_mode
from hf_upipe.models.peft import base_model

logger = logging.getLogger(__name__)

__all__ = ["apply_auto_settings", "planner_model_args"]


def _model_config(model):
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(
            f"auto settings need a transformers model with a .config; got {type(model).__name__}"
        )
    return config


def _lora_of(model):
    """(rank, target module names) of a PEFT LoRA model's active adapter, or None (a full fine-tune)."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    active = getattr(model, "active_adapter", None)
    adapter = peft_config.get(active if isinstance(active, str) else next(iter(peft_config)))
    targets = getattr(adapter, "target_modules", None)
    if getattr(adapter, "r", None) is None or not targets or isinstance(targets, str):
        raise ValueError(
            f"auto settings plan LoRA adapters with explicit target_modules; got {adapter!r}: pass "
            "target_modules as a list, or plan by hand with `hf-upipe plan`"
        )
    return int(adapter.r), sorted(targets)


def _gpu_memory(config) -> str:
    if config.gpu_memory:
        return config.gpu_memory
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory}B"
    raise ValueError(
        "auto settings need the memory of one GPU and none is visible: set gpu_memory (e.g. '80GiB', "
        "UPIPE_GPU_MEMORY) to plan for the GPUs you will train on."
    )


def planner_model_args(model, config, folder: str) -> list[str]:
    """The `hf-upipe plan` flags that describe `model` (its config, written into `folder`), the GPU memory of
    `config` and, for a PEFT LoRA model, its adapters: what `hf_upipe.training.oom` plans with."""
    _model_config(model).to_json_file(os.path.join(folder, "config.json"))
    flags = ["--model", folder, "--gpu-memory", _gpu_memory(config)]
    lora = _lora_of(model)
    if lora is not None:
        flags += ["--lora-rank", str(lora[0]), "--lora-targets", ",".join(lora[1])]
    return flags


def _run_planner(model, config, world_size: int, local_world_size: int) -> dict:
    """The planner's JSON (or {"error": message}), from a child process."""
    nodes = world_size // local_world_size
    with tempfile.TemporaryDirectory(prefix="upipe-plan-") as folder:
        _model_config(model).to_json_file(os.path.join(folder, "config.json"))
        command = [
            sys.executable,
            "-m",
            "hf_upipe.cli",
            "plan",
            "--model",
            folder,
            "--gpus",
            str(local_world_size),
            "--nodes",
            str(nodes),
            "--gpu-memory",
            _gpu_memory(config),
            "--seq-len",
            str(config.plan_seq_len),
            "--json",
            # the user's model offload, not the planner's choice: auto does not switch FSDP2's policy
            "--model-offload",
            config.model_offload,
            "--allocator",  # the mode in force (hf_upipe.allocator.arrange_allocator has run)
            conf_mode(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
        ]
        if config.sp_size:
            command += ["--sp-size", str(config.sp_size)]
        lora = _lora_of(model)
        if lora is not None:
            command += ["--lora-rank", str(lora[0]), "--lora-targets", ",".join(lora[1])]
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "UPIPE_AUTO": "0"}
        )
    if done.returncode in (0, 1) and done.stdout.strip().startswith("{"):
        return json.loads(done.stdout)
    return {"error": (done.stdout + done.stderr).strip()[-2000:] or f"exit {done.returncode}"}


def apply_auto_settings(config, model, *, world_size: int, local_world_size: int | None = None):
    """See the module docstring. Raises ValueError (on every rank) when nothing fits or planning failed."""
    if not config.auto:
        return config, None
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % local_world_size:
        local_world_size = world_size
    distributed = dist.is_available() and dist.is_initialized() and world_size > 1
    result = None
    if not distributed or dist.get_rank() == 0:
        try:
            result = _run_planner(model, config, world_size, local_world_size)
        except ValueError as err:
            result = {"error": str(err)}
    if distributed:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if "error" in result:
        raise ValueError(f"auto settings: the planner failed: {result['error']}")
    if not result["fits"]:
        gib = 2**30
        raise ValueError(
            f"auto settings: {config.plan_seq_len} tokens do not fit on {world_size} GPU(s) of "
            f"{result['gpu_memory'] / gib:.1f} GiB even with the most memory-saving settings (needs "
            f"{result['required'] / gib:.1f} GiB per GPU). Shorten plan_seq_len, add GPUs, or run "
            "`hf-upipe plan ... --max` to see the longest that fits."
        )
    s = result["settings"]
    config = config.with_auto(
        heads_per_chunk="all" if s["heads_per_chunk"] is None else s["heads_per_chunk"],
        fused_attention=s["impl"] == "fused",
        tiled_mlp=s["tiled_mlp"],
        mlp_chunk_tokens=s["mlp_chunk_tokens"],
        tiled_loss=s["tiled_loss"],
        loss_chunk_tokens=s["loss_chunk_tokens"],
        offload=s["offload"],
        fused_backward=s["fused_backward"],
        overlap_comm=s["overlap"],
    )
    logger.info(
        "hf_upipe auto settings for %d tokens: heads_per_chunk=%s, tiled_mlp=%s, offload=%s, "
        "fused_backward=%s, overlap_comm=%s (planned peak %.1f GiB of %.1f GiB per GPU)",
        config.plan_seq_len,
        config.heads_per_chunk,
        config.tiled_mlp,
        config.offload,
        config.fused_backward,
        config.overlap_comm,
        result["required"] / 2**30,
        result["gpu_memory"] / 2**30,
    )
    return config, result
