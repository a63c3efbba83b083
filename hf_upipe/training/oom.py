"""An out-of-memory error in a training step, explained with the planner's answer for the settings in force.

Entry point:
- `explain_oom(err, runtime, model)`: the `torch.OutOfMemoryError` to raise instead of `err`: its message names
  the sequence length and the settings in force, what `hf-upipe plan` predicts for them, the longest length that
  fits with them (searched in steps of `search_step(seq_len)` tokens) and the settings that would fit this length;
  torch's own message follows. The planner runs in child processes (the runtime never imports it,
  `hf_upipe.training.auto_settings`), three at once, bounded by `UPIPE_OOM_PLAN_TIMEOUT` seconds (default 120),
  started by an advisor process in a session of its own (`hf_upipe.training.oom_advisor`), which a launcher's
  stop of the rank does not reach; whatever it could not answer in time, or at all (no GPU memory known: set
  `gpu_memory`), the message says so in a shorter line. Building the message never raises.
- `hold_s()`: how long the rank waits for the advice, and holds a launcher's SIGTERM meanwhile
  (`hf_upipe.training.peers.hold_for`): `UPIPE_OOM_PLAN_TIMEOUT`, at most `_LAUNCHER_WAIT_S` (20 s) under a
  launcher (torchrun's agent kills a rank 30 s after its SIGTERM), plus `_GRACE_S` and `_SAY_S`. What the planner
  has answered by then goes into the message, which says what it has not; the advisor then prints the whole
  advice on the same console once it has it: `hf_upipe (rank N): out-of-memory advice for its error above: ...`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from hf_upipe.training import oom_advisor
from hf_upipe.training.auto_settings import planner_model_args

__all__ = ["explain_oom", "hold_s", "plan_flags", "search_step"]

_GIB = 2**30
_LAUNCHER_WAIT_S = 20.0  # the longest wait for the advice under a launcher
_GRACE_S = 3.0  # the advisor's start and its answer's write, beyond the planner's deadline
_SAY_S = 4.0  # the rank's message built and printed, once the wait is over


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


def _wait_s() -> float:
    """How long the rank waits for the advice: `UPIPE_OOM_PLAN_TIMEOUT`, and under a launcher at most
    `_LAUNCHER_WAIT_S` (its agent kills a stopped rank 30 s after its SIGTERM)."""
    limit = _timeout()
    return min(limit, _LAUNCHER_WAIT_S) if os.environ.get("TORCHELASTIC_RUN_ID") else limit


def hold_s() -> float:
    """How long a launcher's SIGTERM is held while the rank explains its out-of-memory error: the wait, and
    `_SAY_S` to build and print the message."""
    return _wait_s() + _GRACE_S + _SAY_S


def _advice(model, config, seq_len: int, sp_size: int, world: int) -> list[str]:
    """The planner's sentences for the settings in force at `seq_len` (module docstring)."""
    fixed = plan_flags(config, sp_size)
    folder = tempfile.mkdtemp(prefix="upipe-oom-")
    base = _base_command(model, config, world, folder)
    result = os.path.join(folder, "result.json")
    advisor = oom_advisor.start(
        {
            "commands": {
                "now": base + ["--seq-len", str(seq_len)] + fixed,
                "max": base + ["--max", "--step", str(search_step(seq_len))] + fixed,
                "fit": base + ["--seq-len", str(seq_len), "--sp-size", str(sp_size)],
            },
            "seq_len": seq_len,
            "sp_size": sp_size,
            "rank": int(os.environ.get("RANK", "0")),
            "folder": folder,
            "result": result,
            "deadline_s": _timeout(),
        }
    )
    wait = _wait_s()
    # the advisor answers by its deadline, started at once
    deadline = time.monotonic() + wait + _GRACE_S
    answers = {}
    while time.monotonic() < deadline and advisor.poll() is None:
        answers, done = _read(result)
        if done:
            break
        time.sleep(0.1)
    else:
        answers, _ = _read(result)
    oom_advisor.taken(result, answers)
    pending = (
        f"not answered after {wait:.0f} s; process {advisor.pid}, which outlives this rank, prints the advice "
        "on this console when it has it"
    )
    if advisor.poll() not in (None, 0):  # the advisor itself failed: nothing more will come
        pending = f"the planner did not answer (its advisor ended with status {advisor.returncode})"
    return oom_advisor.sentences(answers, seq_len, sp_size, pending=pending)


def _read(result: str) -> tuple[dict, bool]:
    """The advisor's answers so far and whether they are all in."""
    try:
        with open(result) as f:
            data = json.load(f)
        return data["answers"], data["done"]
    except (OSError, ValueError, KeyError):
        return {}, False


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
    # under a launcher: one line, status 1 at once (hf_upipe.exits)
    new.upipe_fault = "torch.OutOfMemoryError"
    return new
