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

With `--hollow-attention` the measured step runs the hollow twin of the planned attention kernel
(`hf_upipe.ops.kernels_hollow`: the kernel's outputs allocated, its arithmetic skipped), so a step at a long shard
length takes seconds instead of hours; everything else in the step is real. The attention kernels' own workspace
is then not in the measurement, so the prediction it is compared with leaves out the attention workspace
allowance too (`Allowance.attention_workspace`), and the stored correction says `hollow_attention: true` with the
kernel it stood for (`hf-upipe plan` names it).

Without CUDA the command says so and exits 2. The measurement runs in a fresh process, so nothing allocated before
(and no allocator state) is carried into it; the fake group has no NCCL buffers, so the allowance's NCCL and CUDA
context shares are not part of what is corrected.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import torch

__all__ = ["add_arguments", "measure_reserved", "run"]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hf_upipe.units import argument_type, parse_size, parse_tokens

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
    parser.add_argument(
        "--hollow-attention",
        action="store_true",
        help="measure with the hollow twin of the planned attention kernel (its outputs allocated, no "
        "arithmetic): seconds instead of hours at long lengths; the attention workspace is then left out of "
        "both the measurement and the prediction",
    )


def measure_reserved(spec: dict) -> int:
    """max_memory_reserved of one real step on this GPU as rank 0 of a fake `spec["world"]`-rank group."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_upipe.ops.kernels_hollow import hollow_attention
    from hf_upipe.planning.planner import resolve_model
    from hf_upipe.planning.simulate import simulated_world
    from hf_upipe.planning.train_step import StepCase, StepSettings, measure_train_step

    _, config = resolve_model(spec["model"])
    device = torch.device("cuda", torch.cuda.current_device())

    @contextlib.contextmanager
    def step_start():  # as the replay does: the cache emptied and the peak reset where the step starts
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)

    kernel = spec.get("kernel", "auto")
    hollow = hollow_attention() if kernel.startswith("hollow-") else contextlib.nullcontext()
    with simulated_world(spec["world"]), device, hollow:
        mesh = init_device_mesh("cuda", (spec["world"],))
        case = StepCase(config, spec["seq_len"], spec["sp_size"], spec["layers"], kernel=kernel)
        measure_train_step(
            case, StepSettings(**spec["settings"]), mesh=mesh, around_step=step_start()
        )
        return torch.cuda.max_memory_reserved(device)


def _measure_in_fresh_process(spec: dict) -> int:
    """What the step of `spec` reserves, measured in a new process whose allocator runs in `spec["allocator"]`'s
    mode (the one the launch will set: `hf_upipe.allocator.launch_mode`)."""
    from hf_upipe.allocator import with_mode

    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = with_mode(
        env.get("PYTORCH_CUDA_ALLOC_CONF"), spec["allocator"]
    )
    out = subprocess.run(
        [sys.executable, "-m", "hf_upipe.planning.calibrate", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{out.stderr[-4000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def _hollow_kernel(dtype: torch.dtype) -> str:
    """The hollow twin of the kernel "auto" picks on this GPU for `dtype` (the planned run's)."""
    from hf_upipe.planning.hollow_step import hollow_twin

    return hollow_twin("auto", torch.device("cuda", torch.cuda.current_device()), dtype)


def run(args: argparse.Namespace) -> int:
    if not _cuda_available():
        print(
            "hf-upipe calibrate: no CUDA device on this machine: calibration measures the allocator on a GPU. "
            "`hf-upipe plan` works without it (uncalibrated prediction).",
            file=sys.stderr,
        )
        return 2
    from hf_upipe.allocator import launch_mode
    from hf_upipe.planning.planner import plan, resolve_model
    from hf_upipe.planning.reserved import (
        Allowance,
        correction_key,
        save_correction,
        step_reserved,
    )
    from hf_upipe.planning.train_step import StepCase

    name, config = resolve_model(args.model)
    p = plan(
        args.model,
        gpus=args.gpus,
        nodes=args.nodes,
        seq_len=args.seq_len,
        gpu_memory=args.gpu_memory,
    )
    world, mode = args.gpus * args.nodes, launch_mode()
    hollow = getattr(args, "hollow_attention", False)
    spec = dict(
        model=args.model,
        world=world,
        sp_size=p.sp_size,
        seq_len=args.seq_len,
        layers=args.layers,
        settings=dataclasses.asdict(p.settings),
        kernel=_hollow_kernel(p.dtype) if hollow else "auto",
        allocator=mode,
    )
    allowance = Allowance()
    case = StepCase(config, args.seq_len, p.sp_size, args.layers)
    predicted = step_reserved(case, p.settings, world_size=world)["reserved"][mode] + (
        allowance.cublas_per_stream  # no attention workspace in a hollow step
        if hollow
        else allowance.bytes(config, p.settings, args.seq_len, p.sp_size, device_only=True)
    )
    measured = _measure_in_fresh_process(spec)
    key = correction_key(name, p.settings, mode, p.dtype)
    info = dict(seq_len=args.seq_len, layers=args.layers)
    if hollow:
        info.update(hollow_attention=True, kernel=spec["kernel"])
    fix = save_correction(key, measured, predicted, **info)
    gib = 2**30
    how = f"{args.layers} layers, {mode} segments" + (f", {spec['kernel']}" if hollow else "")
    print(f"measured reserve  {measured / gib:9.2f} GiB  ({how})")
    print(f"predicted reserve {predicted / gib:9.2f} GiB")
    print(
        f"correction        x{fix['factor']:.3f}, stored for `hf-upipe plan` (same model and settings)"
    )
    return 0


if __name__ == "__main__":  # the fresh measuring process
    print(measure_reserved(json.loads(sys.argv[1])))
