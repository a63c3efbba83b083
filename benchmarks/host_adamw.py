"""torch's CPU AdamW, nanoseconds per parameter on one core: the measurement behind the step-time model's
`hf_upipe.planning.step_time.HOST_ADAMW_SECONDS_PER_PARAM` (model_offload='cpu', docs/model-offload.md).

    python benchmarks/host_adamw.py [--params 16777216] [--threads 1] [--repeats 5]

Prints the best of `--repeats` steps of fp32 AdamW (foreach and per-tensor) over `--params` parameters in 16
tensors, each with its gradient, after one step that creates the states.
"""

from __future__ import annotations

import argparse
import time

import torch


def ns_per_param(params: int, foreach: bool, repeats: int) -> float:
    """The best step time of AdamW over `params` fp32 parameters, in ns per parameter."""
    tensors = [torch.randn(params // 16, requires_grad=True) for _ in range(16)]
    for t in tensors:
        t.grad = torch.randn_like(t)
    optimizer = torch.optim.AdamW(tensors, lr=1e-3, foreach=foreach)
    optimizer.step()  # creates m and v
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best / params * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=2**24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for foreach in (True, False):
        rate = ns_per_param(args.params, foreach, args.repeats)
        print(f"AdamW foreach={foreach}, {args.threads} thread(s): {rate:.2f} ns per parameter")


if __name__ == "__main__":
    main()
