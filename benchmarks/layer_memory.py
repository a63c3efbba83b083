"""Per-rank memory of a training step: one Llama3-8B decoder layer, and the whole 32-layer model's activations.

Simulated exactly with fake tensors on a fake process group (`hf_upipe.planning.model_step`), rank 0 of P=8, bf16.
Implementations: DeepSpeed's Ulysses (`UlyssesSPAttentionHF` around sdpa, the peer), our Ulysses mode (all local
heads in one chunk), UPipe registered (heads_per_chunk=1) and UPipe fused (`prepare_model`). Every one gets the
same stack around its attention, so only attention differs:

- layer table: one decoder layer, forward + backward, with and without the tiled MLP (+ tiled RMSNorm); its
  input and incoming gradient are not counted (as in the attention-block benchmark);
- model table: a full step of the 32-layer model (embeddings, activation checkpointing of every layer, tiled loss)
  with (a) checkpointing only, (b) + tiled MLP, (c) + tiled MLP + layer inputs offloaded to host memory (the last
  layer's kept on the device, each copied back when its layer's backward needs it). Parameters, and persistent
  gradients and optimizer states, are not activations and not counted (each weight gradient is dropped once
  accumulated, as FSDP2 does after its reduce-scatter); transient ones are.

    python benchmarks/layer_memory.py [--seq-lens 128K,...,5M] [--model-seq-lens 3M] [--layers 32]

Writes <out>/layer_memory.json and <out>/layer_memory.png and prints markdown tables. Counts tensor storages only
(no kernel workspaces, allocator rounding or NCCL buffers).
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

import hf_upipe  # noqa: E402,F401
from hf_upipe.planning.activation_step import simulate_layer_step, simulate_model_step  # noqa: E402
from hf_upipe.planning.model_step import StepCase, StepSettings, llama_config  # noqa: E402

GiB = 2**30
IMPLS = (
    ("DeepSpeed Ulysses", "deepspeed"),
    ("ours Ulysses", "ulysses"),
    ("UPipe c=1", "upipe"),
    ("UPipe fused c=1", "fused"),
)
STACKS = (
    ("checkpointing", dict(tiled_mlp=False, offload="none")),
    ("+ tiled MLP", dict(tiled_mlp=True, offload="none")),
    ("+ tiled MLP + offload", dict(tiled_mlp=True, offload="cpu")),
)


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def fmt_len(n: int) -> str:
    return f"{n / 10**6:g}M" if n >= 10**6 else f"{n // 10**3}K"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-lens", default="128K,512K,1M,2M,3M,4M,5M", help="layer table lengths (K=1e3, M=1e6)"
    )
    ap.add_argument("--model-seq-lens", default="3M", help="model table lengths")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sp-size", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cfg = llama_config("llama3-8b")
    impls = [
        (label, impl)
        for label, impl in IMPLS
        if impl != "deepspeed" or importlib.util.find_spec("deepspeed")
    ]
    if len(impls) < len(IMPLS):
        print(
            "note: deepspeed is not installed; its rows are skipped (pip install 'hf_upipe[bench]')"
        )
    layer_lens = [parse_len(x) for x in args.seq_lens.split(",") if x.strip()]
    model_lens = [parse_len(x) for x in args.model_seq_lens.split(",") if x.strip()]
    records = []

    print(f"### One Llama3-8B decoder layer, fwd+bwd, per-rank peak GiB (P={args.sp_size}, bf16)\n")
    print("| implementation | MLP | " + " | ".join(fmt_len(S) for S in layer_lens) + " |")
    print("|---|---|" + "---|" * len(layer_lens))
    layer = {}
    for label, impl in impls:
        for tiled in (False, True):
            cells = []
            for S in layer_lens:
                r = simulate_layer_step(
                    StepCase(cfg, S, args.sp_size, layers=1),
                    StepSettings(impl, 1, tiled_mlp=tiled, offload="none"),
                )
                layer[label, tiled, S] = r
                records.append(
                    dict(
                        table="layer",
                        label=label,
                        impl=impl,
                        tiled_mlp=tiled,
                        offload="none",
                        seq_len=S,
                        layers=1,
                        forward_peak_bytes=r["forward_peak"],
                        peak_bytes=r["peak"],
                        unit_bytes=r["unit"],
                    )
                )
                cells.append(f"{r['peak'] / GiB:.1f}")
            print(
                f"| {label} | {'tiled' if tiled else 'plain'} | " + " | ".join(cells) + " |",
                flush=True,
            )

    model = {}
    for S in model_lens:
        print(
            f"\n### Whole {args.layers}-layer Llama3-8B step at {fmt_len(S)} tokens: per-rank activation peak GiB "
            f"(ratio to DeepSpeed with the same stack)\n"
        )
        print("| implementation | " + " | ".join(name for name, _ in STACKS) + " |")
        print("|---|" + "---|" * len(STACKS))
        for label, impl in impls:
            cells = []
            for name, stack in STACKS:
                t0 = time.perf_counter()
                r = simulate_model_step(
                    StepCase(cfg, S, args.sp_size, layers=args.layers),
                    StepSettings(impl, 1, **stack),
                )
                model[label, name, S] = r
                records.append(
                    dict(
                        table="model",
                        label=label,
                        impl=impl,
                        stack=name,
                        seq_len=S,
                        layers=args.layers,
                        forward_peak_bytes=r["forward_peak"],
                        peak_bytes=r["peak"],
                        unit_bytes=r["unit"],
                        sim_seconds=round(time.perf_counter() - t0, 1),
                        **stack,
                    )
                )
                ds = model.get(("DeepSpeed Ulysses", name, S))
                ratio = f" ({r['peak'] / ds['peak']:.2f}x)" if ds and impl != "deepspeed" else ""
                cells.append(f"{r['peak'] / GiB:.1f}{ratio}")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)

    os.makedirs(args.out, exist_ok=True)
    ds_version = None
    if importlib.util.find_spec("deepspeed"):
        import deepspeed

        ds_version = deepspeed.__version__
    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        sp_size=args.sp_size,
        model="llama3-8b",
        config=cfg,
        dtype="bfloat16",
        results=records,
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            deepspeed=ds_version,
            hf_upipe=hf_upipe.__version__,
        ),
        method="fake tensors + fake process group, MemoryTracker (tensor storages; rank 0)",
        wall_time_s=round(time.perf_counter() - start, 1),
    )
    with open(os.path.join(args.out, "layer_memory.json"), "w") as f:
        json.dump(meta, f, indent=1)
    plot(
        layer,
        model,
        impls,
        layer_lens,
        model_lens,
        args,
        os.path.join(args.out, "layer_memory.png"),
    )
    print(
        f"\nwrote {args.out}/layer_memory.json and layer_memory.png; total {time.perf_counter() - start:.0f} s"
    )
    return 0


def plot(layer, model, impls, layer_lens, model_lens, args, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = [S / 10**6 for S in layer_lens]
    for i, (label, _) in enumerate(impls):
        ax.plot(
            xs,
            [layer[label, True, S]["peak"] / GiB for S in layer_lens],
            "-o",
            ms=3,
            color=f"C{i}",
            label=f"{label}, tiled MLP",
        )
        ax.plot(
            xs,
            [layer[label, False, S]["peak"] / GiB for S in layer_lens],
            ":",
            color=f"C{i}",
            label=f"{label}, plain MLP",
        )
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (M tokens)")
    ax.set_ylabel("per-rank peak, one decoder layer fwd+bwd (GiB)")
    ax.set_title(f"Llama3-8B decoder layer, P={args.sp_size}, bf16")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    S = model_lens[-1]
    width = 0.8 / len(impls)
    for i, (label, _) in enumerate(impls):
        vals = [model[label, name, S]["peak"] / GiB for name, _ in STACKS]
        bx.bar([j + i * width for j in range(len(STACKS))], vals, width, color=f"C{i}", label=label)
    bx.set_xticks(
        [j + width * (len(impls) - 1) / 2 for j in range(len(STACKS))], [n for n, _ in STACKS]
    )
    bx.set_ylabel("per-rank activation peak, whole step (GiB)")
    bx.set_title(f"{args.layers}-layer Llama3-8B step at {fmt_len(S)} tokens, P={args.sp_size}")
    bx.grid(alpha=0.3, axis="y")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
