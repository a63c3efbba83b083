"""What `UPipeTrainer` adds to its training log lines.

Entry points:
- `with_throughput(logs, stats, device)`: a training log line with `tokens_per_second` (real tokens of all ranks
  since the last log) and `peak_memory_gib` (the largest per-rank peak) added, and the counters restarted.
- `peak_memory_bytes(device)`: this process's peak: device allocations on CUDA, process peak RSS on CPU.
"""

from __future__ import annotations

import resource
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["peak_memory_bytes", "with_throughput"]


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: device allocations (reset after reading) on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def with_throughput(logs: dict[str, float], stats: dict, device) -> tuple[dict[str, float], dict]:
    """(`logs` with `tokens_per_second` and `peak_memory_gib`, new counters) for a training log line (one
    all_reduce); (`logs`, `stats`) unchanged for other lines or before the first step.

    `stats`: {"tokens": real tokens of all ranks since `since`, "since": `time.perf_counter()` of the clock's
    start, or None}."""
    if "loss" not in logs or any(k.startswith("eval_") for k in logs) or stats["since"] is None:
        return logs, stats
    peak = torch.tensor([float(peak_memory_bytes(device))], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    now = time.perf_counter()
    rate = stats["tokens"] / max(now - stats["since"], 1e-9)
    logs = {
        **logs,
        "tokens_per_second": round(rate, 1),
        "peak_memory_gib": round(peak.item() / 2**30, 3),
    }
    return logs, {"tokens": 0, "since": now}
