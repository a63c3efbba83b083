"""One hybrid mixer layer under sequence parallelism on CPU: its time and its extra memory per rank.

For each mixer kind (Mamba2: Bamba's mixer; gated DeltaNet: Qwen3-Next's; short convolution: LFM2's), the mixer
module of `hf_upipe.models.presets.tiny_config(model_type)` (widened by `--hidden`) after `hf_upipe.prepare_model`,
forward
+ backward on a sequence of S tokens, on 2 gloo ranks with one thread each:
- "SP 2": the installed `sharded_mixer_forward` on each rank's shard of S/2 tokens (gated DeltaNet: all ranks at
  once, a prefix over their gathered states; Mamba2: state passed rank to rank, the sequential fallback of the
  design; the short convolution exchanges a halo, in parallel);
- "SP 2 sequential" (gated DeltaNet only): the same mixer installed with state_passing="sequential";
- "shard alone": the class's own forward on the same shard without SP (wrong across shards: the parallel ideal of
  one rank's work);
- "one process": the class's own forward on all S tokens in one process (the other rank idles).
A time is `barrier; t0; fwd+bwd; t1; barrier` per rank, the slowest rank's; medians over `--reps` rounds after one
warm-up, the three interleaved. Memory: the exact tensor peak of the same fwd+bwd (`MemoryTracker`, the input and
the incoming gradient not counted) under SP minus the shard alone's, per rank, at every S: the mixer's extra
memory, which should not grow with S (what it receives and sends has no sequence axis, or k-1 tokens).

    python benchmarks/mixer_layer.py [--seq-lens 2048,8192] [--reps 5] [--hidden 256] [--out benchmarks/results]
        [--kinds bamba,qwen3_next,lfm2]

Writes <out>/mixer_layer.json and prints a markdown table. CPU timings are noisy; compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

KINDS = (
    ("Mamba2 (bamba)", "bamba", "linear_attention"),
    ("gated DeltaNet (qwen3_next)", "qwen3_next", "linear_attention"),
    ("short conv (lfm2)", "lfm2", "conv"),
)


def _mixer(model_type: str, layer_type: str, hidden: int):
    """The installed mixer module of a prepared tiny 2-layer model of this type (a mixer layer, then attention),
    widened to `hidden`."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_upipe
    from hf_upipe.adapters import mixers
    from hf_upipe.models.presets import tiny_config

    config = tiny_config(model_type)
    config.num_hidden_layers = 2
    try:
        config.layer_types = [layer_type, "full_attention"]
    except AttributeError:  # Bamba: layer_types is a property of attn_layer_indices
        config.attn_layer_indices = [1]
    scale = hidden // config.hidden_size
    config.hidden_size = hidden
    for name in (
        "intermediate_size",
        "linear_num_value_heads",
        "linear_num_key_heads",
        "mamba_n_heads",
    ):
        if getattr(config, name, None):
            setattr(config, name, getattr(config, name) * scale)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    hf_upipe.prepare_model(model)
    return model, next(m for m in model.modules() if mixers.is_installed(m)), config


def _worker(
    rank: int,
    world: int,
    model_type: str,
    layer_type: str,
    hidden: int,
    lengths: list[int],
    reps: int,
) -> dict:
    import torch
    import torch.distributed as dist

    import hf_upipe
    from hf_upipe.adapters import mixers
    from hf_upipe.adapters.delta_rule import DELTA_KERNELS
    from hf_upipe.planning.tracker import MemoryTracker

    torch.set_num_threads(1)
    hf_upipe.init_sequence_parallel(world)
    model, mixer, config = _mixer(model_type, layer_type, hidden)
    sp_modes = ("sp", "sp_seq") if type(mixer).__name__ in DELTA_KERNELS else ("sp",)

    def set_passing(mode):  # outside the timed call
        if mode in sp_modes:
            mixers.install_mixers(
                model, state_passing="sequential" if mode == "sp_seq" else "parallel"
            )

    def run(mode, x, dy):
        own = type(mixer).forward
        out = mixer(x) if mode in sp_modes else own(mixer, x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)

    result = {
        "config": {
            k: getattr(config, k, None)
            for k in (
                "hidden_size",
                "mamba_n_heads",
                "mamba_d_head",
                "mamba_d_state",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "conv_L_cache",
                "mamba_d_conv",
                "linear_conv_kernel_dim",
            )
        }
    }
    for S in lengths:
        s = S // world
        gen = torch.Generator().manual_seed(11)
        full = torch.randn(1, S, hidden, generator=gen)
        dfull = torch.randn(1, S, hidden, generator=gen)
        shard = full[:, rank * s : (rank + 1) * s].clone().requires_grad_()
        dshard = dfull[:, rank * s : (rank + 1) * s].clone()
        full.requires_grad_()
        inputs = {
            **{m: (shard, dshard) for m in sp_modes},
            "alone": (shard, dshard),
            "one": (full, dfull),
        }
        peaks = {}
        for mode in (*sp_modes, "alone"):
            set_passing(mode)
            with MemoryTracker() as tracker:
                run(mode, *inputs[mode])
            peaks[mode] = tracker.peak_bytes
        times = {mode: [] for mode in inputs}
        n = len(inputs)
        for r in range(reps + 1):
            for k in range(n):
                mode = list(inputs)[(k + r) % n]
                set_passing(mode)
                dist.barrier()
                t0 = time.perf_counter()
                if mode != "one" or rank == 0:
                    run(mode, *inputs[mode])
                t1 = time.perf_counter()
                dist.barrier()
                if r:
                    times[mode].append(t1 - t0)
        result[S] = {"peaks": peaks, "times": times}
    hf_upipe.reset_sequence_parallel()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", default="2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--kinds", default=",".join(k[1] for k in KINDS), help="model types of the mixers to run"
    )
    args = ap.parse_args()
    from hf_upipe.tools.testing import run_distributed

    lengths = [int(v) for v in args.seq_lens.split(",")]
    rows, raw = [], {}
    start = time.time()
    for label, model_type, layer_type in KINDS:
        if model_type not in args.kinds.split(","):
            continue
        ranks = run_distributed(
            _worker, 2, model_type, layer_type, args.hidden, lengths, args.reps, timeout=3000
        )
        raw[model_type] = ranks
        for S in lengths:
            times = ranks[0][S]["times"]
            med = {
                m: statistics.median(max(a, b) for a, b in zip(times[m], ranks[1][S]["times"][m]))
                for m in times
            }
            for mode, how in (
                ("sp", "parallel" if "sp_seq" in times else None),
                ("sp_seq", "sequential"),
            ):
                if mode in times:
                    peaks = [
                        (ranks[r][S]["peaks"][mode], ranks[r][S]["peaks"]["alone"]) for r in (0, 1)
                    ]
                    rows.append(
                        (
                            f"{label}{f', {how}' if how else ''}",
                            S,
                            med[mode],
                            med["alone"],
                            med["one"],
                            peaks,
                        )
                    )
    print(
        "| mixer | S | SP 2 fwd+bwd s | shard alone s | one process s | SP 2 / shard alone | SP 2 / one process "
        "| peak MiB, shard alone | SP 2 extra MiB: rank 0, rank 1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, S, sp, alone, one, peaks in rows:
        extra = ", ".join(f"{(a - b) / 2**20:+.2f} ({(a - b) / b:+.0%})" for a, b in peaks)
        print(
            f"| {label} | {S} | {sp:.3f} | {alone:.3f} | {one:.3f} | {sp / alone:.2f} | {sp / one:.2f} | "
            f"{peaks[0][1] / 2**20:.2f} | {extra} |"
        )
    print(f"({time.time() - start:.0f} s)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mixer_layer.json"), "w") as f:
        json.dump(
            {
                "command": " ".join(sys.argv),
                "hidden": args.hidden,
                "reps": args.reps,
                "rows": [
                    dict(
                        zip(
                            ("mixer", "S", "sp_s", "alone_s", "one_s", "peaks_sp_alone_per_rank"), r
                        )
                    )
                    for r in rows
                ],
                "raw": {
                    k: [{str(kk): vv for kk, vv in rank.items()} for rank in v]
                    for k, v in raw.items()
                },
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
