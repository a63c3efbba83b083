"""benchmarks/gpu/verify.sh on CPU: every stage's code as a dry run (toy model and lengths, the carried plan's
settings, the JSON rewritten after each stage), and the time budget that skips what no longer fits."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def verify():
    """benchmarks/gpu/verify.py imported with its folder on sys.path, both undone afterwards (that folder holds
    modules named `common`, `memory`, `speed`, which must not shadow other imports of the test session)."""
    path, modules = list(sys.path), set(sys.modules)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))
    try:
        import verify as module

        yield module
    finally:
        sys.path[:] = path
        bench = os.path.join(ROOT, "benchmarks")
        for name in set(sys.modules) - modules:  # only the scripts' own modules
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(bench):
                del sys.modules[name]


def test_dry_run_runs_every_stage(tmp_path):
    out = tmp_path / "out"
    # the script runs `python3` from PATH (the device's own): here, this interpreter, venv or not
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = {**os.environ, "PYTHONPATH": ROOT, "PATH": path}
    cmd = ["bash", os.path.join(ROOT, "benchmarks", "gpu", "verify.sh"), str(out), "--cpu-dry-run"]
    cmd += ["--work", str(tmp_path / "work")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "verify.json").read_text())
    assert (out / "verify.log").exists()
    env_ = doc["environment"]
    for key in ("torch", "transformers", "peft", "accelerate", "deepspeed", "command", "date"):
        assert env_.get(key), key
    s = doc["sections"]
    assert s["plan"]["gpu_memory"] == "80GiB" and s["plan"]["dry"] is True
    for stage in ("a", "b", "b_above", "c", "d", "e"):
        assert s[stage]["status"] == "done", (stage, s[stage])
    check = s["a"]["check"][0]  # the real and the hollow step of the same length, their difference
    assert check["max_allocated_real"] > 0 and "max_allocated_diff" in check
    assert s["a"]["settings"]["offload"] != "disk"  # measured as its device twin
    head = s["b"]["probes"][0]
    assert head["impl"] == "upipe" and head["fits"] in (True, False) and head["max_reserved"] > 0
    assert s["b"]["planner_max"] == s["b"]["predicted_at_max"]["seq_len"]
    assert len(s["b_above"]["probes"]) == 2  # the headline's probe kept, one above it
    assert s["c"]["probes"][0]["impl"] == "ulysses"
    assert s["d"]["loss"][0]["tiled_median_s"] > 0 and s["d"]["exactness"]["result"]["passed"]
    alloc = s["e"]["result"]["allocator"]
    assert (
        alloc["launch_mode"] == "expandable"
    )  # what the launch line sets (no CUDA allocator to arrange here)
    assert alloc["segments"] == "no CUDA allocator here"
    offload = s["e"]["result"]["model_offload"]
    assert offload["none"]["settings"]["model_offload"] == "none"
    assert offload["cpu"]["settings"]["model_offload"] == "cpu"


def test_budget_skips_a_stage_that_no_longer_fits(tmp_path, verify):
    run = verify.Run(False, str(tmp_path), {}, "80GiB", time.time() + 30)
    got = verify.run_script(run, "speed", ["--help"], cap=100, reserve=25)
    assert got["status"].startswith("skipped: ") and "25 s reserved" in got["status"]
    run = verify.Run(False, str(tmp_path), {}, "80GiB", time.time() + 300)
    got = verify.run_script(run, "verify_plan", ["--help"], cap=60, reserve=0)
    assert got["status"] == "done" and got["rc"] == 0 and got["wall_s"] < 60
