"""Shared helpers of the GPU benchmarks (`benchmarks/gpu/kernel_parity.py`, `memory.py`, `speed.py`).

Entry points:
- `parser(description)` / `parse(ap)`: argparse with `--out`, `--cpu-dry-run` and `--quick`; `parse` exits with a
  clear message (status 2) on a machine without CUDA unless `--cpu-dry-run` is given (which runs the same code on
  CPU at toy sizes, to check the script, and writes under <out>/cpu-dry-run).
- `environment(device)`: device name, capability, memory, versions, date: stamped on every JSON.
- `cuda_times(fn, *, warmup, reps)`: per-run times in seconds, timed with CUDA events (wall clock on CPU).
- `PeakMemory(device)`: a context that records the allocator's peaks relative to what was allocated on entry.
- `fake_rank(world_size, device)`: rank 0 of a fake `world_size`-rank process group with real tensors created on
  `device` by default (nothing is communicated: an all-to-all leaves a copy of its input, `loopback_all_to_all`).
- `Results`: the JSON document of one script, written after every section (a crash keeps what was measured).
- `rel_error(x, ref)`: ||x - ref|| / ||ref|| in float64 on the CPU.
- `parse_len("512K")` (K = 1024), `llama3_8b(dry)` (the geometry, or a toy one of the same heads for a dry run),
  `deepspeed_importable()`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # run from a checkout

GiB = 2**30


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"))
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the script's code on CPU at toy sizes (checks the script; no numbers to report)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, torch.device]:
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        return args, torch.device("cuda")
    if not args.cpu_dry_run:
        print(
            f"{os.path.basename(sys.argv[0])}: no CUDA device here (torch {torch.__version__}, "
            f"cuda available: False). These benchmarks measure a GPU; run them on a CUDA machine, or pass "
            "--cpu-dry-run to check the script on CPU at toy sizes.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    args.out = os.path.join(args.out, "cpu-dry-run")
    return args, torch.device("cpu")


def environment(device: torch.device) -> dict:
    import transformers

    import hf_upipe

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "hf_upipe": hf_upipe.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    for name in ("peft", "accelerate", "deepspeed", "flash_attn"):
        try:
            env[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001  (absent, or failing to import: say which)
            env[name] = f"unavailable ({type(err).__name__})"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            gpu_memory_bytes=p.total_memory,
            multiprocessors=p.multi_processor_count,
        )
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_times(fn, device: torch.device, *, warmup: int = 1, reps: int = 3) -> list[float]:
    """Seconds of each of `reps` calls of fn() after `warmup` untimed ones (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class PeakMemory:
    """The allocator's peaks inside the block, relative to what was allocated on entry (CUDA; zeros on CPU).

    After exit: `allocated` (max_memory_allocated - allocated on entry), `reserved` (max_memory_reserved - reserved
    on entry), `reserved_total` (max_memory_reserved), `device_used` (device memory in use at exit per
    cudaMemGetInfo: the CUDA context, the allocator's reserve and anything else on the device).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.allocated = self.reserved = self.reserved_total = self.device_used = (
            self.base_allocated
        ) = 0

    def __enter__(self):
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_allocated = torch.cuda.memory_allocated(self.device)
            self.base_reserved = torch.cuda.memory_reserved(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            sync(self.device)
            self.allocated = torch.cuda.max_memory_allocated(self.device) - self.base_allocated
            self.reserved_total = torch.cuda.max_memory_reserved(self.device)
            self.reserved = self.reserved_total - self.base_reserved
            free, total = torch.cuda.mem_get_info(self.device)
            self.device_used = total - free
        return False

    def to_dict(self) -> dict:
        return {
            "max_allocated_bytes": self.allocated,
            "max_reserved_bytes": self.reserved,
            "max_reserved_total_bytes": self.reserved_total,
            "device_used_bytes": self.device_used,
            "allocated_on_entry_bytes": self.base_allocated,
        }


@contextlib.contextmanager
def loopback_all_to_all():
    """`all_to_all_single` on a fake group leaves a copy of the input in the output, as torch 2.13's fake group does.

    Older fake groups (torch 2.11, seen on the H100) leave the output as allocated: uninitialised memory, so the
    numbers that follow are garbage and value checks fail. With the copy, every rank holds the same data: a valid
    function of the inputs, the same on CPU and GPU, so the two can be compared.
    """
    import torch.distributed as dist

    original = dist.all_to_all_single

    def all_to_all_single(
        output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
    ):
        work = original(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )
        if "fake" in str(dist.get_backend(group)) and output.shape == input.shape:
            if work is not None:
                work.wait()
            output.copy_(input)
        return work

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = original


@contextlib.contextmanager
def fake_rank(world_size: int, device: torch.device):
    """Rank 0 of a fake `world_size`-rank world; new tensors on `device` (see the module docstring)."""
    from hf_upipe.planning.simulate import simulated_world

    with simulated_world(world_size) as world, loopback_all_to_all(), device:
        yield world


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


class Results:
    """One script's JSON: {"environment", "sections": {name: ...}, "errors": [...]}, rewritten after each section."""

    def __init__(self, path: str, device: torch.device):
        self.path = path
        self.doc = {"environment": environment(device), "sections": {}, "errors": []}
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def put(self, section: str, value) -> None:
        self.doc["sections"][section] = value
        self.write()

    def error(self, where: str, err: BaseException) -> dict:
        entry = {
            "where": where,
            "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
        self.doc["errors"].append(entry)
        print(f"ERROR in {where}: {entry['error'][:500]}", flush=True)
        self.write()
        return {"error": entry["error"]}

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def llama3_8b(dry: bool) -> dict:
    """Llama3-8B's geometry (`hf_upipe.models.presets.PRESETS`), or for a dry run its head geometry at a small
    width (with HF_UPIPE_GPU_DRY=tiny, as `verify.py --cpu-dry-run` sets it: 8 heads at width 128, vocab 512)."""
    from hf_upipe.models.presets import PRESETS

    if (
        dry and os.environ.get("HF_UPIPE_GPU_DRY") == "tiny"
    ):  # verify.py --cpu-dry-run: the smallest that runs
        return dict(
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=16,
            num_hidden_layers=32,
            vocab_size=512,
        )
    if dry:
        return dict(
            hidden_size=512,
            intermediate_size=1792,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=16,
            num_hidden_layers=32,
            vocab_size=4096,
        )
    return dict(PRESETS["llama3-8b"])


def deepspeed_importable() -> bool:
    try:
        from hf_upipe.planning.attention_block import require_deepspeed

        require_deepspeed()
        return True
    except Exception:  # noqa: BLE001  (absent, or failing to import on this machine)
        return False
