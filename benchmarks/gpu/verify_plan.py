"""The planner's answers that `benchmarks/gpu/verify.py` checks on a GPU, computed on CPU and carried with it.

    python benchmarks/gpu/verify_plan.py [--out benchmarks/gpu/verify_plan.json] [--cpu-dry-run]

A `hf_upipe.plan` of Llama3-8B on 8 GPUs takes minutes of CPU, time a GPU lease should not spend, so the plans are
made here and read there. For each GPU memory (80 GiB: H100; 141 GB: H200) and each implementation ("upipe": the
planner's default ladder; "ulysses": our Ulysses mode) at 32 layers: the planner's `--max` with its default
settings, and its prediction (tensor peak, predicted reserve, allowance, required) at `--max` and one step (128K)
above. For stage (e): predictions of the 4-layer step at 256K with model offload "none" and "cpu".

The file records `planning_digest`, a hash of hf_upipe/planning/*.py and hf_upipe/models/presets.py when it was made:
`verify.py` records whether the code it runs still has that digest (`plan_current`), so a stale plan is visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from max_context_step import model_config  # noqa: E402

P, STEP = 8, 2**17
GPUS = {"80GiB": "H100 80GB", "141GB": "H200 141GB"}
IMPLS = {"upipe": None, "ulysses": "ulysses"}
OFFLOAD_LEN = 2**18  # stage (e): 4 layers at 256K


def planning_digest() -> str:
    """sha256 of the planner's sources (hf_upipe/planning/*.py, hf_upipe/models/presets.py), in name order."""
    h = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(ROOT, "hf_upipe", "planning", "*.py")))
    for path in files + [os.path.join(ROOT, "hf_upipe", "models", "presets.py")]:
        h.update(os.path.relpath(path, ROOT).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def prediction(cfg: dict, gpu_memory: str, seq_len: int, settings) -> dict:
    from hf_upipe.planning.planner import plan

    p = plan(cfg, gpus=P, gpu_memory=gpu_memory, seq_len=seq_len, settings=settings)
    return dict(
        seq_len=seq_len, tensor_peak=p.tensor_peak, predicted_reserved=p.predicted_reserved,
        allowance=p.allowance, required=p.required, fits=p.fits, allocator=p.allocator,
    )  # fmt: skip


def max_plan(dry: bool, layers: int, gpu_memory: str, impl: str) -> dict:
    from hf_upipe.planning.planner import plan

    step = 1024 if dry else STEP
    extra = {"max_seq_len": 8 * step} if dry else {}
    cfg = model_config(dry, layers)
    t0 = time.perf_counter()
    p = plan(
        cfg, gpus=P, gpu_memory=gpu_memory, max_context=True, impl=IMPLS[impl], step=step, **extra
    )
    row = dict(
        impl=impl, layers=layers, gpu_memory=gpu_memory, step=step, max_seq_len=p.max_seq_len,
        settings=dataclasses.asdict(p.settings), allocator=p.allocator, seconds=round(time.perf_counter() - t0, 1),
    )  # fmt: skip
    if p.max_seq_len:
        row["at_max"] = prediction(cfg, gpu_memory, p.max_seq_len, p.settings)
        row["above_max"] = prediction(cfg, gpu_memory, p.max_seq_len + step, p.settings)
    return row


def offload_pair(dry: bool, gpu_memory: str, settings: dict) -> dict:
    """Stage (e): the 4-layer step at 256K (dry: 2 layers at 2K) with model offload "none" and "cpu"."""
    from hf_upipe.planning.train_step import StepSettings, device_twin

    layers, seq_len = (2, 2048) if dry else (4, OFFLOAD_LEN)
    cfg = model_config(dry, layers)
    out = dict(layers=layers, seq_len=seq_len)
    for mode in ("none", "cpu"):
        s = device_twin(StepSettings(**dict(settings, model_offload=mode)))
        out[mode] = dict(settings=dataclasses.asdict(s), **prediction(cfg, gpu_memory, seq_len, s))
    return out


def make(dry: bool, gpu_memories=None, impls=None) -> dict:
    doc = dict(
        planning_digest=planning_digest(), command=" ".join(["python"] + sys.argv), dry=dry,
        made=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), gpus=P, plans={}, offload={},
    )  # fmt: skip
    layers = 2 if dry else 32
    for gpu_memory in gpu_memories or GPUS:
        for impl in impls or IMPLS:
            row = max_plan(dry, layers, gpu_memory, impl)
            doc["plans"][f"{impl}@{layers}@{gpu_memory}"] = row
            print(
                f"{impl} {gpu_memory}: --max {row['max_seq_len']} ({row['seconds']} s)", flush=True
            )
        upipe = doc["plans"].get(f"upipe@{layers}@{gpu_memory}")
        if upipe:
            doc["offload"][gpu_memory] = offload_pair(dry, gpu_memory, upipe["settings"])
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(HERE, "verify_plan.json"))
    ap.add_argument("--cpu-dry-run", action="store_true", help="toy model, 2 layers (seconds)")
    args = ap.parse_args(argv)
    doc = make(args.cpu_dry_run)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
