"""What each memory lever saves, and costs, at the headline lengths `hf-upipe plan` gives with every default.

    python benchmarks/lever_table.py ROW [ROW ...]   # rows: full lora ring h200 qwen1m, each also with :deepspeed
    python benchmarks/lever_table.py --table         # the markdown table from the JSON files written before

For each row the plan with every default (`hf_upipe.plan`, the planner's choice of settings; `--max` except the
Qwen3-8B row, judged at 1M), then at that length the same settings with one lever off at a time: its GiB is the
required per-GPU memory (the allocator's predicted reserve plus the allowance) it saves, its seconds what the
predicted step (`hf_upipe.planning.step_time`) costs with it. Levers (where the plan uses them):
- model offload: FSDP2's host offload of the parameter, gradient and optimizer shards (`model_offload='none'`);
  in the `:deepspeed` rows ZeRO-3's host optimizer (`offload_optimizer: cpu`, CPU Adam), which the peer's plan
  takes by default as ALST's recipe runs it (`hf_upipe.planning.zero3_offload`);
- tiled attention backward: `UPIPE_BACKWARD_BLOCK=0` (one kernel call over the whole sequence);
- expandable segments: the allocator's default segments instead (`allocator='default'`);
- head chunks: all local heads in one chunk (`heads_per_chunk=None`) instead of the plan's chunk;
- tiled MLP: off.
Checkpoints on disk instead of host memory save host memory, not GPU memory: the row gives the disk and host bytes.
`all off` is the step without model offload and the tiled attention backward, and with the checkpoints in host
memory instead of on disk (the head chunks and the tiled MLP kept: they are UPipe's own stack): the headline's
predicted step against it is what those levers cost together. `--retime` recomputes it for the JSON files written
(the step time alone, no simulation).

Writes benchmarks/results/lever_table_<row>.json. A row takes 5 to 20 minutes on a busy 2-core machine (one
`--max` search, then one simulation per lever).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

from hf_upipe.planning import planner as _planner
from hf_upipe.planning.plan_command import LORA_TARGETS
from hf_upipe.planning.step_time import step_time

OUT = pathlib.Path(__file__).parent / "results"
GiB = 2**30

ROWS = {
    "full": dict(model="llama3-8b", gpus=8, gpu_memory="80GiB", max_context=True),
    "lora": dict(
        model="llama3-8b", gpus=8, gpu_memory="80GiB", max_context=True, lora=(16, LORA_TARGETS)
    ),
    "ring": dict(
        model="llama3-8b", gpus=8, nodes=2, ring_size=2, gpu_memory="80GiB", max_context=True
    ),
    "h200": dict(model="llama3-8b", gpus=8, gpu_memory="141GB", max_context=True),
    "qwen1m": dict(model="qwen3-8b", gpus=8, gpu_memory="80GiB", seq_len="1M"),
}

COMMANDS = {
    "full": "hf-upipe plan --model llama3-8b --gpus 8 --gpu-memory 80GiB --max",
    "lora": "hf-upipe plan --model llama3-8b --gpus 8 --gpu-memory 80GiB --max --lora-rank 16",
    "ring": "hf-upipe plan --model llama3-8b --gpus 8 --nodes 2 --ring 2 --gpu-memory 80GiB --max",
    "h200": "hf-upipe plan --model llama3-8b --gpus 8 --gpu-memory 141GB --max",
    "qwen1m": "hf-upipe plan --model qwen3-8b --gpus 8 --gpu-memory 80GiB --seq-len 1M",
}


@contextlib.contextmanager
def _backward_block(value: str | None):
    """UPIPE_BACKWARD_BLOCK set to `value` (None: unset), with the simulation cache emptied on both sides (its key
    does not hold the tile length)."""
    old = os.environ.get("UPIPE_BACKWARD_BLOCK")
    _planner._SIMULATIONS.clear()
    if value is None:
        os.environ.pop("UPIPE_BACKWARD_BLOCK", None)
    else:
        os.environ["UPIPE_BACKWARD_BLOCK"] = value
    try:
        yield
    finally:
        _planner._SIMULATIONS.clear()
        if old is None:
            os.environ.pop("UPIPE_BACKWARD_BLOCK", None)
        else:
            os.environ["UPIPE_BACKWARD_BLOCK"] = old


def _summary(p) -> dict:
    return {
        "seq_len": p.seq_len,
        "fits": p.fits,
        "required_gib": round(p.required / GiB, 2),
        "tensors_gib": round(p.tensor_peak / GiB, 2),
        "reserved_gib": round((p.predicted_reserved or 0) / GiB, 2),
        "allowance_gib": round(p.allowance / GiB, 2),
        "step_s": round(p.step_time.seconds, 1),
        "by_category_gib": {k: round(v / GiB, 2) for k, v in p.by_category.items()},
        "settings": repr(p.settings),
        "host_gib_per_gpu": round(p.host_bytes_per_gpu / GiB, 2),
        "disk_gib_per_gpu": round(p.disk_bytes_per_gpu / GiB, 2),
    }


def _levers(s, impl: str) -> dict:
    """name -> (settings with that lever off, plan keyword overrides, UPIPE_BACKWARD_BLOCK), for levers `s` uses."""
    off = {}
    if s.model_offload == "cpu":
        off["model offload"] = (dataclasses.replace(s, model_offload="none"), {}, None)
    if impl != "deepspeed":
        off["tiled attention backward"] = (s, {}, "0")
    off["expandable segments"] = (s, {"allocator": "default"}, None)
    if s.heads_per_chunk is not None:
        off["head chunks"] = (dataclasses.replace(s, heads_per_chunk=None), {}, None)
    if s.tiled_mlp:
        off["tiled MLP"] = (dataclasses.replace(s, tiled_mlp=False), {}, None)
    return off


def _all_off(s):
    """The headline's settings with every lever of the table off (checkpoints in host memory instead of disk)."""
    return dataclasses.replace(
        s, model_offload="none", offload="cpu" if s.offload == "disk" else s.offload
    )


def _all_off_time(config, settings, seq_len: int, kw: dict) -> dict:
    """The predicted step without the levers (`_all_off`) against the headline's."""
    gpus, nodes = kw["gpus"], kw.get("nodes", 1)
    common = dict(
        seq_len=seq_len,
        sp_size=gpus * kw.get("ring_size", 1),
        world=gpus * nodes,
        gpus_per_node=gpus,
        lora=None if kw.get("lora") is None else (kw["lora"][0], tuple(kw["lora"][1])),
    )
    with _backward_block("0"):  # the step time alone: no simulation needed
        t = step_time(config, _all_off(settings), **common).seconds
    with _backward_block(None):
        h = step_time(config, settings, **common).seconds
    return {
        "step_s": round(t, 1),
        "headline_step_s": round(h, 1),
        "costs_s": round(h - t, 1),
        "costs_share": round(h / t - 1, 4),
        "settings": repr(_all_off(settings)),
    }


def retime() -> None:
    """Recompute `all_off` of every JSON file written (the headline's settings, read back)."""
    from hf_upipe.models import resolve
    from hf_upipe.planning.train_step import StepSettings

    for path in sorted(OUT.glob("lever_table_*.json")):
        r = json.loads(path.read_text())
        row, _, impl = r["row"].partition(":")
        kw = dict(ROWS[row])
        settings = eval(r["headline"]["settings"], {"StepSettings": StepSettings})  # our own repr
        _, config = resolve(kw["model"])
        r["all_off"] = _all_off_time(config, settings, r["headline"]["seq_len"], kw)
        path.write_text(json.dumps(r, indent=1) + "\n")
        print(path.name, r["all_off"])


def run_row(name: str) -> dict:
    import hf_upipe

    row, _, impl = name.partition(":")
    kw = dict(ROWS[row])
    if impl:
        kw["impl"] = impl
    started = time.perf_counter()
    model = kw.pop("model")  # plan's first argument, positional only
    head = hf_upipe.plan(model, **kw)
    fixed = {k: v for k, v in kw.items() if k not in ("max_context", "seq_len")}
    out = {
        "row": name,
        "command": COMMANDS[row] + (f" --impl {impl}" if impl else ""),
        "headline": _summary(head),
        "levers": {},
    }
    base = head.required
    for lever, (settings, extra, block) in _levers(head.settings, impl).items():
        with _backward_block(block):
            p = hf_upipe.plan(model, **fixed, seq_len=head.seq_len, settings=settings, **extra)
        out["levers"][lever] = {
            "saves_gib": round((p.required - base) / GiB, 2),
            "costs_s": round(head.step_time.seconds - p.step_time.seconds, 1),
            "without": _summary(p),
        }
    out["all_off"] = _all_off_time(head.config, head.settings, head.seq_len, kw)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def table() -> str:
    """The markdown table of every row's JSON."""
    rows = sorted(OUT.glob("lever_table_*.json"))
    levers = [
        "model offload",
        "tiled attention backward",
        "expandable segments",
        "head chunks",
        "tiled MLP",
    ]
    lines = [
        "| setup | length | required GiB | predicted step | "
        + " | ".join(levers)
        + " | all together |",
        "|---|---|---|---|" + "---|" * len(levers) + "---|",
    ]
    for path in rows:
        r = json.loads(path.read_text())
        h = r["headline"]
        cells = []
        for lever in levers:
            x = r["levers"].get(lever)
            cells.append("-" if x is None else f"{x['saves_gib']:.2f} GiB, {x['costs_s']:+.0f} s")
        a = r["all_off"]
        lines.append(
            f"| `{r['command']}` | {h['seq_len']:,} ({h['seq_len'] / 2**20:g}M) | {h['required_gib']:.2f} | "
            f"{h['step_s']:,.0f} s | "
            + " | ".join(cells)
            + f" | {a['costs_s']:+.0f} s ({a['costs_share']:+.2%}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "rows", nargs="*", help=f"of {sorted(ROWS)}, each optionally with :deepspeed"
    )
    parser.add_argument("--table", action="store_true", help="print the table of the JSON files")
    parser.add_argument(
        "--retime",
        action="store_true",
        help="recompute the step without the levers in the JSON files",
    )
    args = parser.parse_args(argv)
    if args.retime:
        retime()
        return
    if args.table:
        print(table())
        return
    for name in args.rows:
        result = run_row(name)
        path = OUT / f"lever_table_{name.replace(':', '_')}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
