"""The planner with the checkpoint offload to disk (`offload="disk"`).

- On the device "disk" holds what "cpu" holds (the input leaves the device at pack; one is copied back per
  recomputed layer): simulated as "cpu", and not as "none".
- It takes no host memory (`host_bytes` 0) and reports its disk bytes; the step-time model prices the file's read
  in the backward and the synchronous copy to the host in the forward.
- The ladder ends with the offload rungs' disk twins, judged after every other candidate: where the host memory
  caps the "cpu" rungs, `--max` reaches the length the GPU allows, and the launch line names the disk.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_upipe.models.architectures import model_geometry
from hf_upipe.planning.plan_result import disk_bytes, host_bytes
from hf_upipe.planning.planner import Margin, ladder, plan
from hf_upipe.planning.step_time import DISK_BYTES_PER_S, step_time
from hf_upipe.planning.train_step import StepCase, StepSettings, simulate_train_step
from tests.planning.test_planner import _tiny_model

CPU, DISK = StepSettings("fused", 1, offload="cpu"), StepSettings("fused", 1, offload="disk")


def test_step_settings_accept_disk_and_refuse_the_unknown():
    assert DISK.offload == "disk"
    with pytest.raises(ValueError, match="'none', 'cpu' or 'disk'"):
        StepSettings("fused", 1, offload="tape")


def test_disk_holds_on_the_device_what_cpu_holds():
    case = StepCase(_tiny_model(), seq_len=4096, sp_size=2, layers=3)
    disk, cpu = (simulate_train_step(case, s, world_size=2) for s in (DISK, CPU))
    none = simulate_train_step(case, dataclasses.replace(CPU, offload="none"), world_size=2)
    assert disk["by_category"] == cpu["by_category"] and disk["peak"] == cpu["peak"]
    assert (
        none["by_category"]["checkpoints"] > disk["by_category"]["checkpoints"]
    )  # the offload moves the inputs off the device


def test_disk_takes_no_host_memory_and_reports_its_bytes():
    cfg, seq, sp = _tiny_model(), 16384, 2
    g = model_geometry(cfg)
    per_gpu = (g["layers"] - 1) * (seq // sp) * g["hidden"] * 2  # all layers but the last, bf16
    assert host_bytes(cfg, DISK, seq, sp, torch.bfloat16) == 0
    assert disk_bytes(cfg, DISK, seq, sp, torch.bfloat16) == per_gpu
    assert host_bytes(cfg, CPU, seq, sp, torch.bfloat16) == per_gpu
    assert disk_bytes(cfg, CPU, seq, sp, torch.bfloat16) == 0


def test_the_last_rung_offloads_to_disk():
    rungs = ladder(_tiny_model(), 2)
    cpu = [r for r in rungs if r.offload == "cpu"]
    assert rungs[-len(cpu) :] == [dataclasses.replace(r, offload="disk") for r in cpu]
    assert rungs[-1] == dataclasses.replace(cpu[-1], offload="disk")


def test_step_time_prices_the_disk_read():
    cfg = dict(_tiny_model(), num_hidden_layers=32)
    seq, sp = 2**20, 8
    kw = dict(seq_len=seq, sp_size=sp, world=8, gpus_per_node=8)
    cpu, disk = step_time(cfg, CPU, **kw), step_time(cfg, DISK, **kw)
    layer_input = seq // sp * 64 * 2  # [s, hidden] in bf16
    read = 31 * layer_input / DISK_BYTES_PER_S  # every layer but the kept last one, waited for
    assert disk.parts["offload_restore"] == pytest.approx(cpu.parts["offload_restore"] + read)
    assert disk.parts["disk_offload_copy"] == pytest.approx(
        cpu.parts["offload_restore"]
    )  # the synchronous copy to the host: the same bytes over the same link
    assert disk.seconds > cpu.seconds and "disk_offload_copy" not in cpu.parts


@pytest.mark.slow
def test_disk_lengthens_the_fit_where_the_host_memory_binds():
    cfg = _tiny_model()
    kw = dict(
        gpus=2,
        gpu_memory="64MiB",
        max_context=True,
        step=2048,
        margin=Margin(0.0, 0),
        headroom=0,
        max_seq_len=2**16,
        model_offload="none",
    )
    free = plan(cfg, host_memory=None, **kw)  # the GPU binds: the checkpoints offloaded to host
    assert free.settings.offload == "cpu" and free.max_seq_len > 2 * 2048
    host = (
        free.host_bytes_per_gpu * 2 // 2
    )  # half of what the node's checkpoints need at that length
    capped = plan(cfg, host_memory=host, **kw)
    assert capped.max_seq_len == free.max_seq_len and capped.fits
    assert capped.settings == dataclasses.replace(free.settings, offload="disk")
    assert capped.host_bytes_per_gpu == 0 and capped.disk_bytes_per_gpu == free.host_bytes_per_gpu
    launch = capped.launch()
    assert "UPIPE_OFFLOAD=disk UPIPE_OFFLOAD_PATH=/path/to/nvme" in launch
    assert (
        "offload_path='/path/to/nvme'" in launch
        and "disk for offloaded checkpoints" in capped.table()
    )
    assert capped.upipe_config().offload == "disk"
    # without disk the host memory would cap it: the longest "cpu" fit is shorter
    cpu_only = plan(cfg, host_memory=host, settings=free.settings, **kw)
    assert cpu_only.max_seq_len < capped.max_seq_len
