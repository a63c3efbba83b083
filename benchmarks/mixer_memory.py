"""One hybrid mixer layer's memory per rank at real model shapes, simulated (fake tensors, fake process group).

For the mixers of Qwen3-Next-80B-A3B (gated DeltaNet: hidden 2048, 16 key / 32 value heads of 128, convolution 4),
Bamba-9B (Mamba2: hidden 4096, 128 heads of 64, state 128, convolution 4) and LFM2-1.2B (short convolution: hidden
2048, reach 2), bf16, batch 1, P ranks: the exact tensor peak of one forward + backward
(`hf_upipe.planning.mixer_memory.mixer_peak`, checked byte for byte against real gloo runs by
`tests/planning/test_mixer_memory.py`) of
- "shard alone": the class's own forward on one shard (wrong across shards; one rank's share),
- "parallel": installed, all ranks at once (the delta-rule prefix; the short convolution's halo), on the last rank,
- "sequential": installed, rank after rank, on rank 0 (the simulation cannot play a receiving rank).
The kernels are transformers' torch fallbacks (flash-linear-attention and mamba-ssm save other tensors on a GPU).

    python benchmarks/mixer_memory.py [--seq-lens 64K,256K] [--sp 8] [--out benchmarks/results]

Writes <out>/mixer_memory.json and prints a markdown table.
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

GiB = 2**30


def _configs():
    from transformers import BambaConfig, Lfm2Config, Qwen3NextConfig

    return [
        (
            "gated DeltaNet (Qwen3-Next-80B-A3B)",
            Qwen3NextConfig(
                hidden_size=2048,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_conv_kernel_dim=4,
                num_hidden_layers=4,
            ),
            ("parallel", "sequential"),
        ),
        (
            "Mamba2 (Bamba-9B)",
            BambaConfig(
                hidden_size=4096,
                mamba_n_heads=128,
                mamba_d_head=64,
                mamba_d_state=128,
                mamba_n_groups=1,
                mamba_d_conv=4,
                mamba_expand=2,
                num_hidden_layers=4,
            ),
            ("sequential",),
        ),
        (
            "short conv (LFM2-1.2B)",
            Lfm2Config(hidden_size=2048, conv_L_cache=3, num_hidden_layers=4),
            ("parallel",),
        ),
    ]


def main() -> None:
    import torch

    from hf_upipe.planning.mixer_memory import mixer_peak
    from hf_upipe.units import parse_tokens

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", default="64K,256K")
    ap.add_argument("--sp", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    P, start, rows = args.sp, time.time(), []
    for label, config, modes in _configs():
        for text in args.seq_lens.split(","):
            S = parse_tokens(text)
            alone = mixer_peak(config, S, P, P - 1, "alone", dtype=torch.bfloat16)
            row = {"mixer": label, "S": text, "alone": alone}
            for mode in modes:
                row[mode] = mixer_peak(
                    config, S, P, P - 1 if mode == "parallel" else 0, mode, dtype=torch.bfloat16
                )
            rows.append(row)
            print(row, flush=True)
    print(f"\nP = {P}, bf16, batch 1; GiB per rank ({time.time() - start:.0f} s)\n")
    print(
        "| mixer | S | shard alone GiB | parallel GiB (last rank) | extra | sequential GiB (rank 0) | extra |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for mode in ("parallel", "sequential"):
            if mode in r:
                extra = r[mode] - r["alone"]
                cells += [
                    f"{r[mode] / GiB:.3f}",
                    f"{extra / 2**20:+.1f} MiB ({extra / r['alone']:+.1%})",
                ]
            else:
                cells += ["-", "-"]
        print(f"| {r['mixer']} | {r['S']} | {r['alone'] / GiB:.3f} | " + " | ".join(cells) + " |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mixer_memory.json"), "w") as f:
        json.dump(
            {"command": " ".join(sys.argv), "sp": P, "dtype": "bfloat16", "rows": rows}, f, indent=1
        )


if __name__ == "__main__":
    main()
