"""Two stages of `benchmarks/gpu/verify.py` that no older script runs, each in its own process.

    python benchmarks/gpu/verify_stages.py loss_exactness --out FILE [--cpu-dry-run]
    python benchmarks/gpu/verify_stages.py allocator_and_offload --out FILE --pair JSON [--cpu-dry-run]

- `loss_exactness`: the tiled loss (`hf_upipe.ops.tiled_loss`) and the plain HF path in bf16 against an fp32
  reference on the same (bf16-rounded) inputs, at vocab 128256, hidden 4096, 4096 tokens (10% ignored): the
  largest error of the loss, d hidden and d weight of each, and which d weight accumulation ran (`fused`: cuBLAS
  with an fp32 output, `_fused_accumulate`). Passes when every tiled error is at most twice the plain one (plus
  1e-6 of the largest reference entry).
- `allocator_and_offload`: the allocator mode the launch line sets, as a trainer arranges it before CUDA starts
  (`hf_upipe.allocator.arrange_allocator(launch_mode())`: `PYTORCH_CUDA_ALLOC_CONF`, and whether the
  allocator's segments are expandable once CUDA runs); then the 4-layer step at 256K with model offload "none"
  and "cpu" (FSDP2's host offload of parameter shards, gradients and AdamW states), each in a fresh process
  (`max_context_step.py`, hollow attention), beside `verify_plan.json`'s predictions for both.
Each writes its JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(
    os.path.dirname(HERE)
)  # benchmarks/ (tiled_loss.py: the two loss paths), after gpu/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402


def _errors(got: list, ref: list) -> list[float]:
    return [float((g.double() - r.double()).abs().max()) for g, r in zip(got, ref)]


def _loss_and_grads(fn, hidden, weight, labels, dtype):
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss = fn(h, w, labels)
    loss.backward()
    return [loss.detach(), h.grad, w.grad]


def loss_exactness(dry: bool) -> dict:
    import tiled_loss as bench  # benchmarks/tiled_loss.py

    from hf_upipe.ops import tiled_loss

    device = torch.device("cpu" if dry else "cuda")
    tokens, vocab, hidden_size = (256, 512, 64) if dry else (4096, 128256, 4096)
    with torch.device(device):
        h, w, labels = bench.make_inputs(tokens, vocab, hidden_size)  # bf16, 10% ignored
    chunk = tiled_loss.default_chunk_tokens(vocab)
    ref = _loss_and_grads(bench.plain_loss, h, w, labels, torch.float32)
    plain = _loss_and_grads(bench.plain_loss, h, w, labels, torch.bfloat16)
    tiled = _loss_and_grads(
        lambda a, b, y: bench.tiled_loss(a, b, y, chunk), h, w, labels, torch.bfloat16
    )
    names = ("loss", "d hidden", "d weight")
    e_plain, e_tiled = _errors(plain, ref), _errors(tiled, ref)
    floor = [1e-6 * float(r.abs().max()) for r in ref]
    rows = {
        n: dict(plain=p, tiled=t, ok=t <= 2 * p + f)
        for n, p, t, f in zip(names, e_plain, e_tiled, floor)
    }
    fused = tiled_loss._fused_accumulate(torch.empty(1, device=device))
    return dict(
        tokens=tokens, vocab=vocab, hidden=hidden_size, chunk_tokens=chunk, fused_accumulate=fused,
        max_abs_error=rows, passed=all(r["ok"] for r in rows.values()),
    )  # fmt: skip


def allocator_mode(dry: bool) -> dict:
    """Arrange the allocator as a trainer does, then read what is in force."""
    from hf_upipe.allocator import arrange_allocator, launch_mode

    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    mode = arrange_allocator(launch_mode())
    out = dict(
        conf_before=before, launch_mode=launch_mode(), arranged=mode,
        conf_after=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )  # fmt: skip
    if dry or not torch.cuda.is_available():
        return dict(out, segments="no CUDA allocator here")
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    segments = torch.cuda.memory._snapshot().get("segments", [])
    flags = sorted({str(s.get("is_expandable", "absent")) for s in segments})
    out.update(segments=len(segments), is_expandable=flags, reserved=torch.cuda.memory_reserved())
    try:
        out["backend"] = torch.cuda.memory.get_allocator_backend()
    except (AttributeError, RuntimeError):
        out["backend"] = "unknown"
    del x
    return out


def model_offload(dry: bool, pair: dict, timeout: int) -> dict:
    """The 4-layer step (dry: 1 layer at 1K) with model offload "none" and "cpu", each in a fresh process."""
    from max_context import run_child
    from max_context_step import child

    layers, seq_len = (1, 1024) if dry else (pair["layers"], pair["seq_len"])
    out = dict(layers=layers, seq_len=seq_len)
    for mode in ("none", "cpu"):
        spec = dict(
            dry=dry, settings=pair[mode]["settings"], seq_len=seq_len, layers=layers, hollow=True,
            warmup_len=256 if dry else 2**16, host_offload="shared",
        )  # fmt: skip
        row = child(spec) if dry else run_child(spec, timeout)
        row["settings"] = spec["settings"]
        row["predicted"] = {k: v for k, v in pair[mode].items() if k != "settings"}
        out[mode] = row
    if all("max_allocated" in out[m] for m in ("none", "cpu")):
        out["saving_measured"] = out["none"]["max_allocated"] - out["cpu"]["max_allocated"]
        out["saving_predicted"] = (
            pair["none"]["tensor_peak"] - pair["cpu"]["tensor_peak"] if not dry else None
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=("loss_exactness", "allocator_and_offload"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--pair", default="{}", help="verify_plan.json's offload rows for this GPU")
    ap.add_argument("--child-timeout", type=int, default=25)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.what == "loss_exactness":
        result = loss_exactness(args.cpu_dry_run)
    else:
        result = dict(allocator=allocator_mode(args.cpu_dry_run))
        with open(
            args.out, "w"
        ) as f:  # the allocator's answer first: the steps below may be cut off
            json.dump(result, f, indent=1, default=str)
        pair = json.loads(args.pair)
        if pair:
            result["model_offload"] = model_offload(args.cpu_dry_run, pair, args.child_timeout)
        else:
            result["model_offload"] = "no carried plan for this GPU"
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str)[:2000])
    return 0 if result.get("passed", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
