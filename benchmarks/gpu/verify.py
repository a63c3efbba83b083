"""The GPU's word in one call: the headline and what a CPU cannot see, in about 8 minutes of one H100/H200.

    bash benchmarks/gpu/verify.sh [OUT] [--cpu-dry-run]        (installs .whl/, then runs this)
    python benchmarks/gpu/verify.py --out OUT [--budget 480] [--started EPOCH] [--cpu-dry-run]

Rank 0 of a fake 8-rank group on real CUDA tensors (`common.fake_rank`), Llama3-8B geometry, bf16, the planner's
default settings for the GPU it runs on (`verify_plan.json`: its `--max` and settings for 80 GiB and 141 GB,
computed on CPU by `verify_plan.py` and carried; on the device "disk" offload is measured as its `device_twin`,
"cpu", which holds the same device memory). Stages, in this order, each in its own process (a fresh CUDA context
and allocator; `max_context.py`, `speed.py`, `verify_stages.py`), each under a time cap that leaves the later
stages their reserve:

  (a) fidelity and workspace: 4 layers, the real and the hollow step at 256K and 640K (each side of the cuDNN ->
      flash handover at 512K, `CudnnKernel.MAX_S`; at 640K the backward is tiled, `hf_upipe.ops.tiled_backward`,
      256K tiles): max_allocated, max_reserved, their difference per shard token (the kernel's workspace) beside
      the planner's allowance.
  (b) the headline: 32 layers at the planner's `--max` (9,830,400 tokens for 8 x 80 GiB), hollow attention,
      expandable segments as the launch line sets them: fits or not, max_reserved beside the predicted reserve;
      then, if time is left, one probe a step (128K) above, which should not fit.
  (c) our Ulysses mode at its own `--max`, if time is left.
  (d) the tiled loss against the plain path at vocab 128256, hidden 4096, 16K and 32K tokens: time and
      max_allocated (`speed.py --sections loss`), and its exactness on this GPU (`verify_stages.loss_exactness`).
  (e) the allocator mode the launch line sets (in force after `arrange_allocator`, segments expandable) and the
      host offload of model states (4 layers at 256K, model offload "none" against "cpu", beside the planner).

Device-time plan, from the 2026-11-23 H100 timings (benchmarks/results/gpu/*.json): a 4-layer real step at
256K took 7.4 s, at 512K 22.8 s, at 1M 84 s (attention grows as S^2: 640K about 35 s); a 32-layer real step at
256K 46 s; the loss rows 0.1-0.5 s each. A process start with imports and a model build costs about 15 s (4
layers) to 40 s (32 layers); warm-up steps run at 64K-128K. Estimated (cap) seconds:

    start: wheels, imports, nvidia-smi                                      25  (-)
    (a) real 256K 25 + hollow 256K 18 + real 640K 55 + hollow 640K 22      120  (130)
    (b) 32 layers at 9.4M: build 40, warm-up 10, step ~150 (projections
        and MLP of a 1.2M-token shard: ~4 s a layer; loss 5 s; offload)    200  (230)
    (b) one step above, (c) Ulysses: only if time is left                    0  (-)
    (d) loss 16K, 32K: 4 rounds x 2 paths + exactness + process            25  (40)
    (e) allocator check 10 + two 4-layer hollow steps at 256K 2 x 20        50  (55)
    total                                                                  420  (480 = the budget)

The JSON (<out>/verify.json) is rewritten after every stage, so a run cut off still returns what it measured; it
names the device, driver, torch and every package version, the command, and each stage's status ("done",
"failed", "timed out", "skipped: ..."), wall time and results. Working files go to --work (not to <out>: the
device tool returns 8 files at most). `--cpu-dry-run` runs every stage's code on CPU at toy sizes, in this process
(seconds; no numbers to report).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import max_context  # noqa: E402  (benchmarks/gpu/, imported before any benchmarks/ path is added)
import max_context_step  # noqa: E402,F401
import torch  # noqa: E402
from common import GiB, Results  # noqa: E402

CAPS = dict(a=130, b=230, b_above=200, c=200, d=40, e=55)  # seconds (see the docstring)
RESERVE = dict(
    a=CAPS["b"] + CAPS["d"] + CAPS["e"], b=CAPS["d"] + CAPS["e"], c=CAPS["d"] + CAPS["e"]
)
RESERVE.update(d=CAPS["e"], e=0)
EXPANDABLE = "expandable_segments:True"


@dataclasses.dataclass(frozen=True)
class Run:
    """What every stage needs: the mode, where to write, the carried plans for this GPU, the clock."""

    dry: bool
    work: str
    plan: (
        dict  # verify_plan.json's rows for this GPU: {"upipe": ..., "ulysses": ..., "offload": ...}
    )
    gpu_memory: str
    deadline: float

    def left(self) -> float:
        return self.deadline - time.time()


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def load_plan(path: str, dry: bool, gpu_total: int) -> tuple[str, dict, dict]:
    """(gpu_memory, this GPU's plans, the file's header) from verify_plan.json; a dry run takes the 80 GiB rows and
    uses only their settings (toy model and lengths)."""
    from verify_plan import planning_digest

    with open(path) as f:
        doc = json.load(f)
    gpu_memory = "141GB" if gpu_total > 100 * GiB else "80GiB"
    plans = {impl: _pick(doc["plans"], impl, gpu_memory) for impl in ("upipe", "ulysses")}
    plans["offload"] = doc.get("offload", {}).get(gpu_memory)
    header = dict(
        file=os.path.relpath(path, ROOT), made=doc.get("made"), command=doc.get("command"),
        planning_digest=doc.get("planning_digest"), plan_current=doc.get("planning_digest") == planning_digest(),
        gpu_memory=gpu_memory,
    )  # fmt: skip
    return gpu_memory, plans, header


def _pick(plans: dict, impl: str, gpu_memory: str):
    """The row "impl@layers@gpu_memory" (32 layers; 2 in a dry plan), or None."""
    keys = [k for k in plans if k.split("@")[0] == impl and k.split("@")[-1] == gpu_memory]
    return plans[keys[0]] if keys else None


def device_settings(settings: dict) -> dict:
    """The settings measured on the device: `device_twin` ("disk" offload holds on the device what "cpu" holds)."""
    from hf_upipe.planning.train_step import StepSettings, device_twin

    return dataclasses.asdict(device_twin(StepSettings(**settings)))


def seed(path: str, impl: str, layers: int, settings: dict, max_seq_len) -> None:
    """max_context.py's JSON with the carried plan in its "planned" section (read with --resume: no planner)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = json.load(open(path)) if os.path.exists(path) else {"sections": {}}
    doc["sections"].setdefault("planned", {})[f"{impl}@{layers}"] = dict(
        settings=settings, max_seq_len=max_seq_len
    )
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def run_script(run: Run, name: str, argv: list[str], cap: float, reserve: float, env=None) -> dict:
    """benchmarks/gpu/<name>.py with argv: in a fresh process under min(cap, time left - reserve) seconds, or, for
    a dry run, in this process (its children too). Returns status, rc, wall_s (and the log's tail on failure)."""
    limit = min(cap, run.left() - reserve)
    if limit < 10:
        return dict(
            status=f"skipped: {max(0, int(run.left()))} s left, {int(reserve)} s reserved for later stages"
        )
    t0 = time.time()
    if run.dry:
        rc = _in_process(name, argv, env)
        return dict(
            status="done" if rc == 0 else "failed", rc=rc, wall_s=round(time.time() - t0, 1)
        )
    log = os.path.join(run.work, f"{name}-{len(os.listdir(run.work))}.log")
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), *argv]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit, check=False,
                env={**os.environ, **(env or {})},
            ).returncode  # fmt: skip
            status = "done" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, f"timed out after {int(limit)} s"
    out = dict(status=status, rc=rc, wall_s=round(time.time() - t0, 1), command=" ".join(cmd))
    if status != "done":
        out["log_tail"] = open(log).read()[-3000:]
    return out


def _in_process(name: str, argv: list[str], env) -> int:
    """A dry run's stage: the script's main(argv) here, max_context.py's measuring children in this process."""
    import importlib

    module = importlib.import_module(name)
    if name == "max_context":
        from max_context_step import child

        module.run_child = lambda spec, timeout: child(spec)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return module.main(argv)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _sections(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f).get("sections", {})
    except (OSError, ValueError):
        return {}


def _mc_path(run: Run, stage: str) -> tuple[str, str]:
    """(--out for max_context.py, the JSON it writes) of a stage."""
    out = os.path.join(run.work, stage)
    return out, os.path.join(out, "cpu-dry-run" if run.dry else "", "max_context.json")


def stage_a(run: Run) -> dict:
    plan = run.plan["upipe"]
    settings = device_settings(plan["settings"])
    out, path = _mc_path(run, "a")
    seed(path, "upipe", max_context.DRY["layers"] if run.dry else 4, settings, None)
    argv = ["--resume", "--sections", "check", "--layers", "4", "--impls", "upipe", "--no-predict",
            "--check-lengths", "256K,640K", "--warmup-len", "256" if run.dry else "64K", "--out", out]  # fmt: skip
    argv += ["--cpu-dry-run"] if run.dry else ["--probe-timeout", str(CAPS["a"])]
    result = run_script(run, "max_context", argv, CAPS["a"], RESERVE["a"])
    from hf_upipe.ops.kernels_aten import CudnnKernel
    from hf_upipe.ops.tiled_backward import backward_block

    result.update(
        settings=settings, cudnn_max_s=CudnnKernel.MAX_S, backward_block=backward_block(),
        check=_sections(path).get("check"), probes=_sections(path).get("probes"),
    )  # fmt: skip
    return result


def stage_max(run: Run, impl: str, stage: str, cap: float, probes: int) -> dict:
    """(b) and (c): 32 layers at the carried `--max` of `impl` (probes=2: and one step above if that fits)."""
    plan = run.plan[impl]
    if not plan or not plan.get("max_seq_len"):
        return dict(status=f"skipped: no carried plan for {impl} at {run.gpu_memory}")
    settings = device_settings(plan["settings"])
    out, path = _mc_path(run, stage)
    seed(path, impl, max_context.DRY["layers"] if run.dry else 32, settings, plan["max_seq_len"])
    argv = ["--resume", "--sections", "bisect", "--layers", "32", "--impls", impl, "--no-predict",
            "--max-probes", str(probes), "--warmup-len", "256" if run.dry else "128K", "--gpu-memory", run.gpu_memory,
            "--out", out]  # fmt: skip
    argv += ["--cpu-dry-run"] if run.dry else ["--probe-timeout", str(int(cap))]
    env = {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE} if plan.get("allocator") == "expandable" else {}
    result = run_script(run, "max_context", argv, cap, RESERVE[stage[0]], env)
    rows = _sections(path).get("probes") or []
    result.update(
        impl=impl, planner_max=plan["max_seq_len"], planned_settings=plan["settings"], measured_settings=settings,
        env=env, probes=rows, predicted_at_max=plan.get("at_max"), predicted_above_max=plan.get("above_max"),
    )  # fmt: skip
    return result


def stage_d(run: Run) -> dict:
    out = os.path.join(run.work, "d")
    argv = ["--sections", "loss", "--loss-tokens", "16K,32K", "--reps", "3", "--out", out]
    argv += ["--cpu-dry-run"] if run.dry else []
    result = run_script(run, "speed", argv, CAPS["d"] - 15, RESERVE["d"] + 15)
    path = os.path.join(out, "cpu-dry-run" if run.dry else "", "speed.json")
    result["loss"] = _sections(path).get("loss")
    exact_out = os.path.join(run.work, "d_exact.json")
    argv = ["loss_exactness", "--out", exact_out] + (["--cpu-dry-run"] if run.dry else [])
    result["exactness"] = run_script(run, "verify_stages", argv, 15, RESERVE["d"])
    result["exactness"]["result"] = _load(exact_out)
    return result


def stage_e(run: Run) -> dict:
    out = os.path.join(run.work, "e.json")
    pair = run.plan.get("offload") or {}
    argv = ["allocator_and_offload", "--out", out, "--pair", json.dumps(pair)]
    argv += ["--cpu-dry-run"] if run.dry else []
    result = run_script(run, "verify_stages", argv, CAPS["e"], RESERVE["e"])
    result["result"] = _load(out)
    return result


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def arguments(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu", "verify"))
    ap.add_argument(
        "--work", default=None, help="working files (default: <out>/../verify-work, or a temp dir)"
    )
    ap.add_argument(
        "--budget", type=float, default=480.0, help="seconds for the whole run, from --started"
    )
    ap.add_argument(
        "--started", type=float, default=None, help="epoch seconds the run started (verify.sh's)"
    )
    ap.add_argument("--plan", default=os.path.join(HERE, "verify_plan.json"))
    ap.add_argument("--stages", default="a,b,c,d,e")
    ap.add_argument("--cpu-dry-run", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = arguments(argv)
    dry = args.cpu_dry_run
    if dry:  # the smallest model and lengths that run every stage: common.llama3_8b, max_context.py's DRY
        os.environ["HF_UPIPE_GPU_DRY"] = "tiny"
        max_context.DRY.update(layers=1, step=512, check=[1024])
    if not dry and not torch.cuda.is_available():
        print(
            "verify.py: no CUDA device here; pass --cpu-dry-run to check the script on CPU.",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cpu" if dry else "cuda")
    work = args.work or os.path.join("/tmp", f"hf_upipe_verify_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    res = Results(os.path.join(args.out, "verify.json"), device)
    env = res.doc["environment"]
    env.update(
        driver=None if dry else _driver(),
        PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )
    env["wheels"] = (
        sorted(os.listdir(os.path.join(ROOT, ".whl")))
        if os.path.isdir(os.path.join(ROOT, ".whl"))
        else []
    )
    gpu_total = 0 if dry else torch.cuda.get_device_properties(device).total_memory
    gpu_memory, plans, header = load_plan(args.plan, dry, gpu_total)
    started = args.started or time.time()
    run = Run(dry, work, plans, gpu_memory, started + args.budget)
    res.put("plan", dict(header, dry=dry, budget_s=args.budget, work=work))
    todo = args.stages.split(",")
    order = [
        ("a", lambda: stage_a(run)),
        ("b", lambda: stage_max(run, "upipe", "b", CAPS["b"], 1)),
        ("b_above", lambda: _above(run, res)),
        ("c", lambda: stage_max(run, "ulysses", "c", CAPS["c"], 1)),
        ("d", lambda: stage_d(run)),
        ("e", lambda: stage_e(run)),
    ]
    for name, fn in order:
        if name.split("_")[0] not in todo:
            continue
        t0 = time.time()
        print(f"== stage {name} ({int(run.left())} s left)", flush=True)
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (recorded; the next stage runs)
            result = res.error(f"stage {name}", err)
            result["status"] = "failed"
        result.setdefault("wall_s", round(time.time() - t0, 1))
        res.put(name, result)
        print(f"   {name}: {result.get('status')} ({result['wall_s']} s)", flush=True)
    res.doc["wall_time_s"] = round(time.time() - started, 1)
    res.write()
    summary(res.doc)
    return 0 if all(s.get("status") in (None, "done") or str(s.get("status")).startswith("skipped")
                    for k, s in res.doc["sections"].items() if k != "plan") else 1  # fmt: skip


def _above(run: Run, res: Results) -> dict:
    """(b), one probe a step above the headline: only if the headline fit and time is left for it."""
    head = res.doc["sections"].get("b") or {}
    rows = head.get("probes") or []
    if not rows or rows[-1].get("fits") is not True:
        return dict(status="skipped: the headline probe did not fit (or did not run)")
    if run.left() < CAPS["b_above"] + RESERVE["b"]:
        return dict(
            status=f"skipped: {int(run.left())} s left, the probe above needs {CAPS['b_above']} s"
        )
    return stage_max(run, "upipe", "b", CAPS["b_above"], 2)


def summary(doc: dict) -> None:
    s = doc["sections"]
    print(f"\nverify: {doc['environment'].get('gpu', doc['environment']['device'])}, "
          f"{doc.get('wall_time_s')} s")  # fmt: skip
    for name in ("a", "b", "b_above", "c", "d", "e"):
        if name in s:
            print(f"  {name}: {s[name].get('status')}")
    predicted = ((s.get("b") or {}).get("predicted_at_max") or {}).get("predicted_reserved")
    for row in (s.get("b") or {}).get("probes") or []:
        print(
            f"  probe {row.get('impl')} {row.get('seq_len')}: fits {row.get('fits')}, max_reserved "
            f"{row.get('max_reserved')} (predicted reserve at --max {predicted})"
        )
    for row in (s.get("d") or {}).get("loss") or []:
        print(f"  loss {row.get('tokens')}: tiled/plain {row.get('tiled_over_plain')}")


if __name__ == "__main__":
    raise SystemExit(main())
