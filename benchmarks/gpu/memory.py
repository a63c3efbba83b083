"""GPU memory of rank 0 of 8, for real: the planner's predictions against the CUDA allocator.

    python benchmarks/gpu/memory.py [--lengths 256K,512K,1M] [--full-length 256K] [--block-lengths 512K,1M]
                                    [--out benchmarks/results/gpu] [--quick] [--cpu-dry-run]

Rank 0 of a fake 8-rank process group (`hf_upipe.planning.simulate.simulated_world`) on real CUDA tensors: the
kernels, the allocator and the offload's pinned buffers are real; the collectives only shape their outputs (the
fake group copies the input into the output on recent torch: see kernels.json's fake_pg), so the per-GPU memory
is what one of 8 GPUs holds, without NCCL's own buffers. Llama3-8B geometry (`hf_upipe.models.presets.PRESETS`), bf16.

Sections (written into <out>/memory.json as each finishes):
1. block: one attention block (`hf_upipe.planning.attention_block.measure_attention_block`) for DeepSpeed's
   Ulysses (when importable), our Ulysses mode, UPipe c=1 and the fused block in both backward modes: the tensor
   peak tracked on the GPU, the same simulated on fake CPU tensors (must be equal), `max_memory_allocated` and
   `max_memory_reserved` of the block's forward + backward.
2. step: one FSDP2 training step as the planner models it (`hf_upipe.planning.train_step.measure_train_step`:
   AdamW states, checkpointing on every layer with inputs offloaded to pinned host memory, tiled MLP and loss, the
   fused block c=1) with 4 decoder layers at --lengths, and the whole 32-layer model at --full-length: tracked
   tensor peak, simulated peak (for 32 layers: `hf_upipe.plan`'s extrapolation from 3 and 4 layers), and the
   allocator's absolute peaks.
3. calibration: the planner's margin fitted to these runs (`hf_upipe.planning.planner.Margin`): the allocator's
   overhead over the tensor peak as a fraction, and the bytes outside the allocator (CUDA context, cuBLAS
   workspaces) measured on this device; then each run's predicted peak (simulated tensors x (1 + fraction)) against
   its `max_memory_reserved`.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    GiB,
    PeakMemory,
    Results,
    deepspeed_importable,
    fake_rank,
    llama3_8b,
    parse,
    parse_len,
    parser,
    sync,
)

import hf_upipe  # noqa: E402,F401
from hf_upipe.ops.tiled_backward import backward_block  # noqa: E402
from hf_upipe.planning.attention_block import (  # noqa: E402
    BENCHMARK_ROWS,
    measure_attention_block,
    simulate_attention_block,
)
from hf_upipe.planning.train_step import (  # noqa: E402
    StepCase,
    StepSettings,
    measure_train_step,
    simulate_train_step,
)

P = 8
SETTINGS = StepSettings("fused", 1, tiled_mlp=True, offload="cpu")


def block(res: Results, device, lengths: list[int], dry: bool) -> None:
    cfg = llama3_8b(dry)
    geo = dict(
        hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
    )
    have_ds = deepspeed_importable()
    rows = []
    for S in lengths:
        for label, impl, c in BENCHMARK_ROWS:
            if impl == "deepspeed" and not have_ds:
                continue
            row = dict(label=label, impl=impl, heads_per_chunk=c, seq_len=S, sp_size=P)
            try:
                sim = simulate_attention_block(impl, **geo, seq_len=S, sp_size=P, heads_per_chunk=c)
                with fake_rank(P, device) as world:
                    if impl != "deepspeed":
                        hf_upipe.init_sequence_parallel(group=world, heads_per_chunk=c)
                    try:
                        with PeakMemory(device) as peak:
                            real = measure_attention_block(
                                impl,
                                **geo,
                                seq_len=S,
                                sp_size=P,
                                dtype=torch.bfloat16,
                                group=world,
                                heads_per_chunk=c,
                            )
                    finally:
                        hf_upipe.reset_sequence_parallel()
                row.update(
                    simulated_peak=sim["peak"],
                    tracked_peak=real["peak"],
                    tracked_forward=real["forward_peak"],
                    unit=real["unit"],
                    **peak.to_dict(),
                )
                row["tracked_equals_simulated"] = real["peak"] == sim["peak"]
            except Exception as err:  # noqa: BLE001
                row.update(res.error(f"block {label} {S}", err))
            rows.append(row)
            print(
                "block",
                {
                    k: (round(v / GiB, 3) if isinstance(v, int) and v > 2**20 else v)
                    for k, v in row.items()
                },
                flush=True,
            )
            res.put("block", rows)


def _mesh(device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (P,))


def step_row(res: Results, device, cfg: dict, S: int, layers: int, predicted: dict) -> dict:
    row = dict(
        seq_len=S, layers=layers, sp_size=P, world=P, settings=SETTINGS.__dict__.copy(), **predicted
    )
    try:
        with fake_rank(P, device):
            mesh = _mesh(device)
            peak = PeakMemory(device)
            t0 = time.perf_counter()
            case = StepCase(cfg, S, P, layers)
            real = measure_train_step(case, SETTINGS, mesh=mesh, around_step=peak)
            sync(device)
            row["step_wall_s"] = round(time.perf_counter() - t0, 2)
        row.update(
            tracked_peak=real["peak"], tracked_by_category=real["by_category"], **peak.to_dict()
        )
        row["max_allocated_total_bytes"] = peak.base_allocated + peak.allocated
    except Exception as err:  # noqa: BLE001
        row.update(res.error(f"step {layers} layers {S}", err))
    finally:
        gc.collect()  # the last row's model and optimizer: not on the next row's books
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def step(res: Results, device, lengths: list[int], full_length: int | None, dry: bool) -> None:
    from hf_upipe.planning.planner import plan

    cfg, rows = llama3_8b(dry), []

    def four_layers(S):
        sim = simulate_train_step(StepCase(cfg, S, P, layers=4), SETTINGS, world_size=P)
        rows.append(
            step_row(
                res,
                device,
                cfg,
                S,
                4,
                {"simulated_peak": sim["peak"], "simulated_by_category": sim["by_category"]},
            )
        )
        print("step", rows[-1], flush=True)
        res.put("step", rows)

    four_layers(lengths[0])
    if full_length:  # before the longer 4-layer steps, which take the most time
        p = plan(cfg, gpus=P, gpu_memory="80GiB", seq_len=full_length, settings=SETTINGS)
        rows.append(
            step_row(
                res,
                device,
                cfg,
                full_length,
                cfg["num_hidden_layers"],
                {
                    "simulated_peak": p.tensor_peak,
                    "simulated_by_category": dict(p.by_category),
                    "planner_required_default_margin": p.required,
                },
            )
        )
        print("step", rows[-1], flush=True)
        res.put("step", rows)
    for S in lengths[1:]:
        four_layers(S)


def context_bytes(device) -> int:
    """Device memory in use outside the caching allocator: CUDA context, cuBLAS/cuDNN handles and workspaces."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def calibration(res: Results, device) -> None:
    """The margin fraction from the whole-step rows (what the planner plans); the block rows are shown beside."""
    from hf_upipe.planning.planner import Margin

    steps = [r for r in res.doc["sections"].get("step", []) if r.get("max_reserved_total_bytes")]
    blocks = [r for r in res.doc["sections"].get("block", []) if r.get("max_reserved_total_bytes")]
    if not steps:
        res.put("calibration", {"note": "no GPU step rows to calibrate from"})
        return
    # a step's tensor peak counts its parameters and optimizer states (allocated before the step), a block's does
    # not count its weights and input: add what was allocated on entry
    counted = {
        id(r): r["simulated_peak"] + (0 if r in steps else r["allocated_on_entry_bytes"])
        for r in steps + blocks
    }
    fraction = max(r["max_reserved_total_bytes"] / counted[id(r)] - 1 for r in steps)
    fraction = math.ceil(max(fraction, 0.0) * 200) / 200  # up to the next 0.5%
    default = Margin()
    table = []
    for r in steps + blocks:
        c, reserved = counted[id(r)], r["max_reserved_total_bytes"]
        table.append(
            dict(
                what=f"step {r['layers']} layers" if r in steps else f"block {r['label']}",
                seq_len=r["seq_len"],
                counted=c,
                max_allocated=r["max_allocated_bytes"] + r["allocated_on_entry_bytes"],
                max_reserved=reserved,
                predicted_calibrated=int(c * (1 + fraction)),
                error_calibrated=(c * (1 + fraction) - reserved) / reserved,
                predicted_default=int(c * (1 + default.fraction)),
                error_default=(c * (1 + default.fraction) - reserved) / reserved,
            )
        )
    res.put(
        "calibration",
        {
            "fraction": fraction,
            "context_bytes": context_bytes(device),
            "default_fraction": default.fraction,
            "default_reserved_bytes": default.reserved,
            "rows": table,
            "steps_within_5_percent": all(
                abs(t["error_calibrated"]) <= 0.05 for t in table if t["what"].startswith("step")
            ),
        },
    )
    for t in table:
        print("calibration", t, flush=True)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--lengths", default="256K,512K,1M", help="4-layer step lengths (K = 1024)")
    ap.add_argument("--full-length", default="256K", help="the 32-layer step's length ('' to skip)")
    ap.add_argument("--block-lengths", default="512K,1M")
    ap.add_argument("--sections", default="block,step,calibration")
    args, device = parse(ap, argv)
    dry = args.cpu_dry_run
    lengths = [parse_len(x) for x in args.lengths.split(",") if x.strip()]
    block_lengths = [parse_len(x) for x in args.block_lengths.split(",") if x.strip()]
    full = parse_len(args.full_length) if args.full_length.strip() else None
    if dry:
        lengths, block_lengths, full = [8192, 16384], [8192], 8192
    elif args.quick:
        lengths, block_lengths = lengths[:2], block_lengths[:1]
    res = Results(os.path.join(args.out, "memory.json"), device)
    res.doc["environment"]["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", ""
    )
    # the attention backward's tile (hf_upipe.ops.tiled_backward): the blocks' unseen bytes are per token of a tile
    res.doc["environment"]["UPIPE_BACKWARD_BLOCK"] = backward_block()
    sections = args.sections.split(",")
    start = time.perf_counter()
    if "block" in sections:
        block(res, device, block_lengths, dry)
    if "step" in sections:
        step(res, device, lengths, full, dry)
    if "calibration" in sections:
        calibration(res, device)
    res.doc["wall_time_s"] = round(time.perf_counter() - start, 1)
    res.write()
    print(
        f"\nmemory: errors: {len(res.doc['errors'])}; wrote {res.path} ({res.doc['wall_time_s']} s)"
    )
    return 1 if res.doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
