"""Per-rank attention-block memory, simulated: DeepSpeed-Ulysses vs our Ulysses mode vs UPipe (registered and fused).

One transformers LlamaAttention block (q/k/v projections, RoPE, attention, o_proj), forward + backward on one
rank's shard, counted exactly with fake tensors on a fake process group (`hf_upipe.planning.attention_block`).
Counts tensor storages only: no kernel workspaces, CUDA allocator rounding or NCCL buffers.

    python benchmarks/attention_memory.py [--seq-lens 128K,1M,3M] [--sp-size 8] [--geometry llama3-8b,qwen3-32b]
                                          [--arch llama]

`--arch` builds another fused family's attention module at the geometry (e.g. olmo2: q/k norms over the whole
projection; phi3: one fused qkv projection); its json and png are written as attention_memory_<arch>.*.

Prints one markdown table per geometry and writes <out>/attention_memory.json (raw bytes, the command line,
versions) and <out>/attention_memory.png. u = one full-width local activation = s * hidden * 2 bytes (bf16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

import transformers  # noqa: E402

import hf_upipe  # noqa: E402,F401  (registers "upipe")
from hf_upipe.ops.head_layout import valid_heads_per_chunk  # noqa: E402
from hf_upipe.planning.attention_block import BENCHMARK_ROWS, simulate_attention_block  # noqa: E402

GiB = 2**30
GEOMETRIES = {  # hidden, q heads, kv heads, head dim
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128),
    "qwen3-32b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128),  # the project issue's shape
}
DEFAULT_SEQ = "128K,256K,512K,1M,2M,3M,4M,5M"


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def fmt_len(n: int) -> str:
    if n % 10**6 == 0:
        return f"{n // 10**6}M"
    return f"{n // 10**3}K" if n % 10**3 == 0 else str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-lens",
        default=DEFAULT_SEQ,
        help="comma list; K = 1000, M = 10**6 (default: %(default)s)",
    )
    ap.add_argument("--sp-size", type=int, default=8)
    ap.add_argument(
        "--geometry", default="llama3-8b,qwen3-32b", help=f"comma list of {sorted(GEOMETRIES)}"
    )
    ap.add_argument(
        "--arch", default="llama", help="the attention module's model_type (a fused family)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    start = time.perf_counter()

    seq_lens = [parse_len(x) for x in args.seq_lens.split(",") if x.strip()]
    geometries = [g.strip() for g in args.geometry.split(",") if g.strip()]
    unknown = [g for g in geometries if g not in GEOMETRIES]
    if unknown:
        ap.error(f"unknown geometry {unknown}; choose from {sorted(GEOMETRIES)}")
    bad = [s for s in seq_lens if s % args.sp_size]
    if bad:
        ap.error(f"sequence lengths {bad} are not divisible by --sp-size {args.sp_size}")
    have_ds = importlib.util.find_spec("deepspeed") is not None
    ds_version = None
    if have_ds:
        import deepspeed

        ds_version = deepspeed.__version__
    else:
        print(
            "note: deepspeed is not installed, the DeepSpeed column is skipped (pip install 'hf_upipe[bench]')"
        )

    records, tables = [], []
    for name in geometries:
        geo = GEOMETRIES[name]
        valid = valid_heads_per_chunk(geo["heads"], geo["kv_heads"], args.sp_size)
        impls = []
        for label, impl, c in BENCHMARK_ROWS:
            if impl == "deepspeed" and not have_ds:
                continue
            if c is not None and c not in valid:
                print(
                    f"note: {name}: heads_per_chunk={c} is not valid on sp_size={args.sp_size} (valid: {valid})"
                )
                continue
            impls.append((label, impl, c))
        rows = {}
        for S in seq_lens:
            for label, impl, c in impls:
                r = simulate_attention_block(
                    impl,
                    **geo,
                    seq_len=S,
                    sp_size=args.sp_size,
                    dtype=torch.bfloat16,
                    heads_per_chunk=c,
                    arch=args.arch,
                )
                rows[S, label] = r
                records.append(
                    dict(
                        geometry=name,
                        **geo,
                        seq_len=S,
                        sp_size=args.sp_size,
                        impl=impl,
                        label=label,
                        heads_per_chunk=c,
                        forward_peak_bytes=r["forward_peak"],
                        peak_bytes=r["peak"],
                        peak_with_grad_in_bytes=r["peak_with_grad_in"],
                        unit_bytes=r["unit"],
                    )
                )
        tables.append((name, geo, impls, rows))

    for name, geo, impls, rows in tables:
        print(
            f"\n### {name} ({args.arch} attention): "
            f"hidden {geo['hidden']}, {geo['heads']} q / {geo['kv_heads']} kv heads, head dim "
            f"{geo['head_dim']}, bf16, P = {args.sp_size}; per-rank peaks (u = s*hidden*2 B)\n"
        )
        print(
            "| S | implementation | fwd GiB (u) | fwd+bwd GiB (u) | fwd / DS | fwd+bwd / DS "
            "| fwd+bwd / DS, grad-in counted | fwd+bwd / ours-Ulysses |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for S in seq_lens:
            ds, uly = rows.get((S, "DeepSpeed Ulysses")), rows[S, "ours Ulysses"]
            for label, _, _ in impls:
                r = rows[S, label]

                def ratio(key, ref, r=r):
                    return f"{r[key] / ref[key]:.2f}" if ref else "n/a"

                def gib(key, r=r):
                    return f"{r[key] / GiB:.2f} ({r[key] / r['unit']:.2f})"

                print(
                    f"| {fmt_len(S)} | {label} | {gib('forward_peak')} | {gib('peak')} | {ratio('forward_peak', ds)} "
                    f"| {ratio('peak', ds)} | {ratio('peak_with_grad_in', ds)} | {ratio('peak', uly)} |"
                )

    os.makedirs(args.out, exist_ok=True)
    wall = time.perf_counter() - start
    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        sp_size=args.sp_size,
        arch=args.arch,
        dtype="bfloat16",
        seq_lens=seq_lens,
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            deepspeed=ds_version,
            hf_upipe=hf_upipe.__version__,
        ),
        method="fake tensors + fake process group, MemoryTracker (tensor storages; rank 0)",
        results=records,
        wall_time_s=round(wall, 2),
    )
    stem = "attention_memory" if args.arch == "llama" else f"attention_memory_{args.arch}"
    json_path = os.path.join(args.out, f"{stem}.json")
    with open(json_path, "w") as f:
        json.dump(meta, f, indent=1)
    png_path = os.path.join(args.out, f"{stem}.png")
    plot(tables, seq_lens, args.sp_size, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    print(f"total wall time: {time.perf_counter() - start:.1f} s")
    return 0


def plot(tables, seq_lens, sp_size, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6.5 * len(tables), 4.8), squeeze=False)
    xs = [S / 10**6 for S in seq_lens]
    for ax, (name, geo, impls, rows) in zip(axes[0], tables):
        for i, (label, _, _) in enumerate(impls):
            color = f"C{i}"
            ax.plot(
                xs,
                [rows[S, label]["peak"] / GiB for S in seq_lens],
                "-o",
                color=color,
                ms=3,
                label=f"{label} fwd+bwd",
            )
            ax.plot(
                xs,
                [rows[S, label]["forward_peak"] / GiB for S in seq_lens],
                "--",
                color=color,
                label=f"{label} fwd",
            )
        ax.set_title(
            f"{name} ({geo['heads']}q/{geo['kv_heads']}kv, d={geo['head_dim']}), P={sp_size}"
        )
        ax.set_xlabel("sequence length S (M tokens)")
        ax.set_ylabel("per-rank peak, attention block (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Attention block fwd+bwd (solid) and forward (dashed) peak per rank, bf16, simulated"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
