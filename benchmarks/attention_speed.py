"""Attention-block fwd+bwd wall time on CPU: DeepSpeed Ulysses vs our Ulysses mode vs UPipe (2 gloo ranks).

One transformers LlamaAttention block (q/k/v projections, RoPE, attention, o_proj), built by
`hf_upipe.planning.attention_block.build_attention_block`, forward + backward on each rank's shard of S/2 tokens.
Two spawned gloo ranks with one thread each. Implementations: DeepSpeed 0.19.8 `UlyssesSPAttentionHF` (skipped
with a note if deepspeed is missing), `attn_implementation="upipe"` with heads_per_chunk=None (Ulysses mode),
UPipe with heads_per_chunk=1 and 2, and the fused UPipe block (`hf_upipe.prepare_model`) with heads_per_chunk=1.

    python benchmarks/attention_speed.py [--seq-lens 4096,8192,16384] [--reps 5] [--warmup 1]
        [--hidden 512 --heads 8 --kv-heads 4 --head-dim 64] [--out benchmarks/results] [--only LABEL,...]
    python benchmarks/attention_speed.py --summarize benchmarks/results/attention_speed.json

Method: per sequence length, the blocks are built with the same weights, then `--warmup` untimed rounds are run,
then `--reps` timed rounds. In each round every implementation runs once, round-robin, and the order is
rotated each round. A timing is `dist.barrier(); t0; fwd+bwd; t1; dist.barrier()` on every rank. The reported
time is the max over ranks of t1 - t0. The table shows the median over rounds with the min-max range, and
ratios of medians vs DeepSpeed and vs our Ulysses mode. Below it, the paired ratios: per round, each
implementation's time over DeepSpeed's in the same round, as a median over rounds with a 95% bootstrap interval
(how far the ratio can be trusted on a noisy machine). `--summarize` re-prints both from a run's JSON.
all-to-all bytes are counted by wrapping `torch.distributed.all_to_all_single` in each rank. Both DeepSpeed and
hf_upipe reach it through a module attribute lookup. The count is the sum of input.numel() * element_size() per
rank per fwd+bwd, so it includes the 1/P slice that a rank "sends" to itself.

Writes <out>/attention_speed.json: raw per-rank timings, the command, versions, host info, and output checks
(max |y - y_first_impl| per implementation).

Caveats: CPU timing is noisy. Other load on the machine (check the recorded load average) shifts absolute times
by tens of percent, so compare only implementations within the same run. Differences of a few percent are noise
(see the min-max ranges). On CPU, compute dominates and gloo all-to-all is a small part of the step.
These timings say nothing about H100/NCCL: not overlap, not latency-bound small chunks, not flash-attention
kernels. They show only that chunking adds no large overhead at equal compute, and they give exact all-to-all
volumes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

from hf_upipe.planning.attention_block import BENCHMARK_ROWS  # noqa: E402

MiB = 2**20
CPU_NOTE = (
    "CPU (gloo, fp32, 1 thread per rank) timings say nothing about H100/NCCL: compute dominates here, "
    "and overlap, latency of small chunks and NCCL/flash-attention behaviour must be measured on the GPU."
)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    """One rank: all sequence lengths, warm-up and interleaved timed rounds. Returns plain Python values."""
    import contextlib

    import torch
    import torch.distributed as dist

    import hf_upipe  # noqa: F401  (registers "upipe")
    from hf_upipe.planning.attention_block import (
        UPIPE_IMPLS,
        build_attention_block,
        deepspeed_comm,
        upipe_state,
    )

    torch.set_num_threads(1)
    dtype = getattr(torch, cfg["dtype"])
    group = dist.group.WORLD
    impls = [tuple(x) for x in cfg["impls"]]

    # count all-to-all bytes: both hf_upipe and deepspeed.comm call torch.distributed.all_to_all_single
    counter = {"bytes": 0, "calls": 0}
    original_a2a = dist.all_to_all_single

    def counted_a2a(output, input, *args, **kwargs):
        counter["bytes"] += input.numel() * input.element_size()
        counter["calls"] += 1
        return original_a2a(output, input, *args, **kwargs)

    dist.all_to_all_single = counted_a2a
    ds_ctx = (
        deepspeed_comm()
        if any(impl == "deepspeed" for _, impl, _ in impls)
        else contextlib.nullcontext()
    )
    timings, checks = [], []
    try:
        with ds_ctx:
            for S in cfg["seq_lens"]:
                s = S // world
                blocks = {}
                for label, impl, c in impls:
                    torch.manual_seed(0)  # identical weights for every implementation
                    state = (
                        upipe_state(group, c) if impl in UPIPE_IMPLS else contextlib.nullcontext()
                    )
                    with state:
                        blocks[label] = build_attention_block(
                            impl,
                            cfg["hidden"],
                            cfg["heads"],
                            cfg["kv_heads"],
                            cfg["head_dim"],
                            S,
                            dtype,
                            group,
                        )
                torch.manual_seed(1234 + rank)
                x = torch.randn(1, s, cfg["hidden"], dtype=dtype, requires_grad=True)
                position_ids = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0)
                cos, sin = blocks[impls[0][0]][1](x, position_ids)
                grad_y = torch.randn(1, s, cfg["hidden"], dtype=dtype)
                reference = {}

                def step(label, impl, c):
                    block = blocks[label][0]
                    block.zero_grad(set_to_none=True)
                    x.grad = None
                    state = (
                        upipe_state(group, c) if impl in UPIPE_IMPLS else contextlib.nullcontext()
                    )
                    with state:
                        counter["bytes"] = counter["calls"] = 0
                        dist.barrier()
                        t0 = time.perf_counter()
                        y = block(
                            x,
                            position_embeddings=(cos, sin),
                            attention_mask=None,
                            position_ids=position_ids,
                        )[0]
                        y.backward(grad_y)
                        t1 = time.perf_counter()
                        dist.barrier()
                    return t1 - t0, y.detach(), counter["bytes"], counter["calls"]

                n = len(impls)
                for w in range(cfg["warmup"]):
                    for k in range(n):
                        label, impl, c = impls[(k + w) % n]
                        _, y, _, _ = step(label, impl, c)
                        if w == 0:  # outputs and input gradients must agree across implementations
                            reference.setdefault("y", y)
                            reference.setdefault("dx", x.grad.clone())
                            checks.append(
                                dict(
                                    seq_len=S,
                                    label=label,
                                    max_abs_diff_y=float((y - reference["y"]).abs().max()),
                                    max_abs_diff_dx=float((x.grad - reference["dx"]).abs().max()),
                                )
                            )
                        del y
                for r in range(cfg["reps"]):
                    for k in range(n):
                        pos = (k + r) % n
                        label, impl, c = impls[pos]
                        t, y, nbytes, calls = step(label, impl, c)
                        del y
                        timings.append(
                            dict(
                                seq_len=S,
                                label=label,
                                impl=impl,
                                heads_per_chunk=c,
                                round=r,
                                position=k,
                                seconds=t,
                                a2a_bytes=nbytes,
                                a2a_calls=calls,
                            )
                        )
                blocks.clear()  # this length's blocks go before the next length's are built
                reference.clear()
    finally:
        dist.all_to_all_single = original_a2a
    return dict(rank=rank, timings=timings, checks=checks)


def _host_info() -> dict:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None
            )
    except OSError:
        pass
    return dict(
        nproc=os.cpu_count(),
        usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        cpu_model=cpu_model,
        platform=platform.platform(),
        python=platform.python_version(),
    )


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def summarize(summary: dict, labels: list[str], seq_lens: list[int]) -> list[dict]:
    """Print the table (median (min-max) per implementation, ratios of medians) and return its rows.
    summary: {(S, label): {"times": [...], "a2a_bytes": {...}, "a2a_calls": {...}}}."""
    print(
        "| S | implementation | median s (min-max) | vs DeepSpeed | vs ours Ulysses | all-to-all MiB sent per rank |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for S in seq_lens:
        med = {label: statistics.median(summary[S, label]["times"]) for label in labels}
        for label in labels:
            e = summary[S, label]
            times = e["times"]
            vs_ds = med[label] / med["DeepSpeed Ulysses"] if "DeepSpeed Ulysses" in med else None
            vs_uly = (
                med[label] / med["ours Ulysses"] if "ours Ulysses" in med else None
            )  # None: not run (--only)
            mib = max(e["a2a_bytes"]) / MiB
            calls = max(e["a2a_calls"])
            rows.append(
                dict(
                    seq_len=S,
                    label=label,
                    median_s=med[label],
                    min_s=min(times),
                    max_s=max(times),
                    vs_deepspeed=vs_ds,
                    vs_ours_ulysses=vs_uly,
                    a2a_mib_per_rank=mib,
                    a2a_calls_per_rank=calls,
                    a2a_consistent=len(e["a2a_bytes"]) == 1,
                )
            )
            ds_txt, uly_txt = (f"{v:.2f}" if v is not None else "n/a" for v in (vs_ds, vs_uly))
            print(
                f"| {S} | {label} | {med[label]:.3f} ({min(times):.3f}-{max(times):.3f}) | {ds_txt} "
                f"| {uly_txt} | {mib:.1f} ({calls} calls) |"
            )
    return rows


def print_paired(
    raw: list[dict], labels: list[str], seq_lens: list[int], base: str = "DeepSpeed Ulysses"
) -> None:
    """Per round, each implementation's time over `base`'s in the same round (a paired ratio: both ran back to back
    under the same load); printed: the median over rounds with a 95% bootstrap interval (2000 resamples, seed 0)."""
    t = {(r["seq_len"], r["label"], r["round"]): r["seconds_max_over_ranks"] for r in raw}
    if not any(k[1] == base for k in t):
        return
    print(f"\npaired per-round ratio vs {base}: median [95% bootstrap interval] over rounds")
    for S in seq_lens:
        rounds = sorted({k[2] for k in t if k[0] == S and k[1] == base})
        cells = []
        for label in labels:
            ratios = [t[S, label, r] / t[S, base, r] for r in rounds if (S, label, r) in t]
            if label == base or not ratios:
                continue
            rng = random.Random(0)
            boot = sorted(
                statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000)
            )
            cells.append(
                f"{label} {statistics.median(ratios):.2f} [{boot[49]:.2f}-{boot[1949]:.2f}]"
            )
        print(f"  S={S}: " + "; ".join(cells))


def _per_implementation(raw: list[dict]) -> dict:
    """The raw timings (one record per S, implementation and round) -> `summarize`'s {(S, label): times, bytes,
    calls}."""
    summary = {}
    for r in raw:
        e = summary.setdefault(
            (r["seq_len"], r["label"]), dict(times=[], a2a_bytes=set(), a2a_calls=set())
        )
        e["times"].append(r["seconds_max_over_ranks"])
        e["a2a_bytes"].update(r["a2a_bytes_per_rank"])
        e["a2a_calls"].update(r["a2a_calls_per_rank"])
    return summary


def _summarize_file(path: str) -> int:
    """Re-print the table and the paired ratios of a run's JSON."""
    with open(path) as f:
        meta = json.load(f)
    raw, labels = meta["raw_timings"], [i["label"] for i in meta["implementations"]]
    print(f"{path}: {meta['command']} ({meta['reps']} rounds)")
    summarize(_per_implementation(raw), labels, meta["seq_lens"])
    print_paired(raw, labels, meta["seq_lens"])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seq-lens", default="4096,8192,16384", help="comma list of full sequence lengths S"
    )
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per S (default: %(default)s)")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds per S (default: %(default)s)"
    )
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before the ranks are given up on"
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument(
        "--summarize", metavar="JSON", help="re-print the table and paired ratios of a run's JSON"
    )
    ap.add_argument(
        "--only",
        help="comma list of row labels to run (default: all), e.g. "
        "'DeepSpeed Ulysses,ours Ulysses,UPipe fused save c=1'",
    )
    args = ap.parse_args(argv)
    if args.summarize:
        return _summarize_file(args.summarize)
    start = time.perf_counter()
    world = 2

    import torch
    import transformers

    import hf_upipe
    from hf_upipe.ops.head_layout import valid_heads_per_chunk
    from tests._dist import run_distributed

    seq_lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    bad = [S for S in seq_lens if S % world]
    if bad:
        ap.error(f"sequence lengths {bad} are not divisible by {world} ranks")
    if args.heads * args.head_dim != args.hidden:
        print(f"note: heads * head_dim = {args.heads * args.head_dim} != hidden = {args.hidden}")
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup must be >= 1 (warm-up round 0 also checks outputs)")

    ds_version = None
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed

        ds_version = deepspeed.__version__
    else:
        print(
            "note: deepspeed is not installed, DeepSpeed Ulysses is skipped (pip install 'hf_upipe[bench]')"
        )
    valid = valid_heads_per_chunk(args.heads, args.kv_heads, world)
    only = None if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only or ()) - {label for label, _, _ in BENCHMARK_ROWS})
    if unknown:
        ap.error(
            f"--only: unknown rows {unknown}; the rows are {[label for label, _, _ in BENCHMARK_ROWS]}"
        )
    impls = []
    for label, impl, c in BENCHMARK_ROWS:
        if only is not None and label not in only:
            continue
        if impl == "deepspeed" and ds_version is None:
            continue
        if c is not None and c not in valid:
            print(
                f"note: heads_per_chunk={c} is not valid for {args.heads}/{args.kv_heads} heads on {world} ranks "
                f"(valid: {valid}); skipped"
            )
            continue
        impls.append((label, impl, c))

    cfg = dict(
        seq_lens=seq_lens,
        reps=args.reps,
        warmup=args.warmup,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        impls=impls,
    )
    load_before = _loadavg()
    per_rank = run_distributed(_worker, world, cfg, timeout=args.timeout)
    load_after = _loadavg()

    # max over ranks of each timing; bytes per rank (ranks send equal volumes; keep the max)
    by_key = {}
    for res in per_rank:
        for t in res["timings"]:
            by_key.setdefault((t["seq_len"], t["label"], t["round"]), []).append(t)
    raw = []
    for (S, label, r), ts in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        raw.append(
            dict(
                seq_len=S,
                label=label,
                impl=ts[0]["impl"],
                heads_per_chunk=ts[0]["heads_per_chunk"],
                round=r,
                position=ts[0]["position"],
                seconds_max_over_ranks=max(t["seconds"] for t in ts),
                seconds_per_rank=[t["seconds"] for t in ts],
                a2a_bytes_per_rank=[t["a2a_bytes"] for t in ts],
                a2a_calls_per_rank=[t["a2a_calls"] for t in ts],
            )
        )

    labels = [label for label, _, _ in impls]
    print(
        f"\n### attention block fwd+bwd, 2 gloo ranks x 1 thread: hidden {args.hidden}, {args.heads} q / "
        f"{args.kv_heads} kv heads, head dim {args.head_dim}, {args.dtype}, {args.reps} interleaved rounds "
        f"(+{args.warmup} warm-up); time = max over ranks\n"
    )
    rows = summarize(_per_implementation(raw), labels, seq_lens)
    print_paired(raw, labels, seq_lens)

    checks = per_rank[0]["checks"] + per_rank[1]["checks"]
    worst_y = max(c["max_abs_diff_y"] for c in checks)
    worst_dx = max(c["max_abs_diff_dx"] for c in checks)
    print(
        f"\noutput check (warm-up, vs {labels[0]}, all S and ranks): max |dy| = {worst_y:.2e}, "
        f"max |ddx| = {worst_dx:.2e}"
    )
    print(f"load average before / after: {load_before} / {load_after} on {os.cpu_count()} CPUs")
    print(f"note: {CPU_NOTE}")

    wall = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        geometry=dict(
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
        ),
        world_size=world,
        threads_per_rank=1,
        seq_lens=seq_lens,
        reps=args.reps,
        warmup=args.warmup,
        implementations=[dict(label=lb, impl=i, heads_per_chunk=c) for lb, i, c in impls],
        method=(
            "per S: warm-up rounds, then reps rounds, implementations round-robin with the order rotated each "
            "round; each timing = barrier, perf_counter around fwd+bwd, barrier; reported per timing: max over "
            "ranks; summary: median (min-max) over rounds, ratios of medians. all-to-all bytes: sum of "
            "input.numel()*element_size() over torch.distributed.all_to_all_single calls per rank per fwd+bwd "
            "(includes the slice kept locally)."
        ),
        versions=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            deepspeed=ds_version,
            hf_upipe=hf_upipe.__version__,
        ),
        host=dict(**_host_info(), loadavg_before=load_before, loadavg_after=load_after),
        note=CPU_NOTE,
        summary=rows,
        output_checks=checks,
        raw_timings=raw,
        wall_time_s=round(wall, 2),
    )
    path = os.path.join(args.out, "attention_speed.json")
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"\nwrote {path}")
    print(f"total wall time: {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
