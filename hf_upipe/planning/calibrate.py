"""`hf-upipe calibrate`: measure on this GPU what the caching allocator reserves, and correct the planner with it.

Entry points:
- `add_arguments(parser)`, `run(args) -> int`: the command. It plans the run (`hf_upipe.planning.planner.plan`: the
  settings for `--seq-len` on `--gpus` x `--nodes`), then, in a fresh Python process on one GPU, runs the real step
  of `--layers` decoder layers (4 by default) at the planned shard length as rank 0 of a fake process group of the
  planned world (`measure_train_step`), and reads `torch.cuda.max_memory_reserved()`. The same step is predicted
  (`hf_upipe.planning.reserved.step_reserved` plus the kernel workspaces), and measured / predicted is stored in
  `$HF_UPIPE_CACHE_DIR/calibration.json` under the model, settings, allocator mode and dtype. `hf-upipe plan`
  multiplies its predicted reserve by that factor for the same key and says so.
- `measure_reserved(spec) -> int`: the child's measurement (runs on CUDA only).

Without CUDA the command says so and exits 2. The measurement runs in a fresh process, so nothing allocated before
(and no allocator state) is carried into it; the fake group has no NCCL buffers, so the allowance's NCCL and CUDA
context shares are not part of what is corrected.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys

import torch

__all__ = ["add_arguments", "measure_reserved", "run"]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hf_upipe.planning.plan_command import argument_type
    from hf_upipe.units import parse_size, parse_tokens

    parser.add_argument(
        "--model", required=True, help="a preset, config.json, model folder or Hub id"
    )
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node of the planned run")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument(
        "--seq-len",
        type=argument_type(parse_tokens),
        required=True,
        help="the planned sequence length",
    )
    parser.add_argument("--gpu-memory", default="80GiB", type=argument_type(parse_size))
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the measured step")


def measure_reserved(spec: dict) -> int:
    """max_memory_reserved of one real step on this GPU as rank 0 of a fake `spec["world"]`-rank group."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_upipe.planning.planner import resolve_model
    from hf_upipe.planning.simulate import simulated_world
    from hf_upipe.planning.train_step import StepSettings, measure_train_step

    _, config = resolve_model(spec["model"])
    device = torch.device("cuda", torch.cuda.current_device())

    @contextlib.contextmanager
    def step_start():  # as the replay does: the cache emptied and the peak reset where the step starts
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)

    with simulated_world(spec["world"]), device:
        mesh = init_device_mesh("cuda", (spec["world"],))
        measure_train_step(
            config,
            StepSettings(**spec["settings"]),
            seq_len=spec["seq_len"],
            sp_size=spec["sp_size"],
            layers=spec["layers"],
            mesh=mesh,
            around_step=step_start(),
        )
        return torch.cuda.max_memory_reserved(device)


def _measure_in_fresh_process(spec: dict) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "hf_upipe.planning.calibrate", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{out.stderr[-4000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    if not _cuda_available():
        print(
            "hf-upipe calibrate: no CUDA device on this machine: calibration measures the allocator on a GPU. "
            "`hf-upipe plan` works without it (uncalibrated prediction).",
            file=sys.stderr,
        )
        return 2
    from hf_upipe.planning.planner import plan, resolve_model
    from hf_upipe.planning.reserved import (
        Allowance,
        allocator_mode,
        correction_key,
        save_correction,
        step_reserved,
    )

    name, config = resolve_model(args.model)
    p = plan(
        args.model,
        gpus=args.gpus,
        nodes=args.nodes,
        seq_len=args.seq_len,
        gpu_memory=args.gpu_memory,
    )
    world, mode = args.gpus * args.nodes, allocator_mode()
    spec = dict(
        model=args.model,
        world=world,
        sp_size=p.sp_size,
        seq_len=args.seq_len,
        layers=args.layers,
        settings=dataclasses.asdict(p.settings),
    )
    predicted = step_reserved(
        config,
        p.settings,
        seq_len=args.seq_len,
        world_size=world,
        sp_size=p.sp_size,
        layers=args.layers,
    )["reserved"][mode] + Allowance().bytes(
        config, p.settings, args.seq_len, p.sp_size, device_only=True
    )
    measured = _measure_in_fresh_process(spec)
    key = correction_key(name, p.settings, mode, p.dtype)
    fix = save_correction(key, measured, predicted, seq_len=args.seq_len, layers=args.layers)
    gib = 2**30
    print(f"measured reserve  {measured / gib:9.2f} GiB  ({args.layers} layers, {mode} segments)")
    print(f"predicted reserve {predicted / gib:9.2f} GiB")
    print(
        f"correction        x{fix['factor']:.3f}, stored for `hf-upipe plan` (same model and settings)"
    )
    return 0


if __name__ == "__main__":  # the fresh measuring process
    print(measure_reserved(json.loads(sys.argv[1])))
