"""The planner over every model type hf_upipe verified: does `hf_upipe.plan` plan it (the model's own code on fake
tensors: windows, MoE experts, multimodal towers, hybrids), or refuse it with its reason?

    python benchmarks/planner_reach.py [--gpus 8] [--seq-len 16384] [--out benchmarks/results]

Each type is its tiny config (`hf_upipe.models.presets.runnable_config`); writes <out>/planner_reach.json and prints a
summary and the refusals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = ap.parse_args()

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_upipe.models.architectures import ARCHITECTURES
    from hf_upipe.models.presets import runnable_config
    from hf_upipe.planning.planner import plan

    # every verified causal-LM type (multimodal ones planned for text; their text configs are built inside them)
    types = sorted(
        t
        for t in ARCHITECTURES
        if ARCHITECTURES[t].verified and t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    start, results = time.time(), {}
    for model_type in types:
        t0 = time.time()
        try:
            result = plan(runnable_config(model_type)[1], gpus=args.gpus, seq_len=args.seq_len)
            row = {"planned": True, "fits": result.fits, "required": result.required}
        except ValueError as err:
            row = {"planned": False, "why": str(err)}
        row["seconds"] = round(time.time() - t0, 1)
        results[model_type] = row
        print(model_type, row, flush=True)
    planned = sum(r["planned"] for r in results.values())
    summary = {
        "types": len(results),
        "planned": planned,
        "refused": len(results) - planned,
        "wall_s": round(time.time() - start, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "planner_reach.json")
    with open(path, "w") as f:
        json.dump(
            {"command": " ".join(sys.argv), "summary": summary, "results": results}, f, indent=1
        )
    print(json.dumps(summary))
    for model_type, row in results.items():
        if not row["planned"]:
            print(f"- {model_type}: {row['why'][:200]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
