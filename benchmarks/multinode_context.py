"""Two nodes of 8 x 80 GiB GPUs: SP inside a node x DP across nodes, against UPipe inside a node x a ring across.

The paper's 16-GPU rows ("8u2r": Ulysses/UPipe over the 8 GPUs of a node, ring attention over the 2 nodes):
Llama3-8B reaches 8M tokens with UPipe (6M with USP-Hybrid), Qwen3-32B 4M (Ulysses 2M). For each model,
`hf_upipe.plan(..., gpus=8, nodes=2, max_context=True)` with the planner choosing the settings:

- "SP 8 x DP 2": `ring_size=1`, SP over one node, data parallel across the two (each node its own sequence);
- "SP 16 = UPipe 8 x ring 2": `ring_size=2` (`init_sequence_parallel(16, ring_size=2)`).

Same stack as `benchmarks/max_context.py` (FSDP2 over all 16 GPUs, fp32 master weights, bf16 compute, AdamW,
checkpointing with offload, tiled MLP and loss where the planner takes them); required = tensor peak + 10% + 2 GiB
within 95% of the GPU. Also the predicted step time (`hf_upipe.planning.step_time`: a model, not a measurement) at
the longest length, and the required memory at the paper's UPipe maximum.

    python benchmarks/multinode_context.py [--out benchmarks/results]

Writes <out>/multinode_context.json and prints a markdown table.
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

from hf_upipe.planning.planner import Margin, plan  # noqa: E402
from hf_upipe.units import format_tokens  # noqa: E402

GiB, M = 2**30, 2**20
# the paper's 16 x H100 maxima (../shared/reference/upipe-method.md section 3)
PAPER = {
    "llama3-8b": {"UPipe 8u2r": 8 * M, "USP-Hybrid 8u2r": 6 * M},
    "qwen3-32b-shape": {"UPipe 8u2r": 4 * M, "Ulysses 8u2r": 2 * M, "Ring 1u16r": 2 * M},
}
LAYOUTS = (("SP 8 x DP 2", 1), ("SP 16 = UPipe 8 x ring 2", 2))
# the paper's Qwen3-32B geometry as a Llama (this table's row; the real Qwen3-32B is the preset "qwen3-32b")
GEOMETRIES = {
    "qwen3-32b-shape": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=64,
        vocab_size=151936,
    )
}


def _row(model, label, ring, paper_len):
    t0 = time.perf_counter()
    flat = Margin()  # the flat margin this table was made with (docs/planner.md: predicted-reserve lengths beside)
    spec = GEOMETRIES.get(model, model)
    best = plan(spec, gpus=8, nodes=2, max_context=True, ring_size=ring, margin=flat)
    at_paper = plan(spec, gpus=8, nodes=2, seq_len=paper_len, ring_size=ring, margin=flat)
    return {
        "model": model,
        "layout": label,
        "ring_size": ring,
        "sp_size": best.sp_size,
        "max_seq_len": best.max_seq_len,
        "settings": best.to_dict()["settings"],
        "required_gib": best.required / GiB,
        "predicted_tokens_per_s_per_gpu": best.step_time.tokens_per_s_per_gpu,
        "paper_len": paper_len,
        "required_at_paper_len_gib": at_paper.required / GiB,
        "fits_at_paper_len": at_paper.fits,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="llama3-8b,qwen3-32b-shape")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    started, rows = time.perf_counter(), []
    for model in args.models.split(","):
        paper_len = PAPER[model]["UPipe 8u2r"]
        for label, ring in LAYOUTS:
            rows.append(_row(model, label, ring, paper_len))
            print(
                f"{model} {label}: {format_tokens(rows[-1]['max_seq_len'])} ({rows[-1]['seconds']:.0f} s)",
                flush=True,
            )
    print(
        "\n| model | layout | longest that fits | planner's settings there | predicted tokens/s/GPU | "
        "required GiB at the paper's UPipe max | paper (16 x H100) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["settings"]
        chosen = (
            f"c={s['heads_per_chunk'] or 'all'}, {s['fused_backward']}"
            + (", overlap" if s["overlap"] else "")
            + (", tiled MLP" if s["tiled_mlp"] else "")
            + (", offload" if s["offload"] == "cpu" else "")
        )
        paper = ", ".join(f"{k} {format_tokens(v)}" for k, v in PAPER[r["model"]].items())
        print(
            f"| {r['model']} | {r['layout']} | {format_tokens(r['max_seq_len'])} | {chosen} | "
            f"{r['predicted_tokens_per_s_per_gpu']:.1f} | {r['required_at_paper_len_gib']:.1f} at "
            f"{format_tokens(r['paper_len'])} ({'fits' if r['fits_at_paper_len'] else 'does not fit'}) | "
            f"{paper} |"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "multinode_context.json")
    with open(path, "w") as f:
        json.dump(
            {
                "command": "python benchmarks/multinode_context.py "
                + " ".join(argv or sys.argv[1:]),
                "rows": rows,
                "paper": PAPER,
                "wall_time_s": time.perf_counter() - started,
            },
            f,
            indent=1,
        )
    print(f"\nwrote {path}; total wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
