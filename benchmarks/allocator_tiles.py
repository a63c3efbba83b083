"""Would fixed-size tile buffers lower the reserve? The last, shorter tiles rounded up, through the allocator model.

    python benchmarks/allocator_tiles.py [--seq-len 262144 4194304]     # about 5 s a length on 2 CPU cores

The step of `benchmarks/allocator_trace.py` (Llama3-8B, rank 0 of 8, SP 8, 4 layers, fused UPipe c=1, tiled MLP
and loss, checkpoints offloaded) is recorded with its allocation trace at each length. The tiled loss runs over
chunks of `c` tokens of the shard and the tiled MLP/RMSNorm over chunks of the hidden size; where `c` does not
divide the shard, the last chunk is shorter and its buffers are smaller. The script lists the step's allocations
made in such a last tile (the tile dimension equal to the last tile's length), replaces each by the bytes of the
same op's full-tile allocation (what a fixed-size buffer, reused by every tile, would take) and replays both
traces through `hf_upipe.planning.reserved.replay` in both modes. Printed: the tiles, the allocations changed,
and the predicted `max_memory_reserved` of the trace (no workspace allowance) before and after.

The fused block's stage loop is not in the table: at heads_per_chunk=1 every stage has the same heads, so its
allocations repeat the same sizes stage after stage (none is rounded). At the
lengths `plan --max` tries (multiples of 128K tokens) the shard over SP 8 is a multiple of 4,096 tokens, so the
MLP's tiles (4,096 tokens for Llama3-8B) all have the same length; an off-grid length (e.g. 270144) shows the
MLP's last tile too.
"""

from __future__ import annotations

import argparse
import re
import time

from allocator_trace import SETTINGS, STEP, labelled_trace

from hf_upipe.models.presets import PRESETS
from hf_upipe.ops.tiled_loss import default_chunk_tokens as loss_tile
from hf_upipe.planning import reserved as ca

GiB = 2**30


def _last_tiles(shard: int, hidden: int, vocab: int) -> list[tuple[str, int, int, int]]:
    """(loop, tile dim, full tile, last tile) for each loop whose last tile is shorter."""
    loops = [("loss", 0, loss_tile(vocab)), ("mlp", 1, hidden)]
    return [(name, dim, c, shard % c) for name, dim, c in loops if shard % c]


def _rounded(events: list, loops) -> tuple[list, int, int]:
    """The trace with each last-tile allocation at the bytes of the same op's full-tile allocation in the step
    (same dtype: bytes scaled by full / last); (events, count, bytes added)."""
    start = next(i for i, e in enumerate(events) if e[0] == "mark" and e[1] == "step")
    seen = {e[4].split(" ", 1)[1] + f" {e[2]}" for e in events[start:] if e[0] == "a"}
    out, count, added = list(events), 0, 0
    for i in range(start, len(events)):
        e = events[i]
        if e[0] != "a":
            continue
        op, shape = e[4].split(" ", 2)[1:]
        dims = [int(d) for d in re.findall(r"\d+", shape)]
        for _, dim, full, last in loops:
            if len(dims) > dim and dims[dim] == last:
                dims[dim] = full
                key = f"{op} ({', '.join(map(str, dims))}{',' if len(dims) == 1 else ''})"
                size = e[2] * full // last  # the same tensor, full tile long (same dtype)
                if f"{key} {size}" in seen:
                    out[i] = (*e[:2], size, *e[3:])
                    count, added = count + 1, added + size - e[2]
                break
    return out, count, added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[262144, 4194304])
    args = ap.parse_args(argv)
    cfg = PRESETS["llama3-8b"]
    print(
        f"settings {SETTINGS}, world {STEP['world_size']}, sp {STEP['sp_size']}, {STEP['layers']} layers"
    )
    print(
        "| seq_len | last tiles (loop: full/last tokens) | allocations rounded (bytes added, summed) | mode | "
        "max_reserved before | after | change |"
    )
    print("|---|---|---|---|---|---|---|")
    for seq in args.seq_len:
        t0 = time.time()
        STEP["seq_len"] = seq
        events, _ = labelled_trace("default", False)
        shard = seq // STEP["sp_size"]
        loops = _last_tiles(shard, cfg["hidden_size"], cfg["vocab_size"])
        changed, count, added = _rounded(events, loops)
        tiles = ", ".join(f"{n}: {c}/{r}" for n, _, c, r in loops) or "none"
        for mode in ("default", "expandable"):
            exp = mode == "expandable"
            a = ca.replay(events, exp).max_reserved
            b = ca.replay(changed, exp).max_reserved
            print(
                f"| {seq:,} | {tiles} | {count} (+{added / 2**20:.1f} MiB) | {mode} | "
                f"{a / GiB:.3f} GiB | {b / GiB:.3f} GiB | {(b - a) / GiB:+.3f} GiB |",
                flush=True,
            )
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
