"""Which allocations leave reserved memory behind: the simulated step's trace through the caching allocator model.

    python benchmarks/allocator_trace.py [--out benchmarks/results]      # about 30 s on 2 CPU cores

The step of the H100 memory runs (Llama3-8B, rank 0 of 8, 4 layers, 256K tokens, fused UPipe c=1, tiled MLP and
loss, checkpoints offloaded; `benchmarks/gpu/memory.py`) is simulated on fake tensors with its allocation trace
(`hf_upipe.planning.reserved.record_step_trace`) and replayed through `hf_upipe.planning.reserved.replay` in both
allocator modes, for three versions of the code:
- "as measured": the offload's copies back allocated on its side stream (the code the H100 runs measured);
- "main-stream copy back": the library as it is now (the copies back allocated on the compute stream);
- "+ embeddings sharded alone": also `fully_shard(model.model.embed_tokens)` before the root (a user setting).
For each: the predicted `max_memory_reserved`, the reserve and allocated bytes per stream at the reserve's peak,
and the segments holding the most free (cached) memory at that moment, each named by the request that created it.
Writes <out>/allocator_trace_llama3-8b_256k.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hf_upipe.models.presets import PRESETS
from hf_upipe.planning import categories as cat
from hf_upipe.planning import reserved as ca
from hf_upipe.planning import tracker as tr
from hf_upipe.planning import train_step
from hf_upipe.planning.reserved import Allowance, record_step_trace
from hf_upipe.training import offload

MiB, GiB = 2**20, 2**30
SETTINGS = train_step.StepSettings("fused", 1, tiled_mlp=True, offload="cpu")
STEP = dict(seq_len=262144, world_size=8, sp_size=8, layers=4)
GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")


class _Named(ca.CachingAllocatorModel):
    """The model, remembering the request that created each segment and the free segments at the peak."""

    def __init__(self, expandable):
        super().__init__(expandable)
        self.origin, self.request, self.in_step, self.free_at_peak = {}, None, False, []

    def malloc(self, nbytes, stream="default"):
        before = self.reserved
        block = super().malloc(nbytes, stream)
        if self.reserved > before and not self.expandable:
            self.origin[block.addr] = self.request
        return block

    def _reserve(self, stream, nbytes):
        super()._reserve(stream, nbytes)
        if self.in_step and nbytes > 0 and self.reserved == self.max_reserved:
            self.free_at_peak = self._free_segments()

    def _free_segments(self):
        rows, seen = [], set()
        for lst in self._free.values():
            for *_, b in lst:
                while b.prev is not None:
                    b = b.prev
                if id(b) in seen:
                    continue
                seen.add(id(b))
                first, size, used = b, 0, 0
                while b is not None:
                    size += b.size if b.mapped else 0
                    used += b.size if b.allocated else 0
                    b = b.next
                rows.append((first, size, used))
        return rows


def _replay_named(events, expandable):
    model, live = _Named(expandable), {}
    for ev in events:
        if ev[0] == "a":
            model.request = ev[4] if len(ev) > 4 else None
            live[ev[1]] = model.malloc(ev[2], ev[3])
        elif ev[0] == "f":
            if (b := live.pop(ev[1], None)) is not None:
                model.free(b)
        elif ev[1] == "step":
            model.empty_cache()
            model.reset_peak()
            model.in_step = True
        else:
            break
    return model


def _traced(label_ops: bool = True):
    """Adds (label, op, shape) to each allocation event: what the request was (analysis only)."""
    original_add, original_log = tr.MemoryTracker._add, tr.MemoryTracker._log_alloc
    last = {}

    def _add(self, key, storage, t, op):
        override = tr.LABEL_OVERRIDE
        last["what"] = (override[-1] if override else None, op, tuple(t.shape))
        return original_add(self, key, storage, t, op)

    def _log_alloc(self, key, nbytes):
        original_log(self, key, nbytes)
        if self.events is not None and self.events and self.events[-1][0] == "a":
            self.events[-1] = (*self.events[-1], "{} {} {}".format(*last.get("what", ("?",) * 3)))

    return _add, _log_alloc, original_add, original_log


def labelled_trace(restore_stream: str, shard_embeddings: bool):
    """The step's trace, each allocation labelled with its request; the offload's copies back on `restore_stream`,
    the embeddings sharded alone with `shard_embeddings` (also used by allocator_tiles.py)."""
    new_add, new_log, old_add, old_log = _traced()
    old_stream, old_shard = offload.RESTORE_STREAM, train_step._shard

    def shard(model, dtype, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in cat.decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)

    tr.MemoryTracker._add, tr.MemoryTracker._log_alloc = new_add, new_log
    offload.RESTORE_STREAM = restore_stream
    train_step._shard = shard if shard_embeddings else old_shard
    try:
        case = train_step.StepCase(
            PRESETS["llama3-8b"], STEP["seq_len"], STEP["sp_size"], STEP["layers"]
        )
        return record_step_trace(case, SETTINGS, world_size=STEP["world_size"])
    finally:
        tr.MemoryTracker._add, tr.MemoryTracker._log_alloc = old_add, old_log
        offload.RESTORE_STREAM, train_step._shard = old_stream, old_shard


def _measured(mode):
    with open(os.path.join(GPU, f"memory_step_{mode}.json")) as f:
        return json.load(f)["sections"]["step"][0]["max_reserved_total_bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(GPU)))
    args = ap.parse_args(argv)
    workspaces = Allowance().bytes(PRESETS["llama3-8b"], SETTINGS, STEP["seq_len"], 8, True)
    doc = {"step": {**STEP, "settings": SETTINGS.__dict__}, "workspaces_bytes": workspaces}
    variants = {
        "as measured": ("offload", False),
        "main-stream copy back": ("default", False),
        "+ embeddings sharded alone": ("default", True),
    }
    for name, (stream, embeddings) in variants.items():
        events, result = labelled_trace(stream, embeddings)
        row = {"tensor_peak": result["peak"]}
        for mode in ("default", "expandable"):
            m = _replay_named(events, mode == "expandable")
            by_stream, alloc_by_stream = m.at_peak
            top = sorted(m.free_at_peak, key=lambda r: r[1] - r[2], reverse=True)[:8]
            row[mode] = {
                "predicted_reserved": m.max_reserved + workspaces,
                "measured_reserved": _measured(mode) if name == "as measured" else None,
                "reserved_by_stream_at_peak": {k: v for k, v in by_stream.items() if v},
                "allocated_by_stream_at_peak": {k: v for k, v in alloc_by_stream.items() if v},
                "free_segments_at_peak": [
                    {
                        "stream": b.pool[0],
                        "segment_mib": round(size / MiB, 1),
                        "free_mib": round((size - used) / MiB, 1),
                        "created_by": m.origin.get(b.addr),
                    }
                    for b, size, used in top
                ],
            }
            print(name, mode, f"{row[mode]['predicted_reserved'] / GiB:.2f} GiB", flush=True)
        doc[name] = row
    path = os.path.join(args.out, "allocator_trace_llama3-8b_256k.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
