"""The measuring process of `benchmarks/gpu/max_context.py`: one warm-up step and one measured step, fresh.

    python benchmarks/gpu/max_context_step.py '<spec as JSON>'   (prints the row as JSON on its last line)

Entry points: `child(spec) -> dict` (the measured step's max_allocated, max_reserved, CUDA context, tracked tensor
peak, wall times; `{"oom": true}` when the GPU runs out), `SharedHostPool` (the offload's host buffers for a
measurement), `model_config(dry, layers)`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fake_rank, llama3_8b, sync  # noqa: E402

P = 8


def model_config(dry: bool, layers: int) -> dict:
    """Llama3-8B's geometry (or the dry run's toy one) with `layers` decoder layers."""
    cfg = llama3_8b(dry)
    cfg["num_hidden_layers"] = layers
    return cfg


def _step(spec: dict, cfg: dict, settings, kernel: str, seq_len: int, device, around=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from hf_upipe.planning.train_step import StepCase, measure_train_step

    mesh = init_device_mesh(device.type, (P,))
    t0 = time.perf_counter()
    case = StepCase(cfg, seq_len, P, spec["layers"], kernel=kernel)
    result = measure_train_step(case, settings, mesh=mesh, around_step=around)
    sync(device)
    return dict(tracked_peak=result["peak"], wall_s=round(time.perf_counter() - t0, 2))


class SharedHostPool:
    """`hf_upipe.training.offload.HOST_POOL` for a measurement: one pinned host buffer per (shape, dtype), handed to
    every offloaded tensor of that shape. The device side of the offload is unchanged (every copy out, every copy
    back into a new device tensor, on the same streams); the host holds one layer input instead of all of them,
    whose values are overwritten (garbage: the measured step's numbers are meaningless anyway)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def take(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._buffers:
            pin = torch.cuda.is_available()
            self._buffers[key] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
        return self._buffers[key]

    def give(self, buf: torch.Tensor) -> None:
        pass


@contextlib.contextmanager
def _step_start(device):
    """Where the measured step starts: the cache emptied and the peaks reset (what was allocated stays)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield


def child(spec: dict) -> dict:
    """One warm-up step and one measured step in this (fresh) process; the measured step's memory."""
    from hf_upipe.ops.kernels_hollow import hollow_attention
    from hf_upipe.planning.hollow_step import hollow_twin
    from hf_upipe.planning.train_step import StepSettings
    from hf_upipe.training import offload

    device = torch.device("cpu" if spec["dry"] else "cuda")
    if spec["host_offload"] == "shared":
        offload.HOST_POOL = SharedHostPool()
    cfg, settings = model_config(spec["dry"], spec["layers"]), StepSettings(**spec["settings"])
    kernel = hollow_twin("auto", device, torch.bfloat16) if spec["hollow"] else "auto"
    torch_sdpa = (
        settings.impl == "deepspeed"
    )  # DeepSpeed's attention is torch's SDPA (hf_upipe.planning.hollow_step)
    row = dict(
        kernel=("hollow torch SDPA" if spec["hollow"] else "torch SDPA") if torch_sdpa else kernel
    )
    scope = hollow_attention() if spec["hollow"] else contextlib.nullcontext()
    try:
        with fake_rank(P, device), scope:
            warm = _step(spec, cfg, settings, kernel, spec["warmup_len"], device)
            gc.collect()
            measured = _step(
                spec, cfg, settings, kernel, spec["seq_len"], device, _step_start(device)
            )
    except torch.OutOfMemoryError as err:
        return dict(row, oom=True, oom_message=str(err)[:300])
    row.update(warmup_wall_s=warm["wall_s"], step_wall_s=measured["wall_s"])
    row["tracked_peak"] = measured["tracked_peak"]
    if device.type == "cuda":
        row["max_allocated"] = torch.cuda.max_memory_allocated(device)
        row["max_reserved"] = torch.cuda.max_memory_reserved(device)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        row["context"] = total - free - torch.cuda.memory_reserved(device)
        row["gpu_total"] = total
    else:  # dry run: no allocator; the tracked tensor peak stands in for both
        row.update(max_allocated=row["tracked_peak"], max_reserved=row["tracked_peak"], context=0)
    return row


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
