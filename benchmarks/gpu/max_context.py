"""Max context on one GPU, measured: the longest sequence whose training step fits, per implementation.

    python benchmarks/gpu/max_context.py [--impls upipe,ulysses,deepspeed] [--layers 32] [--step 128K]
        [--check-lengths 256K,640K] [--sections check,bisect] [--max-probes 6] [--resume] [--no-predict]
        [--warmup-len LEN] [--out benchmarks/results/gpu] [--cpu-dry-run]

Rank 0 of a fake 8-rank group on real CUDA tensors (`common.fake_rank`), Llama3-8B geometry with `--layers`
decoder layers, bf16 compute, fp32 master weights, FSDP2 over 8, AdamW, checkpointing on every layer: the step of
`hf_upipe.planning.train_step.measure_train_step`, with the settings `hf_upipe.plan` chooses at its longest
length for each implementation: "upipe" (the planner's default ladder: the fused UPipe block), "ulysses" (our
Ulysses mode) and "deepspeed" (DeepSpeed's `UlyssesSPAttentionHF`, when importable). Every measured step runs in
its own process (`max_context_step.py`: a fresh CUDA context and allocator): one warm-up step, then the measured
step, whose `max_memory_reserved` is read after the cache is emptied and the peak reset where it starts.

The attention is hollow (`hf_upipe.ops.kernels_hollow`: the twin of the kernel "auto" picks allocates that
kernel's outputs and skips its arithmetic; DeepSpeed's torch SDPA goes through `hf_upipe.planning.hollow_step`),
so a step at millions of tokens takes about as long as its projections, MLP, loss and offload. A length fits when

    max_memory_reserved + attention workspace + NCCL 1 GiB + CUDA context <= the GPU's total memory

where the CUDA context (with the libraries' handles) is measured in the step's process (`cudaMemGetInfo` use minus
the allocator's reserve), NCCL's 1 GiB is the planner's stated allowance (`Allowance.nccl`: a fake group has no
NCCL buffers), and the attention workspace (what the real kernel allocates inside, absent from a hollow step) is
the planner's measured rate (`Allowance.attention_workspace`). The search walks from the planner's `--max` in
`--step` units (up while it fits, down while it does not, doubling), then bisects.

Host memory. Rank 0 offloads what one GPU of the real run would (`hf_upipe.planning.plan_result.host_bytes`):
at 32 layers 31 x shard x hidden x 2 bytes, about 124 GiB at 4M tokens, more than a 128 GiB machine has. By
default (`--host-offload shared`) the offloaded inputs share one pinned host buffer per shape (`SharedHostPool`):
every device allocation and copy of the offload is as in the real step, only the host keeps one layer input.
With `--host-offload real` each input has its own buffer, and a length whose inputs do not fit 90% of the free
host memory is not run (`host_memory_short`).

Sections (written into <out>/max_context.json after every step, `--resume` reuses its measured steps):
1. check (`--check-lengths`): the real and the hollow step at lengths where both finish, for each implementation:
   per-step max_allocated and max_reserved of each and their difference (the kernel's workspace), per shard
   token, beside the planner's workspace allowance.
2. bisect: the longest fitting length per implementation, each probe beside the planner's prediction
   (`hf_upipe.plan` at that length with the same settings: tensors, predicted reserve, allowance) and the
   planner's `--max`, and the ratios of the lengths.

Device time (30 minutes for a session, 10 per call): nothing here has been run on a GPU yet; these are estimates
from the H100 runs of `memory.py` (a real 4-layer step at 256K: 7 s; at 1M: 84 s; 32 layers at 256K: 46 s,
model build included) and the step's arithmetic, to be replaced by what the first run prints. A probe costs a
process start and the model build (about 20-40 s for 32 layers), then two steps (warm-up and measured). With a
hollow kernel the 32-layer step at 3-4M tokens is dominated by the projections and MLP of a 384K-512K token
shard (about 1-2 minutes each), so a 32-layer probe there takes 3-5 minutes and a full bisection of one
implementation 10-20 minutes. Order within a 30-minute budget:
  a. `--cpu-dry-run` on any machine first (seconds; checks the script, no numbers).
  b. `--sections check --layers 4 --impls upipe --check-lengths 256K,640K` (about 2-3 minutes): the workspace
     and the hollow twin's fidelity, before trusting any hollow number. One length on each side of 512K: above
     it the cuDNN kernel hands over to the flash kernel (`CudnnKernel.MAX_S`), whose workspace differs.
  c. `--sections bisect --layers 4 --impls upipe,ulysses` (about 5 minutes): the search at 4 layers.
  d. `--sections bisect --layers 32 --impls upipe --resume --max-probes 3 --warmup-len 128K` per call (each call
     under 10 minutes; `--resume` carries the probes over), then ulysses, then deepspeed.
`--warmup-len` runs the warm-up step at a shorter length (it initialises the libraries; the measured step is
unchanged) to save one long step per probe. `--no-predict` skips the planner's predictions (a few seconds of CPU
per probe); they can be filled in later on any machine with `--sections predict --resume`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402
    GiB,
    Results,
    deepspeed_importable,
    parse,
    parse_len,
    parser,
)
from max_context_step import model_config  # noqa: E402

P = 8
NCCL = 1 * GiB  # the planner's stated NCCL allowance for 8 GPUs per node (Allowance.nccl)
PLANNER_IMPL = dict(upipe=None, ulysses="ulysses", deepspeed="deepspeed")  # hf_upipe.plan(impl=...)
DRY = dict(step=1024, layers=2, max_probes=3, check=[2048])


# ----------------------------------------------------------------------------------------------- the parent
def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        return 0


def run_child(spec: dict, timeout: int) -> dict:
    """`child(spec)` in a fresh process: its row, or {"error": ...}."""
    cmd = [sys.executable, os.path.join(HERE, "max_context_step.py"), json.dumps(spec)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": f"rc {out.returncode}: {out.stderr[-3000:]}"}
    return json.loads(lines[-1])


class Search:
    """The probes of one run: measured once (also across `--resume`), judged against the fit criterion."""

    def __init__(self, res: Results, args, dry: bool):
        self.res, self.args, self.dry = res, args, dry
        self.rows = res.doc["sections"].setdefault("probes", [])
        self.gpu_total = args.gpu_total

    def _key(self, impl, settings, seq_len, hollow) -> tuple:
        return (impl, json.dumps(settings, sort_keys=True), seq_len, self.args.layers, hollow)

    def probe(self, impl: str, settings: dict, seq_len: int, hollow: bool = True) -> dict:
        from hf_upipe.planning.plan_result import host_bytes
        from hf_upipe.planning.train_step import StepSettings

        for row in self.rows:
            if (
                self._key(row["impl"], row["settings"], row["seq_len"], row["hollow"])
                == (self._key(impl, settings, seq_len, hollow))
                and "error" not in row
            ):
                return row
        cfg = model_config(self.dry, self.args.layers)
        row = dict(impl=impl, settings=settings, seq_len=seq_len, layers=self.args.layers)
        row.update(hollow=hollow, workspace=self._workspace(cfg, settings, seq_len, hollow))
        host = host_bytes(cfg, StepSettings(**settings), seq_len, P, torch.bfloat16)
        row["host_bytes"] = host
        if self.args.host_offload == "real" and not self.dry and host > 0.9 * _host_available():
            row.update(host_memory_short=True, fits=False)
        else:
            spec = dict(
                dry=self.dry, settings=settings, seq_len=seq_len, layers=self.args.layers,
                hollow=hollow, warmup_len=self.args.warmup_len or seq_len,
                host_offload=self.args.host_offload,
            )  # fmt: skip
            row.update(run_child(spec, self.args.probe_timeout))
            row["fits"] = self._fits(row)
        if self.args.predict:
            row["predicted"] = predict(self.dry, self.args, settings, seq_len)
        self.rows.append(row)
        self.res.put("probes", self.rows)
        print(_line(row), flush=True)
        return row

    def _workspace(self, cfg, settings: dict, seq_len: int, hollow: bool) -> int:
        from hf_upipe.planning.reserved import Allowance
        from hf_upipe.planning.train_step import StepSettings

        if not hollow or self.dry:
            return 0
        return Allowance().attention_workspace(cfg, StepSettings(**settings), seq_len, P)

    def _fits(self, row: dict) -> bool | None:
        if row.get("oom"):
            return False
        if "max_reserved" not in row:
            return None  # an error: not judged
        nccl = 0 if self.dry else NCCL
        row["required"] = row["max_reserved"] + row["workspace"] + nccl + row["context"]
        return row["required"] <= (self.gpu_total or row.get("gpu_total", 0))


def predict(dry: bool, args, settings: dict, seq_len: int) -> dict:
    """`hf_upipe.plan` for the measured step: same model depth, settings and length."""
    from hf_upipe.planning.planner import plan
    from hf_upipe.planning.train_step import StepSettings

    try:
        p = plan(
            model_config(dry, args.layers), gpus=P, gpu_memory=args.gpu_memory, seq_len=seq_len,
            settings=StepSettings(**settings),
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001  (recorded beside the measurement)
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return dict(
        tensor_peak=p.tensor_peak, predicted_reserved=p.predicted_reserved, allowance=p.allowance,
        required=p.required, fits=p.fits,
    )  # fmt: skip


def _line(row: dict) -> str:
    def g(key):
        v = row.get(key)
        return f"{v / GiB:.2f}" if isinstance(v, int) else "-"

    pred = row.get("predicted") or {}
    return (
        f"{row['impl']:<10} {row['seq_len'] / 2**10:>8.0f}K {'hollow' if row['hollow'] else 'real':<6} "
        f"reserved {g('max_reserved')} GiB allocated {g('max_allocated')} GiB context {g('context')} "
        f"required {g('required')} GiB fits {row.get('fits')} | planner: reserve "
        f"{pred.get('predicted_reserved', 0) / GiB:.2f} GiB required {pred.get('required', 0) / GiB:.2f} GiB"
        + (f" | {row['error'][:200]}" if row.get("error") else "")
    )


def planned(res: Results, args, dry: bool, impl: str) -> dict:
    """The planner's settings and `--max` for `impl` at the measured depth (kept in the JSON for --resume)."""
    from hf_upipe.planning.planner import plan

    done, key = res.doc["sections"].setdefault("planned", {}), f"{impl}@{args.layers}"
    if key not in done:
        p = plan(
            model_config(dry, args.layers), gpus=P, gpu_memory=args.gpu_memory, max_context=True,
            impl=PLANNER_IMPL[impl], step=args.step, **({"max_seq_len": 8 * args.step} if dry else {}),
        )  # fmt: skip
        done[key] = dict(settings=dataclasses.asdict(p.settings), max_seq_len=p.max_seq_len)
        res.put("planned", done)
    return done[key]


def bisect(search, impl: str, settings: dict, start: int, step: int, max_probes: int) -> dict:
    """The longest k * step that fits: from `start` outwards by doubling strides (up while it fits, down while it
    does not), then halving the bracket [lo fits, hi does not]; at most `max_probes` measured steps."""
    lo, hi = (
        0,
        None,
    )  # lo: the longest known to fit (0: none yet); hi: the shortest known not to (None: none yet)
    k, stride, probes = max(1, start // step), 1, 0
    while probes < max_probes:
        fits = search.probe(impl, settings, k * step)["fits"]
        probes += 1
        if fits is None:
            return dict(longest=None, note="a probe failed (see errors)", probes=probes)
        lo, hi = (k, hi) if fits else (lo, k)
        if hi is not None and hi - lo <= 1:
            break
        if hi is None:
            k = lo + stride
        elif lo == 0:
            k = max(1, hi - stride)
        else:
            k = (lo + hi) // 2
        stride *= 2
    return dict(
        longest=lo * step, bracket_tokens=[lo * step, hi * step if hi else None],
        exact=hi is not None and hi - lo <= 1, probes=probes,
    )  # fmt: skip


def check(search: Search, res: Results, args, dry: bool, impls: list[str], lengths: list[int]):
    rows = []
    for impl in impls:
        settings = planned(res, args, dry, impl)["settings"]
        for n in lengths:
            real, hollow = (search.probe(impl, settings, n, hollow=h) for h in (False, True))
            row = dict(impl=impl, seq_len=n, real_wall_s=real.get("step_wall_s"))
            row["hollow_wall_s"] = hollow.get("step_wall_s")
            for key in ("max_allocated", "max_reserved", "tracked_peak"):
                if key in real and key in hollow:
                    row[f"{key}_real"], row[f"{key}_hollow"] = real[key], hollow[key]
                    row[f"{key}_diff"] = real[key] - hollow[key]
            if "max_allocated_diff" in row:
                row["workspace_per_shard_token"] = row["max_allocated_diff"] / (n // P)
                row["planner_workspace"] = search._workspace(
                    model_config(False, args.layers), settings, n, True
                )
            rows.append(row)
            res.put("check", rows)
            print("check", row, flush=True)


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def arguments():
    ap = parser(__doc__)
    ap.add_argument("--impls", default="upipe,ulysses,deepspeed")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (4 for a quick run)")
    ap.add_argument("--step", default="128K", help="the search's unit of length")
    ap.add_argument("--check-lengths", default="", help="lengths of the real-vs-hollow check")
    ap.add_argument("--sections", default="check,bisect", help="check, bisect, predict")
    ap.add_argument("--max-probes", type=int, default=6, help="measured steps per implementation")
    ap.add_argument("--gpu-memory", default="80GiB", help="the planner's GPU memory")
    ap.add_argument(
        "--warmup-len", default="", help="the warm-up step's length (default: the probe's)"
    )
    ap.add_argument("--probe-timeout", type=int, default=560, help="seconds per measuring process")
    ap.add_argument(
        "--resume", action="store_true", help="reuse the measured steps of <out>/max_context.json"
    )
    ap.add_argument("--no-predict", dest="predict", action="store_false")
    ap.add_argument(
        "--host-offload",
        choices=("shared", "real"),
        default="shared",
        help="offloaded inputs in one shared pinned buffer per shape (default), or each in its own",
    )
    return ap


def main(argv=None) -> int:
    args, device = parse(arguments(), argv)
    dry = args.cpu_dry_run
    args.step = DRY["step"] if dry else parse_len(args.step)
    args.warmup_len = parse_len(args.warmup_len) if args.warmup_len else 0
    if dry:
        args.layers, args.max_probes = DRY["layers"], min(args.max_probes, DRY["max_probes"])
    checks = DRY["check"] if dry else [parse_len(x) for x in args.check_lengths.split(",") if x]
    impls = [i for i in args.impls.split(",") if i]
    if "deepspeed" in impls and not deepspeed_importable():
        impls.remove("deepspeed")
        print("deepspeed: not importable here, skipped", flush=True)
    path = os.path.join(args.out, "max_context.json")
    previous = json.load(open(path)) if args.resume and os.path.exists(path) else None
    res = Results(path, device)
    if previous:
        res.doc["sections"].update(previous.get("sections", {}))
    res.doc["environment"]["driver"] = _driver() if device.type == "cuda" else None
    args.gpu_total = torch.cuda.get_device_properties(device).total_memory if not dry else 0
    search = Search(res, args, dry)
    if dry:  # a toy GPU: the simulated tensor peak of the first impl's step at 3 units (the dry run's "reserve")
        search.gpu_total = _dry_gpu(res, args, impls[0])
    sections = args.sections.split(",")
    start, first_new = time.perf_counter(), len(search.rows)
    if "check" in sections and checks:
        check(search, res, args, dry, impls, checks)
    if "bisect" in sections:
        search_all(search, res, args, dry, impls)
    if "predict" in sections:
        for row in search.rows:
            row["predicted"] = predict(dry, args, row["settings"], row["seq_len"])
        res.put("probes", search.rows)
    res.doc["wall_time_s"] = round(time.perf_counter() - start, 1)
    res.write()
    errors = [r for r in search.rows[first_new:] if r.get("error")]
    print(
        f"\nmax_context: {len(errors)} failed probes; wrote {res.path} ({res.doc['wall_time_s']} s)"
    )
    return 1 if errors else 0


def search_all(search: Search, res: Results, args, dry: bool, impls: list[str]) -> None:
    """The longest fitting length of each implementation at `--layers`, the planner's `--max` and the ratios to
    our Ulysses mode's, into the "max_context" section (keyed "impl@layers")."""
    found = res.doc["sections"].setdefault("max_context", {})
    for impl in impls:
        plan_ = planned(res, args, dry, impl)
        start_len = 2 * args.step if dry else plan_["max_seq_len"] or args.step
        found[f"{impl}@{args.layers}"] = dict(
            impl=impl, layers=args.layers, planner_max=plan_["max_seq_len"],
            **bisect(search, impl, plan_["settings"], start_len, args.step, args.max_probes),
        )  # fmt: skip
        res.put("max_context", found)
    base = (found.get(f"ulysses@{args.layers}") or {}).get("longest")
    print(f"\n{'impl':<10} {'layers':>6} {'longest':>10} {'planner --max':>14} {'x ulysses':>10}")
    for row in found.values():
        if row["layers"] == args.layers:
            row["ratio_to_ulysses"] = row["longest"] / base if base and row["longest"] else None
        ratio = f"{row['ratio_to_ulysses']:.2f}" if row.get("ratio_to_ulysses") else "-"
        longest = f"{row['longest'] / 2**10:.0f}K" if row["longest"] is not None else "failed"
        planner = f"{(row['planner_max'] or 0) / 2**10:.0f}K"
        print(f"{row['impl']:<10} {row['layers']:>6} {longest:>10} {planner:>14} {ratio:>10}")
    res.put("max_context", found)


def _dry_gpu(res, args, impl) -> int:
    from hf_upipe.planning.train_step import StepCase, StepSettings, simulate_train_step

    settings = StepSettings(**planned(res, args, True, impl)["settings"])
    cfg = model_config(True, args.layers)
    case = StepCase(cfg, 3 * args.step, P, layers=args.layers)
    return simulate_train_step(case, settings, world_size=P)["peak"]


if __name__ == "__main__":
    raise SystemExit(main())
