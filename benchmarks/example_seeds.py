"""The main example over seeds and process counts: does every run learn retrieval across the shards?

    python benchmarks/example_seeds.py [--seeds 0 1 2 3 4] [--processes 1 2]

Runs the README's main command (`examples/finetune_long_context.py`, defaults) for every seed with 1 process and with
2 (`accelerate launch`, SP 2), and writes benchmarks/results/example_seeds.json and a markdown table: the mean loss
of the first and last 10 steps, the held-out passkey accuracy (first answer of each row: read from the first rank's
shard; every answer), the wall time, and for each seed the first step at which the 1- and 2-process losses differ by
more than 1e-4 relative (they compute the same mean in a different order, so rounding makes them drift apart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "finetune_long_context.py")
CONFIG = os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml")


def run(seed: int, processes: int, folder: str) -> dict:
    log = os.path.join(folder, f"seed{seed}_p{processes}.json")
    flags = [
        "--seed",
        str(seed),
        "--output-dir",
        os.path.join(folder, f"out{seed}_{processes}"),
        "--log-json",
        log,
    ]
    if processes == 1:
        cmd = [sys.executable, EXAMPLE, *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            CONFIG,
            "--num_processes",
            str(processes),
            "--main_process_port",
            "0",
            EXAMPLE,
            *flags,
        ]
    started = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed}, {processes} process(es) failed:\n{done.stderr[-3000:]}")
    with open(log) as f:
        out = json.load(f)
    losses = [out["losses"][k] for k in sorted(out["losses"], key=int)]
    return {
        "seed": seed,
        "processes": processes,
        "seconds": round(time.perf_counter() - started, 1),
        "first10": sum(losses[:10]) / 10,
        "last10": sum(losses[-10:]) / 10,
        "losses": losses,
        "first_answer": out["accuracy"]["first_answer"],
        "all_answers": out["accuracy"]["all_answers"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="upipe-seeds-") as folder:
        runs = [run(seed, p, folder) for seed in args.seeds for p in args.processes]
    rows = [
        "| seed | processes | loss, first 10 steps | loss, last 10 steps | first answer | all answers | "
        "1 and 2 processes agree (1e-4) for the first N steps | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        others = [o for o in runs if o["seed"] == r["seed"] and o["processes"] != r["processes"]]
        agree = ""
        if others:
            a, b = r["losses"], others[0]["losses"]
            differ = [i for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 1e-4 * abs(y)]
            agree = str(differ[0]) if differ else f"all {len(a)}"
            r["agree_until_step"] = agree
        rows.append(
            f"| {r['seed']} | {r['processes']} | {r['first10']:.3f} | {r['last10']:.3f} | "
            f"{r['first_answer']:.0%} | {r['all_answers']:.0%} | {agree} | {r['seconds']:.0f} |"
        )
    table = "\n".join(rows)
    print(table)
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}"
    result = {
        "runs": runs,
        "machine": machine,
        "wall_s": round(time.perf_counter() - started, 1),
        "table": table,
    }
    path = os.path.join(ROOT, "benchmarks", "results", "example_seeds.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}; {result['wall_s']:.0f} s in all on {machine}")
    return 0 if all(r["first_answer"] >= 0.9 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
