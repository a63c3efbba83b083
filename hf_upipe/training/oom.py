"""An out-of-memory error in a training step, explained with the planner's answer for the settings in force.

Entry point:
- `explain_oom(err, runtime, model)`: the `torch.OutOfMemoryError` to raise instead of `err`: its message names
  the sequence length and the settings in force, what `hf-upipe plan` predicts for them, the longest length that
  fits with them (searched in steps of `search_step(seq_len)` tokens) and the settings that would fit this length;
  torch's own message follows. The planner runs in child processes (the runtime never imports it,
  `hf_upipe.training.auto_settings`), three at once, bounded by
  `UPIPE_OOM_PLAN_TIMEOUT` seconds (default 120); whatever it could not answer in time, or at all (no GPU memory
  known: set `gpu_memory`), the message says so in a shorter line. Building the message never raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from hf_upipe.training.auto_settings import planner_model_args

__all__ = ["explain_oom", "plan_flags", "search_step"]

_GIB = 2**30


def _timeout() -> float:
    try:
        return max(float(os.environ.get("UPIPE_OOM_PLAN_TIMEOUT", "120")), 0.0)
    except ValueError:
        return 120.0


def plan_flags(config, sp_size: int) -> list[str]:
    """The `hf-upipe plan` flags that fix the memory settings of `config` (the settings in force)."""
    flags = ["--sp-size", str(sp_size)]
    if config.ring_size and config.ring_size > 1:
        flags += ["--ring", str(config.ring_size)]
    if config.heads_per_chunk is not None:
        flags += ["--heads-per-chunk", str(config.heads_per_chunk)]
    if config.fused_attention is not None:
        flags += ["--impl", "fused" if config.fused_attention else "upipe"]
    if config.tiled_mlp is not None:
        flags += ["--tiled-mlp" if config.tiled_mlp else "--no-tiled-mlp"]
    if config.offload:
        flags += ["--offload", config.offload]
    if config.fused_backward:
        flags += ["--fused-backward", config.fused_backward]
    if config.overlap_comm is not None:
        flags += ["--overlap" if config.overlap_comm else "--no-overlap"]
    for name in ("mlp_chunk_tokens", "loss_chunk_tokens"):
        value = getattr(config, name)
        if value:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def search_step(seq_len: int) -> int:
    """The granularity of the search for the longest length that fits: a sixteenth of the length in force,
    rounded down to a power of two (1 token at least, the planner's default of 128K at most), so that a length
    shorter than the one that ran out of memory can be named (at the planner's default, nothing under 128K
    tokens can)."""
    step = 1
    while step * 2 <= seq_len // 16 and step < 2**17:
        step *= 2
    return step


def _in_force(config, seq_len: int, sp_size: int, world: int) -> str:
    shown = ", ".join(
        f"{name}={getattr(config, name)!r}"
        for name in ("heads_per_chunk", "fused_attention", "tiled_mlp", "offload", "model_offload")
    )
    return f"{seq_len} tokens per sequence on {world} rank(s), sp_size={sp_size}, {shown}"


def _base_command(model, config, world: int, folder: str) -> list[str]:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    local = local if world % local == 0 else world
    command = [sys.executable, "-m", "hf_upipe.cli", "plan", "--json"]
    command += ["--gpus", str(local), "--nodes", str(world // local)]
    command += ["--model-offload", config.model_offload]
    return command + planner_model_args(model, config, folder)


def _ask_planner(commands: dict[str, list[str]]) -> dict[str, dict | None]:
    """Run the planner commands at once; each one's JSON, or None (failed or past the deadline)."""
    env = {**os.environ, "UPIPE_AUTO": "0"}
    procs = {
        k: subprocess.Popen(
            c, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        for k, c in commands.items()
    }
    deadline, out = time.monotonic() + _timeout(), {}
    for key, proc in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.01))
            out[key] = json.loads(stdout) if stdout.strip().startswith("{") else None
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.communicate()
            out[key] = None
    return out


def _advice(model, config, seq_len: int, sp_size: int, world: int) -> list[str]:
    """The planner's sentences for the settings in force at `seq_len` (module docstring)."""
    fixed = plan_flags(config, sp_size)
    with tempfile.TemporaryDirectory(prefix="upipe-oom-") as folder:
        base = _base_command(model, config, world, folder)
        answers = _ask_planner(
            {
                "now": base + ["--seq-len", str(seq_len)] + fixed,
                "max": base + ["--max", "--step", str(search_step(seq_len))] + fixed,
                "fit": base + ["--seq-len", str(seq_len), "--sp-size", str(sp_size)],
            }
        )
    now, longest, fit = answers["now"], answers["max"], answers["fit"]
    said = []
    if now is None:
        said.append("the planner did not answer for these settings")
    else:
        said.append(
            f"`hf-upipe plan` predicts {now['required'] / _GIB:.2f} GiB per GPU for them, of "
            f"{now['gpu_memory'] / _GIB:.2f} GiB ({'fits' if now['fits'] else 'does not fit'})"
        )
    if longest is not None and longest.get("max_seq_len"):
        said.append(f"the longest that fits with these settings: {longest['max_seq_len']} tokens")
    elif longest is not None:
        said.append("no length fits with these settings")
    if fit is not None and fit.get("fits"):
        s = fit["settings"]
        chosen = ", ".join(
            f"{k}={s[k]!r}" for k in ("impl", "heads_per_chunk", "tiled_mlp", "offload")
        )
        said.append(
            f"settings that fit {seq_len} tokens: {chosen} (`hf-upipe plan --seq-len {seq_len}`)"
        )
    elif fit is not None:
        said.append(f"no settings fit {seq_len} tokens on {sp_size} GPU(s) per sequence: add GPUs")
    return said


def explain_oom(err: BaseException, runtime, model, seq_len: int | None) -> torch.OutOfMemoryError:
    """See the module docstring. `seq_len`: the tokens of the step's sequence (None when unknown)."""
    config, sp, world = runtime.config, runtime.state.sp_size, runtime.world_size
    head = (
        f"hf_upipe: out of memory in a training step ({_in_force(config, seq_len or 0, sp, world)})"
    )
    try:
        said = _advice(model, config, seq_len, sp, world) if seq_len else []
    except Exception as why:  # noqa: BLE001  (the explanation must never replace the error)
        said = [f"no planner advice ({type(why).__name__}: {str(why)[:200]})"]
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    new = torch.OutOfMemoryError("; ".join([head, *said]) + f". torch: {first}")
    new.upipe_explained = True
    return new
