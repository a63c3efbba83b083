"""The out-of-memory advice, computed by a process that outlives the rank that ran out of memory.

A launcher stops every rank soon after one fails (torchrun's agent: SIGTERM to each rank's process group within a
second, SIGKILL 30 s later), and the planner's answers can take longer than that on a busy machine. So
`hf_upipe.training.oom.explain_oom` does not ask the planner itself: it starts this file as a script (no
`import hf_upipe`, no torch: it starts in a fraction of a second) in a session of its own (`start_new_session`),
which the launcher's stop does not reach. It runs the planner's questions at once, each bounded by the deadline,
and writes the sentences of the advice to the result file. The rank waits for that file for a bounded time and
puts the advice into its own error; when the rank could not wait (it was stopped, or its wait ran out), this
process prints the advice itself on the rank's stderr, which is the launcher's console:
`hf_upipe (rank N): out-of-memory advice for its error above: <sentences>`.

Entry points:
- `start(spec)`: start the advisor for `spec` (a dict: `commands` {"now", "max", "fit"}: the planner command
  lines; `seq_len`, `sp_size`, `rank`; `folder`: the planner's model folder, removed at the end; `result`: the
  result file; `deadline_s`), returns the `subprocess.Popen`.
- `sentences(answers, seq_len, sp_size, pending="")`: the advice's sentences from the planner's JSON answers
  (None: no answer; a question missing from `answers`: `pending` is said for it).
- `taken(result, keys)`: the rank says which answers it put into its error (the advisor then prints nothing, or,
  when the rank took only some, the whole advice once it has it).

The result file holds the answers so far, rewritten as each comes, so a rank that cannot wait for the slowest
question (the longest length that fits is a search) still says what the others answered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

__all__ = ["sentences", "start", "taken"]

_GIB = 2**30
_TAKEN_WAIT_S = (
    2.0  # how long the advisor waits, once its answer is written, for the rank to take it
)


def sentences(answers: dict, seq_len: int, sp_size: int, pending: str = "") -> list[str]:
    """See the module docstring; `pending`: said for each question not answered yet (empty: not waited for)."""
    said, missing = [], []
    for key in ("now", "max", "fit"):
        if key in answers:
            said.extend(_sentence(key, answers[key], seq_len, sp_size))
        else:
            missing.append(_QUESTIONS[key])
    if missing and pending:
        said.append(f"{', '.join(missing)}: {pending}")
    return said


_QUESTIONS = {
    "now": "the memory these settings need",
    "max": "the longest length that fits with these settings",
    "fit": "the settings that fit this length",
}


def _sentence(key: str, answer: dict | None, seq_len: int, sp_size: int) -> list[str]:
    if key == "now":
        if answer is None:
            return ["the planner did not answer for these settings"]
        return [
            f"`hf-upipe plan` predicts {answer['required'] / _GIB:.2f} GiB per GPU for them, of "
            f"{answer['gpu_memory'] / _GIB:.2f} GiB ({'fits' if answer['fits'] else 'does not fit'})"
        ]
    if answer is None:
        return [f"the planner did not answer for {_QUESTIONS[key]}"]
    if key == "max":
        if answer.get("max_seq_len"):
            return [f"the longest that fits with these settings: {answer['max_seq_len']} tokens"]
        return ["no length fits with these settings"]
    if answer.get("fits"):
        s = answer["settings"]
        chosen = ", ".join(
            f"{k}={s[k]!r}" for k in ("impl", "heads_per_chunk", "tiled_mlp", "offload")
        )
        return [
            f"settings that fit {seq_len} tokens: {chosen} (`hf-upipe plan --seq-len {seq_len}`)"
        ]
    return [f"no settings fit {seq_len} tokens on {sp_size} GPU(s) per sequence: add GPUs"]


def _ask(commands: dict, deadline: float, result: str) -> dict:
    """Run the planner commands at once; each one's JSON, or None (failed or past the deadline). The answers so
    far are written to `result` as each comes ({"answers": ..., "done": bool})."""
    env = {**os.environ, "UPIPE_AUTO": "0"}
    procs = {
        k: subprocess.Popen(
            c,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            # the search for the longest length is the slow one: the quick answers get the CPU first
            preexec_fn=(lambda: os.nice(10)) if k == "max" else None,
        )
        for k, c in commands.items()
    }
    out = {}
    while len(out) < len(procs):
        for key, proc in procs.items():
            if key in out:
                continue
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                stdout, _ = proc.communicate()
                try:
                    out[key] = json.loads(stdout) if stdout.strip().startswith("{") else None
                except ValueError:
                    out[key] = None
                _write(result, {"answers": out, "done": len(out) == len(procs)})
        time.sleep(0.1)
    return out


def taken(result: str, keys) -> None:
    """See the module docstring (`keys`: the answers the rank put into its error)."""
    try:
        with open(result + ".taken", "w") as f:
            json.dump(sorted(keys), f)
    except OSError:
        pass


def _write(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _taken(result: str) -> list | None:
    try:
        with open(result + ".taken") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    result = spec["result"]
    try:
        answers = _ask(spec["commands"], time.monotonic() + spec["deadline_s"], result)
        waited = time.monotonic() + _TAKEN_WAIT_S
        while time.monotonic() < waited and _taken(result) is None:
            time.sleep(0.05)
        if sorted(answers) != (
            _taken(result) or []
        ):  # the rank's error lacks some of it: say it all here
            said = sentences(answers, spec["seq_len"], spec["sp_size"])
            print(
                f"hf_upipe (rank {spec['rank']}): out-of-memory advice for its error above: "
                + "; ".join(said),
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(spec["folder"], ignore_errors=True)


def start(spec: dict) -> subprocess.Popen:
    """See the module docstring."""
    spec_path = os.path.join(spec["folder"], "advice.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), spec_path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # out of the rank's process group: a launcher's stop of the rank spares it
    )


if __name__ == "__main__":
    main(sys.argv[1])
