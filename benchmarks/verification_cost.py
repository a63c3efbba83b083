"""What verifying the adapters by behaviour costs `prepare_model` on a transformers release not seen before.

For each fused family (fused attention and, with `UPipeConfig(tiled_mlp=True)`, the tiled MLP/norms) and for
hybrids (their mixers' state passing), in fresh processes on CPU, one thread:
- "recorded": `prepare_model` on a tiny model when the installed source's fingerprint is a recorded one (the fast
  path: no check runs);
- "cold": the same with every recorded fingerprint hidden (as on a new release) and an empty verdict cache: the
  behaviour checks run, once per architecture and adapter;
- "warm": hidden fingerprints again, in a new process, with the verdicts cached on disk by the cold run.
Reported: cold minus recorded (the checks' cost) and warm minus recorded, medians over `--reps` process pairs.
peft and transformers' modeling module are imported before the clock starts (a LoRA user has them loaded).

    python benchmarks/verification_cost.py [--types llama,qwen3,...] [--reps 3] [--out benchmarks/results]

Writes <out>/verification_cost.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

HYBRIDS = ("bamba", "qwen3_next", "lfm2")


def _hide_fingerprints() -> None:
    """Every recorded fingerprint replaced by one no source has: the installed release looks unseen."""
    from hf_upipe.adapters import mixers as mixer_sources
    from hf_upipe.adapters import rope
    from hf_upipe.models import architectures

    none = ("0" * 16,)
    for key, arch in list(architectures.ARCHITECTURES.items()):
        architectures.ARCHITECTURES[key] = architectures.Architecture(
            **{**arch.__dict__, "fused_fingerprints": none, "tiled_fingerprints": none}
        )
    for table in (mixer_sources.MIXERS, mixer_sources.HALO_MIXERS):
        for name in table:
            table[name] = none
    rope.ROPE_FINGERPRINTS = none


def _model(model_type: str):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_upipe.models.presets import tiny_config
    from hf_upipe.models.probe import case_config

    torch.manual_seed(0)
    config = tiny_config(model_type) if model_type in HYBRIDS else case_config(model_type)
    if model_type == "lfm2":
        config.layer_types = ["conv", "full_attention"]
    return AutoModelForCausalLM.from_config(config, attn_implementation="upipe")


def child(model_type: str, hidden: bool) -> dict:
    """One process: `prepare_model` seconds on a tiny model, with the recorded fingerprints or hidden."""
    import peft  # noqa: F401 - loaded before the clock, as for a LoRA user
    import torch

    import hf_upipe

    torch.set_num_threads(1)
    config = hf_upipe.UPipeConfig(tiled_mlp=True)
    hf_upipe.prepare_model(_model(model_type), config)  # imports and first calls, not timed
    from hf_upipe.models import verification

    verification._PROCESS.clear()
    if hidden:
        _hide_fingerprints()
    model = _model(model_type)
    start = time.perf_counter()
    hf_upipe.prepare_model(model, config)
    seconds = time.perf_counter() - start
    ran = {f"{a} {s}": v.how for (a, s), v in verification.verdicts().items()}
    return {"seconds": seconds, "verdicts": ran}


def _spawn(model_type: str, hidden: bool, cache: str) -> dict:
    env = dict(os.environ, HF_UPIPE_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", model_type, "--hidden" if hidden else "--recorded"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(model_type: str, reps: int) -> dict:
    rows = {"recorded": [], "cold": [], "warm": []}
    verdicts = {}
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as cache:
            rows["recorded"].append(_spawn(model_type, False, cache)["seconds"])
            cold = _spawn(model_type, True, cache)
            rows["cold"].append(cold["seconds"])
            verdicts = cold["verdicts"]
            rows["warm"].append(_spawn(model_type, True, cache)["seconds"])
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model_type": model_type,
        "seconds": rows,
        "median": med,
        "verdicts_cold": verdicts,
        "check_cost_s": med["cold"] - med["recorded"],
        "warm_cost_s": med["warm"] - med["recorded"],
    }


def main() -> None:
    from hf_upipe.models.architectures import FUSED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join([a.model_type for a in FUSED] + list(HYBRIDS)))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = parser.parse_args()
    import torch
    import transformers

    results = [measure(t, args.reps) for t in args.types.split(",")]
    report = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "reps": args.reps,
        "results": results,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verification_cost.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"transformers {transformers.__version__}, medians of {args.reps} process pairs, seconds of prepare_model"
    )
    print(
        "| model type | adapters checked | recorded source | unseen, cold cache | unseen, warm cache | check cost |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        m = r["median"]
        checked = ", ".join(
            sorted(k for k, how in r["verdicts_cold"].items() if how in ("behaviour", "failed"))
        )
        print(
            f"| {r['model_type']} | {checked} | {m['recorded']:.3f} | {m['cold']:.3f} | {m['warm']:.3f} | "
            f"{r['check_cost_s']:+.3f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3] == "--hidden")))
    else:
        main()
