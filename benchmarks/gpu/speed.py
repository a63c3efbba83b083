"""GPU speed of one rank's compute: a Llama3-8B decoder layer per implementation, and the tiled loss.

    python benchmarks/gpu/speed.py [--lengths 128K,256K,512K] [--reps 3] [--loss-tokens 16K,32K,64K]
                                   [--out benchmarks/results/gpu] [--quick] [--cpu-dry-run]

Sections (written into <out>/speed.json as each finishes):
0. backends: forward + backward of one rank's attention (4 heads over S, D = 128, bf16) through torch SDPA with
   each backend forced (and its default choice), and through each of hf_upipe's kernels usable here.
1. layer: forward + backward of one Llama3-8B decoder layer (no checkpointing) as rank 0 of a fake 8-rank group on
   real CUDA tensors: this rank's s = S/8 tokens through the projections and MLP, and its H/8 = 4 query heads over
   the whole S in attention. DeepSpeed's Ulysses (when importable), our Ulysses mode, UPipe c=1 (registered),
   and the fused block c=1 with its backward recomputing or saving each stage's attention; ours with the "sdpa"
   kernel (torch's flash kernel) and, where usable, the "cudnn" kernel. COMPUTE ONLY: under the
   fake group the all-to-alls do no communication (they copy locally), so NVLink time is not in these numbers.
   Median of --reps interleaved rounds (the order rotates every round) after one warm-up each, CUDA events.
2. loss: the tiled lm_head + cross-entropy (`hf_upipe.ops.tiled_loss`) against the plain HF path (bf16 logits,
   `.float()`, cross_entropy) at vocab 128256, hidden 4096, forward + backward, median of --reps interleaved runs
   with their `max_memory_allocated`. A path that does not fit the GPU is recorded as out of memory.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PeakMemory,
    Results,
    cuda_times,
    deepspeed_importable,
    fake_rank,
    llama3_8b,
    median,
    parse,
    parse_len,
    parser,
    sync,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tiled_loss as loss_bench  # noqa: E402  (benchmarks/tiled_loss.py: the two loss paths)

import hf_upipe  # noqa: E402,F401
from hf_upipe.planning.model_step import (  # noqa: E402
    StepCase,
    StepSettings,
    build_step_model,
    impl_context,
)

P = 8
VARIANTS = (  # (label, impl of build_step_model, heads_per_chunk, fused_backward, kernel: None = "auto")
    ("DeepSpeed Ulysses", "deepspeed", None, "recompute", None),
    ("ours Ulysses", "ulysses", None, "recompute", "sdpa"),
    ("UPipe c=1", "upipe", 1, "recompute", "sdpa"),
    ("UPipe fused c=1 (recompute)", "fused", 1, "recompute", "sdpa"),
    ("UPipe fused c=1 (save)", "fused", 1, "save", "sdpa"),
    ("ours Ulysses [cudnn]", "ulysses", None, "recompute", "cudnn"),
    ("UPipe c=1 [cudnn]", "upipe", 1, "recompute", "cudnn"),
    ("UPipe fused c=1 (recompute) [cudnn]", "fused", 1, "recompute", "cudnn"),
    ("UPipe fused c=1 (save) [cudnn]", "fused", 1, "save", "cudnn"),
)


@contextlib.contextmanager
def prefer_kernel(name):
    """Make `name` the kernel "auto" picks (None: leave the registry alone)."""
    from hf_upipe.ops import kernels

    if name is None:
        yield
        return
    entry = kernels._REGISTRY[name]
    kernels.register_kernel(name, entry[0], entry[1], priority=-1)
    try:
        yield
    finally:
        kernels.register_kernel(name, *entry)


def backends(res: Results, device, lengths: list[int], dry: bool) -> None:
    """fwd+bwd of one rank's attention (4 heads over S, D = 128): torch SDPA per backend and our kernels."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hf_upipe.ops.kernels import available_kernels, get_kernel

    rows = []
    h, D = 4, (16 if dry else 128)
    for S in lengths:
        q, k, v = (
            torch.randn(1, h, S, D, dtype=torch.bfloat16, device=device, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, h, S, D, dtype=torch.bfloat16, device=device)

        def sdpa_run(backend):
            def run():
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            return run

        cases = [("torch sdpa (default choice)", sdpa_run(None))]
        if device.type == "cuda":
            cases += [
                (f"torch sdpa {b.name}", sdpa_run(b))
                for b in (
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION,
                )
            ]
        for name in available_kernels(device, torch.bfloat16):
            kern = get_kernel(name, device, torch.bfloat16)
            qs, ks, vs, gs = (
                t.detach().transpose(1, 2) for t in (q, k, v, grad)
            )  # [1, S, h, D] views

            def kernel_run(kern=kern, qs=qs, ks=ks, vs=vs, gs=gs):
                out, lse = kern.forward(qs, ks, vs, scale=D**-0.5)
                kern.backward(gs, qs, ks, vs, out, lse, scale=D**-0.5)

            cases.append((f"hf_upipe kernel {name}", kernel_run))
        for label, run in cases:
            row = dict(seq_len=S, heads=h, head_dim=D, case=label)
            try:
                times = cuda_times(run, device, warmup=1, reps=3)
                row.update(times_s=times, median_s=median(times))
            except Exception as err:  # noqa: BLE001
                row.update(res.error(f"backends {label} {S}", err))
            rows.append(row)
            print("backends", row, flush=True)
            res.put("backends", rows)


def _layer_run(impl, c, mode, cfg, S, world, device):
    """A callable running forward + backward of one decoder layer of `impl` on this rank's shard."""
    s = S // P
    model = build_step_model(
        StepCase(cfg, S, P, layers=1),
        StepSettings(impl, c, tiled_mlp=False, fused_backward=mode),
        world,
        dtype=torch.bfloat16,
        checkpointing=False,
    )
    layer = model.model.layers[0]
    x = (torch.randn(1, s, cfg["hidden_size"], dtype=torch.bfloat16) * 0.5).requires_grad_()
    positions = torch.arange(s).unsqueeze(0)  # rank 0: global positions 0 .. s-1
    cos, sin = model.model.rotary_emb(x, positions)
    grad = torch.randn_like(x)

    def run():
        y = layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        y = y[0] if isinstance(y, tuple) else y  # [1, s, hidden]
        y.backward(grad)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    return run


def layer(res: Results, device, lengths: list[int], reps: int, dry: bool) -> None:
    cfg = llama3_8b(dry)
    from hf_upipe.ops.kernels import available_kernels

    usable = available_kernels(device, torch.bfloat16)
    variants = [
        v
        for v in VARIANTS
        if (v[1] != "deepspeed" or deepspeed_importable()) and (v[4] is None or v[4] in usable)
    ]
    rows = []
    for S in lengths:
        times = {label: [] for label, *_ in variants}
        errors = {}
        for r in range(reps + 1):  # round 0: warm-up
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for label, impl, c, mode, kernel in order:
                if label in errors:
                    continue
                try:
                    with (
                        fake_rank(P, device) as world,
                        prefer_kernel(kernel),
                        impl_context(impl, world, S, P, c),
                    ):
                        run = _layer_run(impl, c, mode, cfg, S, world, device)
                        t = cuda_times(run, device, warmup=0, reps=1)[0]
                        del run
                    if r > 0:
                        times[label].append(t)
                except Exception as err:  # noqa: BLE001
                    errors[label] = res.error(f"layer {label} {S}", err)["error"]
                finally:
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        ref = median(times["ours Ulysses"]) if times.get("ours Ulysses") else None
        ds = median(times["DeepSpeed Ulysses"]) if times.get("DeepSpeed Ulysses") else None
        for label, impl, c, mode, kernel in variants:
            row = dict(seq_len=S, label=label, kernel=kernel or "auto", times_s=times[label])
            if label in errors:
                row["error"] = errors[label]
            elif times[label]:
                m = median(times[label])
                row.update(
                    median_s=m,
                    vs_ours_ulysses=m / ref if ref else None,
                    vs_deepspeed=m / ds if ds else None,
                )
            rows.append(row)
            print("layer", row, flush=True)
        res.put("layer", rows)


def loss(res: Results, device, tokens: list[int], reps: int, dry: bool) -> None:
    vocab, hidden = (4096, 256) if dry else (128256, 4096)
    rows = []
    for T in tokens:
        chunk = loss_bench.default_chunk_tokens(vocab)
        with torch.device(device):
            h, w, labels = loss_bench.make_inputs(T, vocab, hidden)
        row = dict(tokens=T, vocab=vocab, hidden=hidden, chunk_tokens=chunk)
        times = {"plain": [], "tiled": []}
        peaks = {}
        for i in range(reps + 1):
            for path in ("plain", "tiled") if i % 2 == 0 else ("tiled", "plain"):
                if f"{path}_error" in row:
                    continue
                h.grad = w.grad = None
                try:
                    with PeakMemory(device) as peak:
                        t = cuda_times(
                            lambda p=path, h=h, w=w, y=labels: loss_bench.run_path(
                                p, h, w, y, chunk
                            ),
                            device,
                            warmup=0,
                            reps=1,
                        )[0]
                    peaks[path] = peak.allocated
                    if i > 0:
                        times[path].append(t)
                except torch.OutOfMemoryError as err:
                    row[f"{path}_error"] = f"out of memory: {str(err)[:300]}"
                    h.grad = w.grad = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        for path in ("plain", "tiled"):
            row[f"{path}_times_s"] = times[path]
            if times[path]:
                row[f"{path}_median_s"] = median(times[path])
                row[f"{path}_max_allocated_bytes"] = peaks[path]
        if times["plain"] and times["tiled"]:
            row["tiled_over_plain"] = row["tiled_median_s"] / row["plain_median_s"]
        rows.append(row)
        print("loss", {k: v for k, v in row.items() if not k.endswith("times_s")}, flush=True)
        res.put("loss", rows)
        del h, w, labels
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument(
        "--lengths", default="128K,256K,512K", help="layer rows: full sequence S (K = 1024)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--loss-tokens", default="16K,32K,64K", help="loss rows: local tokens (K = 1024)"
    )
    ap.add_argument("--backend-lengths", default="128K,512K", help="backends rows: S (K = 1024)")
    ap.add_argument("--sections", default="backends,layer,loss")
    args, device = parse(ap, argv)
    lengths = [parse_len(x) for x in args.lengths.split(",") if x.strip()]
    tokens = [parse_len(x) for x in args.loss_tokens.split(",") if x.strip()]
    backend_lengths = [parse_len(x) for x in args.backend_lengths.split(",") if x.strip()]
    if args.cpu_dry_run:
        lengths, tokens, backend_lengths, args.reps = [4096], [1024], [2048], 1
    elif args.quick:
        lengths, args.reps = lengths[:2], 2
    res = Results(os.path.join(args.out, "speed.json"), device)
    start = time.perf_counter()
    if "backends" in args.sections:
        backends(res, device, backend_lengths, args.cpu_dry_run)
    if "layer" in args.sections:
        layer(res, device, lengths, args.reps, args.cpu_dry_run)
    if "loss" in args.sections:
        loss(res, device, tokens, args.reps, args.cpu_dry_run)
    sync(device)
    res.doc["wall_time_s"] = round(time.perf_counter() - start, 1)
    res.write()
    print(
        f"\nspeed: errors: {len(res.doc['errors'])}; wrote {res.path} ({res.doc['wall_time_s']} s)"
    )
    for row in res.doc["sections"].get("layer", []):
        if "median_s" in row:
            print(
                f"| {row['seq_len'] // 1024}K | {row['label']} | {row['median_s'] * 1e3:.1f} ms | "
                f"{row['vs_ours_ulysses'] or float('nan'):.2f} | {row['vs_deepspeed'] or float('nan'):.2f} |"
            )
    return 1 if res.doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
