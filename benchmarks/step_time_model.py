"""The planner's step-time model against the UPipe paper's measured throughputs (Llama3-8B, 8 x H100).

    python benchmarks/step_time_model.py [--out benchmarks/results]

For each length of the paper's table (128K to 3M), `hf_upipe.planning.step_time.step_time` predicts one training
step of Llama3-8B on one node of 8 H100s (SP 8, FSDP2 over 8, every layer checkpointed with offloaded inputs, tiled
MLP and loss) for:
- our Ulysses mode (all local heads in one chunk), the paper's Ulysses baseline;
- the fused UPipe block at one head per rank per stage in save mode: nearest to the paper's UPipe (which keeps the
  attention output and log-sum-exp and recomputes the projections and all-to-alls in the backward; ours also keeps
  each key-value chunk's k and v, so only q is recomputed and re-sent);
- the same with the all-to-alls overlapped (the paper's code has no overlap), and in recompute mode (it also
  recomputes the attention forward: our default, the least memory);
- DeepSpeed's Ulysses (the peer).
It prints predicted tokens/s per GPU and the UPipe/Ulysses throughput ratios beside the paper's, and writes
<out>/step_time_model.json. The model's attention efficiency was fitted to the paper's Ulysses point at 1M (and
only that point); every ratio, and every other absolute figure, is a prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

from hf_upipe.models.presets import resolve  # noqa: E402
from hf_upipe.planning.step_time import (  # noqa: E402
    EFFICIENCY,
    H100_SXM,
    PAPER_ULYSSES_TOKENS_PER_S,
    PAPER_UPIPE_TOKENS_PER_S,
    step_time,
)
from hf_upipe.planning.train_step import StepSettings  # noqa: E402
from hf_upipe.units import format_tokens  # noqa: E402

STACK = dict(tiled_mlp=True, offload="cpu")
PAPERS = "UPipe save c=1 (the paper's UPipe)"
ROWS = (
    ("ours Ulysses", StepSettings("ulysses", None, **STACK)),
    (PAPERS, StepSettings("fused", 1, fused_backward="save", **STACK)),
    (
        "UPipe save c=1 overlap",
        StepSettings("fused", 1, fused_backward="save", overlap=True, **STACK),
    ),
    ("UPipe recompute c=1", StepSettings("fused", 1, **STACK)),
    ("DeepSpeed Ulysses", StepSettings("deepspeed", None, **STACK)),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    _, config = resolve("llama3-8b")
    rows = []
    for S in sorted(PAPER_ULYSSES_TOKENS_PER_S):
        t = {
            label: step_time(config, s, seq_len=S, sp_size=8, world=8, gpus_per_node=8)
            for label, s in ROWS
        }
        base = t["ours Ulysses"].tokens_per_s_per_gpu
        paper = PAPER_UPIPE_TOKENS_PER_S[S] / PAPER_ULYSSES_TOKENS_PER_S[S]
        rows.append(
            {
                "seq_len": S,
                "paper_ulysses": PAPER_ULYSSES_TOKENS_PER_S[S],
                "paper_upipe": PAPER_UPIPE_TOKENS_PER_S[S],
                "paper_ratio": paper,
                "predicted": {k: v.tokens_per_s_per_gpu for k, v in t.items()},
                "ratios": {k: v.tokens_per_s_per_gpu / base for k, v in t.items()},
                "parts": {k: v.parts for k, v in t.items()},
            }
        )
    print(
        f"Llama3-8B, 8 x {H100_SXM.name}, SP 8; tokens/s per GPU (predicted by the model; paper measured)\n"
    )
    print(
        "| S | Ulysses: paper | Ulysses: model | UPipe/Ulysses: paper | model: save c=1 | save c=1 overlap | "
        "recompute c=1 | DeepSpeed/ours Ulysses | save c=1 - paper (points) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["ratios"]
        diff = 100 * (q[PAPERS] - r["paper_ratio"])
        print(
            f"| {format_tokens(r['seq_len'])} | {r['paper_ulysses']:,.0f} | {r['predicted']['ours Ulysses']:,.0f} | "
            f"{r['paper_ratio']:.3f} | {q[PAPERS]:.3f} | "
            f"{q['UPipe save c=1 overlap']:.3f} | {q['UPipe recompute c=1']:.3f} | {q['DeepSpeed Ulysses']:.3f} | "
            f"{diff:+.1f} |"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "step_time_model.json")
    with open(path, "w") as f:
        json.dump(
            {
                "command": " ".join(sys.argv),
                "gpu": H100_SXM.__dict__,
                "efficiency": EFFICIENCY.__dict__,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
