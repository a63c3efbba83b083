"""Roofline count of the tiled loss (`hf_upipe.ops.tiled_loss`) and the plain HF path on an H100: why 2.4x.

    python benchmarks/tiled_loss_roofline.py [--tokens 16K,32K] [--vocab 128256] [--hidden 4096]
                                             [--chunk-tokens 524] [--out benchmarks/results]

A count, not a measurement: every CUDA kernel that forward + backward launches (bf16 hidden [T, Dm] and lm_head
[V, Dm], both trainable, 10% of labels ignored as in `benchmarks/tiled_loss.py`), with the FLOPs it does and the
bytes it moves to and from HBM (each operand read once, each result written once: no L2 reuse across kernels; a
[c, V] fp32 chunk is 268 MB at c = 524, five times the H100's 50 MB L2). A kernel takes

    max(FLOPs / (800 TFLOP/s x wave efficiency), bytes / 3.0 TB/s)

and the kernels of one stream add up. 800 TFLOP/s and 3.0 TB/s are what this workplace measured on its H100
(an 8192^3 bf16 product, a device-to-device copy). Wave efficiency (second column, "waves"): a GEMM's output
is cut into 128 x 256 tiles, one per SM at a time on 132 SMs; tiles / (132 x waves) of the machine works. This
is the usual cuBLAS/CUTLASS Hopper tile; cuBLAS may pick others (or split K), so the count is given with and
without it. Launch cost (about 4 us of host time per kernel) is hidden while the GPU is busier than that; the
count of launches is printed as a check.

Three paths:
- plain: `F.linear(h, w).float()` then `F.cross_entropy(reduction="sum")`, as `benchmarks/tiled_loss.py`.
- tiled_before: the chunk loop as the 2026-11-23 H100 run measured it (logits cast to fp32, softmax in place in
  five passes, ignored rows zeroed on [c, V], gradient cast to bf16, the chunk's d weight into a bf16 [V, Dm]
  partial, then added to the fp32 accumulator by 32 MiB row blocks: 18 bytes per weight element per chunk).
- tiled_after_fallback: the same where torch's cuBLAS GEMM refuses an fp32 accumulator (`_fused_accumulate`
  False): each chunk's d weight in bf16 row blocks added into fp32 (12 bytes per weight element per chunk).
- tiled_after: the loop now in `hf_upipe/ops/tiled_loss.py` (CUDA): row max on the bf16 logits, shift and cast
  in one kernel, exp, sum, the normalised gradient written straight into the bf16 logits' storage, ignored rows
  zeroed on the thin [c, Dm] side, and the chunk's d weight accumulated in fp32 inside the GEMM (cuBLAS with an
  fp32 output and beta = 1: read and write 4 + 4 bytes per weight element, overlapped with the GEMM's math).

Writes <out>/tiled_loss_roofline.json (per path and length: the kernels' totals by kind, the predicted time and
ratio to plain, beside the H100's measured times from benchmarks/results/gpu/speed_run1.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

FLOPS = 800e12  # bf16 dense, this workplace's H100 (8192^3 product: 798 TFLOP/s)
BW = 3.0e12  # bytes/s, HBM3, read + write counted (device-to-device copy: about 3.0 TB/s)
SMS, TILE_M, TILE_N = 132, 128, 256
LAUNCH_S = 4e-6
IGNORED = 0.1  # benchmarks/tiled_loss.py: labels[:, ::10] = -100
BLOCK_BYTES = 32 * 2**20  # hf_upipe.ops.tiled_loss._BLOCK_BYTES
MEASURED = {  # benchmarks/results/gpu/speed_run1.json, section "loss": median seconds, H100 80GB HBM3
    16384: dict(plain=0.10282502746582031, tiled=0.25433065795898435, chunk=524),
    32768: dict(plain=0.21165711975097656, tiled=0.5008548583984375, chunk=524),
}


def wave_efficiency(m: int, n: int) -> float:
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    return tiles / (SMS * math.ceil(tiles / SMS))


def gemm(name: str, m: int, n: int, k: int, bytes_: float, count: int = 1) -> dict:
    """C[m, n] = A[m, k] @ B[k, n]: 2mnk FLOPs; `bytes_` its operands and result."""
    return dict(
        name=name,
        kind="gemm",
        flops=2.0 * m * n * k,
        bytes=bytes_,
        count=count,
        eff=wave_efficiency(m, n),
    )


def ew(name: str, bytes_: float, count: int = 1, launches: int = 1) -> dict:
    """An elementwise or reduction kernel (bytes only); `launches` per instance."""
    return dict(
        name=name,
        kind="elementwise",
        flops=0.0,
        bytes=bytes_,
        count=count,
        launches=launches,
        eff=1.0,
    )


def small(name: str, launches: int, count: int = 1) -> dict:
    """Kernels over [c] or [c, 1] vectors: nothing but their launches."""
    return dict(
        name=name, kind="small", flops=0.0, bytes=0.0, count=count, launches=launches, eff=1.0
    )


def plain(T: int, V: int, D: int) -> list[dict]:
    TV, VD, TD = T * V, V * D, T * D
    return [
        gemm("logits = h @ w.T (bf16)", T, V, D, 2 * VD + 2 * TD + 2 * TV),
        ew("logits.float()", 2 * TV + 4 * TV),
        ew("log_softmax forward", 4 * TV + 4 * TV),
        small("nll_loss forward", 3),
        ew("nll_loss backward: zeros + scatter", 4 * TV, launches=2),
        ew("log_softmax backward", 4 * TV + 4 * TV + 4 * TV),
        ew("grad.to(bf16)", 4 * TV + 2 * TV),
        gemm("d hidden = g @ w", T, D, V, 2 * TV + 2 * VD + 2 * TD),
        gemm("d weight = g.T @ h", V, D, T, 2 * TV + 2 * TD + 2 * VD),
    ]


def _chunks(T: int, c: int) -> list[int]:
    return [min(c, T - s) for s in range(0, T, c)]


def tiled_before(T: int, V: int, D: int, c: int) -> list[dict]:
    VD, TD = V * D, T * D
    blocks = math.ceil(4 * VD / BLOCK_BYTES)
    out = []
    for i, n in enumerate(_chunks(T, c)):
        nV = n * V
        out += [
            gemm("logits (bf16)", n, V, D, 2 * VD + 2 * n * D + 2 * nV),
            ew("logits.to(fp32)", 2 * nV + 4 * nV),
            small("valid, target, gather", 5),
            ew("row max", 4 * nV),
            ew("sub_(max)", 8 * nV),
            ew("exp_", 8 * nV),
            ew("sum", 4 * nV),
            small("lse, loss", 6),
            ew("div_(denom)", 8 * nV),
            ew("mul_(valid) on [c, V]", 8 * nV),
            small("scatter_add one-hot", 3),
            ew("grad.to(bf16)", 4 * nV + 2 * nV),
            gemm("d hidden rows = g @ w", n, D, V, 2 * nV + 2 * VD + 2 * n * D),
            gemm("d weight partial (bf16 [V, Dm])", V, D, n, 2 * nV + 2 * n * D + 2 * VD),
        ]
        if i == 0:
            out.append(ew("accumulator = partial (copy to fp32)", 2 * VD + 4 * VD))
        else:  # _blockwise: buf = partial block (r2 w4), dst += buf (r4 r4 w4), by 32 MiB row blocks
            out.append(ew("accumulator += partial (32 MiB blocks)", 18 * VD, launches=2 * blocks))
    out += [  # backward: _scaled, by 32 MiB blocks through an fp32 buffer
        ew("backward: d weight x g -> bf16 (blocks)", 22 * VD, launches=3 * blocks),
        ew(
            "backward: d hidden x g (blocks)", 20 * TD, launches=3 * math.ceil(4 * TD / BLOCK_BYTES)
        ),
    ]
    return out


def tiled_after(T: int, V: int, D: int, c: int, fused: bool = True) -> list[dict]:
    """`fused`: the fp32-output GEMM accumulates d weight; else the fallback (a torch whose cuBLAS GEMM refuses an
    fp32 accumulator): each chunk's d weight by 32 MiB row blocks in bf16 (written 2), added into fp32 (r2 r4 w4)."""
    VD, TD = V * D, T * D
    blocks = math.ceil(4 * VD / BLOCK_BYTES)
    out = []
    for i, n in enumerate(_chunks(T, c)):
        nV = n * V
        # fp32 out; beta = 1 reads it back (chunk 0: beta = 0)
        accumulate = 4 * VD + (0 if i == 0 else 4 * VD)
        out += [
            gemm("logits (bf16)", n, V, D, 2 * VD + 2 * n * D + 2 * nV),
            small("valid, target, gather", 5),
            ew("row max of the bf16 logits", 2 * nV),
            ew("p = logits - max (bf16 in, fp32 out)", 2 * nV + 4 * nV),
            ew("exp_", 8 * nV),
            ew("sum", 4 * nV),
            small("lse, loss", 6),
            ew("g = p / denom into the bf16 logits", 4 * nV + 2 * nV),
            small("one-hot: gather, sub, scatter", 4),
            ew("x rows of ignored labels zeroed ([c, Dm])", 2 * n * D + 2 * n * D),
            gemm("d hidden rows = g @ w", n, D, V, 2 * nV + 2 * VD + 2 * n * D),
            ew("d hidden rows of ignored labels zeroed", 4 * n * D),
        ]
        if fused:
            name = "d weight += g.T @ x (fp32 out, in the GEMM)"
            out.append(gemm(name, V, D, n, 2 * nV + 2 * n * D + accumulate))
        else:  # row blocks: bf16 GEMM output (w2), then fp32 += bf16 (r2 r4 w4; chunk 0: copy r2 w4)
            out.append(gemm("d weight row blocks (bf16)", V, D, n, 2 * nV + 2 * n * D + 2 * VD))
            add = (6 if i == 0 else 10) * VD
            out.append(ew("accumulator += block (fp32 += bf16)", add, launches=blocks))
    out += [
        ew("backward: d weight x g -> bf16 (one kernel)", 4 * VD + 2 * VD),
        ew("backward: d hidden x g", 2 * TD + 2 * TD),
    ]
    return out


def total(kernels: list[dict], waves: bool = True) -> dict:
    sums = dict(gemm=0.0, elementwise=0.0, small=0.0)
    flops = bytes_ = 0.0
    launches = 0
    for k in kernels:
        eff = k["eff"] if waves else 1.0
        t = max(k["flops"] / (FLOPS * eff), k["bytes"] / BW) * k["count"]
        sums[k["kind"]] += t
        flops += k["flops"] * k["count"]
        bytes_ += k["bytes"] * k["count"]
        launches += k.get("launches", 1) * k["count"]
    seconds = sum(sums.values())
    return dict(
        seconds=seconds, by_kind_s=sums, flops=flops, bytes=bytes_, launches=launches,
        launch_host_s=launches * LAUNCH_S, launch_bound=launches * LAUNCH_S > seconds,
    )  # fmt: skip


def by_name(kernels: list[dict]) -> dict[str, float]:
    """Seconds per kernel name, summed over chunks (wave efficiency included)."""
    out: dict[str, float] = {}
    for k in kernels:
        t = max(k["flops"] / (FLOPS * k["eff"]), k["bytes"] / BW) * k["count"]
        out[k["name"]] = out.get(k["name"], 0.0) + t
    return out


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def count(T: int, V: int, D: int, c_before: int, c_after: int) -> dict:
    paths = dict(
        plain=plain(T, V, D),
        tiled_before=tiled_before(T, V, D, c_before),
        tiled_after=tiled_after(T, V, D, c_after),
        tiled_after_fallback=tiled_after(T, V, D, c_after, fused=False),
    )
    row = dict(tokens=T, vocab=V, hidden=D, chunk_before=c_before, chunk_after=c_after)
    for waves in (True, False):
        key = "with_waves" if waves else "no_waves"
        totals = {name: total(k, waves) for name, k in paths.items()}
        base = totals["plain"]["seconds"]
        row[key] = {name: dict(t, ratio=t["seconds"] / base) for name, t in totals.items()}
    row["by_kernel_s"] = {name: by_name(k) for name, k in paths.items()}
    if T in MEASURED:
        m = MEASURED[T]
        row["measured_h100"] = dict(m, ratio=m["tiled"] / m["plain"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="16K,32K")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument(
        "--chunk-before",
        type=int,
        default=524,
        help="the measured run's chunk (256 MiB fp32 logits)",
    )
    ap.add_argument(
        "--chunk-tokens", type=int, default=None, help="the new loop's chunk (default: its default)"
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.chunk_tokens is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from hf_upipe.ops.tiled_loss import default_chunk_tokens

        args.chunk_tokens = default_chunk_tokens(args.vocab)
    rows = [count(parse_len(t), args.vocab, args.hidden, args.chunk_before, args.chunk_tokens)
            for t in args.tokens.split(",") if t.strip()]  # fmt: skip
    print(
        "PREDICTED (a count, not a measurement): H100, 800 TFLOP/s bf16, 3.0 TB/s; forward + backward\n"
    )
    print("| tokens | path | chunk | GEMM ms | elementwise ms | predicted ms | x plain | no-waves x plain | "
          "measured ms (H100) | measured x plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r.get("measured_h100", {})
        for name in ("plain", "tiled_before", "tiled_after", "tiled_after_fallback"):
            t, nw = r["with_waves"][name], r["no_waves"][name]
            chunk = (
                "-"
                if name == "plain"
                else r["chunk_before" if name == "tiled_before" else "chunk_after"]
            )
            meas = {"plain": m.get("plain"), "tiled_before": m.get("tiled")}.get(name)
            mratio = {"plain": 1.0, "tiled_before": m.get("ratio")}.get(name) if m else None
            print(
                f"| {r['tokens'] // 1024}K | {name} | {chunk} | {t['by_kind_s']['gemm'] * 1e3:.1f} | "
                f"{t['by_kind_s']['elementwise'] * 1e3:.1f} | {t['seconds'] * 1e3:.1f} | {t['ratio']:.2f} | "
                f"{nw['ratio']:.2f} | {'-' if meas is None else f'{meas * 1e3:.1f}'} | "
                f"{'-' if mratio is None else f'{mratio:.2f}'} |"
            )
    print("\nlargest terms of the tiled path before the change, at the first length (ms):")
    first = rows[0]["by_kernel_s"]["tiled_before"]
    for name, t in sorted(first.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {t * 1e3:7.1f}  {name}")
    doc = dict(
        command=" ".join(["python"] + sys.argv),
        kind="predicted (roofline count), not measured",
        hardware=dict(flops=FLOPS, bandwidth=BW, sms=SMS, tile=[TILE_M, TILE_N], launch_s=LAUNCH_S),
        ignored_fraction=IGNORED,
        rows=rows,
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tiled_loss_roofline.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
