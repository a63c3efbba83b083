"""Predicted GPU memory of a training step: what the CUDA caching allocator reserves, plus what it cannot see.

The allocator model is one mechanism in three steps: the simulated step's allocation trace (every device
allocation and free, in order, with its stream), a replay of that trace through a model of PyTorch's caching
allocator, and the prediction (the depth rule, the allowance for what the simulation cannot see, the
calibration).

Entry points:

* `step_reserved(case, settings, *, world_size) -> dict`: simulates the step of a `StepCase`
  (`record_step_trace`), replays its trace through the allocator model in both modes (`replay`) and returns
  the tensor peak by category with ``reserved = {"default": bytes, "expandable": bytes}``.
* `extrapolate_reserved(reserved_4, peak_4, peak_L)`: the reserve of a deeper model (see below).
* `Allowance`: the bytes the simulation cannot see, as stated constants and per-kernel functions; its attention
  term is `unseen_rate(impl, heads)` bytes per token of one kernel call (`UNSEEN_PER_TOKEN`, `UNSEEN_BASE`:
  measured on an H100), over `kernel_call_tokens(config, settings, seq_len)` tokens (one tile of the tiled
  backward, `hf_upipe.ops.tiled_backward`, where it applies).
* `allocator_mode()`: "expandable" when `PYTORCH_CUDA_ALLOC_CONF` asks for expandable segments, else "default".
* `calibration_file()`, `load_correction(key)`, `save_correction(key, measured, predicted)`: the correction that
  `hf-upipe calibrate` measures on a GPU and `hf-upipe plan` applies.
* `record_step_trace(case, settings, *, world_size)`: runs
  `hf_upipe.planning.train_step.measure_train_step` in a simulated world with a recording `MemoryTracker` around
  all of it, so the trace holds the model's build, FSDP2 sharding and the optimizer's states (what is allocated
  before the step), a `("mark", "step")` where the step starts, then the step itself. Returns the events and the
  simulation's result.
* `stream_names()`: the streams a trace can name (`STREAMS`).
* `CachingAllocatorModel(expandable=False)`: `malloc(nbytes, stream) -> Block`, `free(block)`, `empty_cache()`,
  `reset_peak()`; counters `allocated`, `reserved`, `max_reserved`, `reserved_by_stream()`.
* `replay(events, expandable=False) -> Replay`: runs a trace of `record_step_trace` through the model,
  the way the GPU measurement brackets a step (`empty_cache()` and a peak reset where the step starts).

Depth. A trace of 3 and 4 layers is simulated; a deeper model adds, per layer, only persistent sharded state
(parameters, gradients, AdamW states: allocated before the step, each in its own large segment) while the step's
transient working set is the same for every layer. So the reserve of L layers is the 4-layer reserve plus the
extra tensor bytes: ``reserved(L) = reserved(4) + peak(L) - peak(4)``. For Llama3-8B at 256K tokens on 8 GPUs
this gives 29.49 GiB (default) and 29.25 GiB (expandable) for 32 layers, against 29.54 and 29.01 GiB from
replaying the full 32-layer trace (`exact=True`). A straight line through the 3- and 4-layer reserves is not
used: fragmentation makes them non-monotonic (18.82 GiB for 3 layers, 18.12 GiB for 4).

The trace's streams. The CUDA caching allocator keeps the blocks of each stream apart, so the trace says which
stream each allocation is made on. On a machine without CUDA, FSDP2 enters its streams through `torch.cpu.stream`
(dummies that exist for device-agnostic code); while recording, that function is wrapped to name the stream FSDP2
enters: "all_gather_copy_in" (the all-gather output buffer of forward and pre-backward unshards), "all_gather",
"reduce_scatter" (the reduced gradient shards), "all_reduce". The offload's copies back to the device are named
by `hf_upipe.training.offload.RESTORE_STREAM` through the step's restore context. Everything else is "default".

The trace is exact for what the tracker counts (tensor storages, including FSDP2's in-place resizes) and blind to
what it does not (kernel workspaces, NCCL buffers): `Allowance` adds them.

The allocator model. The policy modelled is the one documented in c10/cuda/CUDACachingAllocator.cpp (the
defaults of `PYTORCH_CUDA_ALLOC_CONF`: no `max_split_size_mb`, no rounding to powers of two, no garbage collection
threshold):

* sizes are rounded up to 512 bytes (`ROUND`); requests up to 1 MiB (`SMALL_SIZE`) use the small pool, larger
  ones the large pool;
* a request takes the smallest cached free block of its pool *on the same stream* that is large enough (best fit;
  ties: lowest address). Blocks allocated on one stream are never given to another;
* the block is split when the rest is worth keeping: in the small pool when >= 512 bytes remain, in the large pool
  when more than 1 MiB remains; freed blocks merge with free neighbours of the same segment;
* without a fitting block a new segment is reserved (cudaMalloc): 2 MiB for small requests (`SMALL_BUFFER`),
  20 MiB for requests under 10 MiB (`LARGE_BUFFER`, `MIN_LARGE_ALLOC`), else the request rounded up to 2 MiB
  (`ROUND_LARGE`). Freed memory stays reserved until `empty_cache()`, which returns the segments with no
  allocated block;
* `expandable_segments:True`: one segment per stream and pool, grown at its lowest free address by mapping pages
  of 2 MiB (small pool) or 20 MiB (large pool); a request with no fitting free block maps only what the free tail
  lacks. `empty_cache()` unmaps the pages that lie entirely inside free blocks.

Not modelled: the delayed reuse of blocks recorded on other streams (`record_stream`: the block returns once the
other stream's work is done; the replay frees it at once), out-of-memory retries (the prediction is for a GPU
with room), CUDA graphs' private pools.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator

import torch

from hf_upipe.allocator import conf_mode
from hf_upipe.planning import tracker as _tracker
from hf_upipe.planning.simulate import fake_tensors, simulated_world

__all__ = [
    "STREAMS",
    "UNSEEN_BASE",
    "UNSEEN_PER_TOKEN",
    "Allowance",
    "Block",
    "CachingAllocatorModel",
    "Replay",
    "allocator_mode",
    "calibration_file",
    "extrapolate_reserved",
    "kernel_call_tokens",
    "load_correction",
    "record_step_trace",
    "replay",
    "save_correction",
    "step_reserved",
    "stream_names",
    "unseen_rate",
]

MiB, GiB = 2**20, 2**30

MODES = ("default", "expandable")


def allocator_mode(env: str | None = None) -> str:
    """The allocator mode that `PYTORCH_CUDA_ALLOC_CONF` (or `env`) selects."""
    return conf_mode(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if env is None else env)


def step_reserved(case, settings, *, world_size: int) -> dict:
    """Tensor peak by category and the allocator's predicted reserve, in both modes (see the module docstring):
    `case` (a `hf_upipe.planning.model_step.StepCase`) with `settings` as rank 0 of `world_size` ranks."""
    events, result = record_step_trace(case, settings, world_size=world_size)
    return {
        "by_category": result["by_category"],
        "peak": result["peak"],
        "host_peak": result.get(
            "host_peak", 0
        ),  # model_offload='cpu': the model's state in host memory
        "reserved": {mode: replay(events, mode == "expandable").max_reserved for mode in MODES},
    }


def extrapolate_reserved(reserved_4: int, peak_4: int, peak_l: int) -> int:
    """The reserve of a deeper model: the 4-layer reserve plus the extra (persistent) tensor bytes."""
    return reserved_4 + peak_l - peak_4


# Bytes the attention block allocates on the GPU beyond the tensors the simulation counts, per token of the
# sequence its kernel sees, at head_dim 128 (`benchmarks/results/gpu/memory_blocks.json`, H100, torch 2.11, cuDNN
# up to 512K tokens and the flash kernel above: max_memory_allocated minus the tracked tensor peak, at 512K and 1M
# tokens). Every row is 16 MiB + rate x tokens to the byte; the rates are per implementation and heads per stage.
UNSEEN_PER_TOKEN = {
    ("fused", 1): 2501,  # the fused block, both backward modes
    ("upipe", 1): 2629,
    ("upipe", 2): 2121,
    ("upipe", 4): 3153,  # our Ulysses mode: all 4 local heads in one stage
    ("deepspeed", 4): 4929,  # DeepSpeed's Ulysses around sdpa
}
UNSEEN_BASE = {"deepspeed": 304 * MiB}  # the other rows' 16 MiB is within the cuBLAS allowance


def unseen_rate(impl: str, heads: int) -> float:
    """Bytes per token (head_dim 128) for `heads` per stage: the measured rate where there is one, else the line
    through our block's measured extremes (2629 at 1 head, 3153 at 4: above every measured rate of 1 to 4 heads),
    or DeepSpeed's measured 4 heads scaled by heads."""
    if impl == "deepspeed":
        return UNSEEN_PER_TOKEN.get((impl, heads), UNSEEN_PER_TOKEN[("deepspeed", 4)] * heads / 4)
    measured = UNSEEN_PER_TOKEN.get(("fused" if impl.startswith("fused") else "upipe", heads))
    if measured is not None:
        return measured
    lo, hi = UNSEEN_PER_TOKEN[("upipe", 1)], UNSEEN_PER_TOKEN[("upipe", 4)]
    return lo + (hi - lo) * (heads - 1) / 3


@dataclasses.dataclass(frozen=True)
class Allowance:
    """GPU memory outside the simulated tensors, added to the predicted reserve.

    Attributes:
        context: the CUDA context and the libraries' handles, outside the caching allocator (measured on an H100
            with CUDA 13.0 and torch 2.11: 843 MiB, `benchmarks/results/gpu/memory_step_*.json`
            "calibration.context_bytes"; 0.85 GiB here).
        nccl: NCCL's communication buffers, allocated by NCCL outside the caching allocator (not measured: the GPU
            runs used a fake process group); 1 GiB, a stated allowance for 8 GPUs per node.
        cublas_per_stream: cuBLAS workspace per stream that runs matmuls, through the caching allocator (torch's
            default on Hopper, `CUBLAS_WORKSPACE_CONFIG=:4096:8`: 32 MiB); the step's matmuls run on one stream.
    """

    context: int = int(0.85 * GiB)
    nccl: int = 1 * GiB
    cublas_per_stream: int = 32 * MiB

    def attention_workspace(self, config, settings, seq_len: int, sp_size: int) -> int:
        """What the attention kernels allocate beyond the simulated tensors (their scratch, invisible to the
        tracker): `unseen_rate` bytes per token of one kernel call, scaled by head_dim / 128, plus DeepSpeed's
        measured constant. A call covers the sequence the kernel sees (the ring's shard), or one tile of
        `kernel_call_tokens` where hf_upipe tiles the backward."""
        from hf_upipe.models.architectures import model_geometry

        g = model_geometry(config)
        heads = g["heads"] // sp_size if settings.impl in ("ulysses", "deepspeed") else None
        if heads is None:
            heads = settings.heads_per_chunk or g["heads"] // sp_size
        head_dim = _get(config, "head_dim") or g["hidden"] // g["heads"]
        rate = unseen_rate(settings.impl, heads) * head_dim / 128
        tokens = kernel_call_tokens(config, settings, seq_len)
        return int(tokens * rate) + UNSEEN_BASE.get(settings.impl, 0)

    def bytes(self, config, settings, seq_len: int, sp_size: int, device_only: bool = False) -> int:
        """Everything added to the reserve; `device_only`: only what a single-GPU measurement holds in its
        reserve (workspaces), for comparing with `max_memory_reserved`."""
        work = self.cublas_per_stream + self.attention_workspace(config, settings, seq_len, sp_size)
        return work if device_only else work + self.context + self.nccl


def kernel_call_tokens(config, settings, seq_len: int) -> int:
    """Tokens of the longest attention backward call: the sequence the kernel sees (the ring's shard), or one tile of
    `hf_upipe.ops.tiled_backward.backward_block()` for hf_upipe's impls on plain causal attention (the tiles'
    fp32 accumulators are simulated tensors). DeepSpeed's attention and models whose attention goes through a
    wrapping kernel (a sliding window, soft-capped scores, chunked attention) are not tiled. The forward kernels
    are taken to allocate nothing beyond their output and log-sum-exp (both simulated)."""
    from hf_upipe.ops.tiled_backward import backward_block

    tokens = seq_len // max(1, settings.ring_size)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    types = _get(config, "layer_types")
    if isinstance(types, (list, tuple)):  # transformers' per-layer kinds say where a window applies
        window = any(t != "full_attention" for t in types)
    else:
        window = (
            bool(_get(config, "sliding_window")) and _get(config, "use_sliding_window") is not False
        )
    wrapped = window or any(
        _get(config, n) for n in ("attn_logit_softcapping", "attention_chunk_size")
    )
    block = backward_block()
    if settings.impl == "deepspeed" or wrapped or block <= 0:
        return tokens
    return min(tokens, block)


def _get(config, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def calibration_file() -> str:
    folder = os.environ.get("HF_UPIPE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hf_upipe"
    )
    return os.path.join(folder, "calibration.json")


def _read() -> dict:
    try:
        with open(calibration_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def load_correction(key: str) -> dict | None:
    """The stored correction for `key` (`{"factor", "measured", "predicted", ...}`), or None."""
    return _read().get(key)


def save_correction(key: str, measured: int, predicted: int, **info) -> dict:
    """Stores measured / predicted reserve for `key` (the planner multiplies its prediction by it)."""
    if measured <= 0 or predicted <= 0:
        raise ValueError(f"measured={measured} and predicted={predicted} must be positive bytes")
    data = _read()
    data[key] = dict(factor=measured / predicted, measured=measured, predicted=predicted, **info)
    os.makedirs(os.path.dirname(calibration_file()), exist_ok=True)
    with open(calibration_file(), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return data[key]


def correction_key(model_name: str, settings, mode: str, dtype: torch.dtype) -> str:
    """The calibration's key: model, settings that shape the step, allocator mode, dtype."""
    fields = ",".join(f"{k}={v}" for k, v in sorted(dataclasses.asdict(settings).items()))
    return f"{model_name}|{fields}|{mode}|{dtype}"


# ---- the step's allocation trace
STREAMS = ("default", "all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce", "offload")
_FSDP_STREAMS = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream")
_FSDP_STREAMS += ("all_reduce_stream",)


def stream_names() -> tuple[str, ...]:
    return STREAMS


@contextlib.contextmanager
def _named_cpu_streams() -> Iterator[None]:
    """`torch.cpu.stream(s)` also pushes the name of the FSDP2 stream `s` (see the module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext

    names: dict[int, str] = {}
    original_stream, original_init = torch.cpu.stream, FSDPCommContext.lazy_init

    def lazy_init(self, *args, **kwargs):
        out = original_init(self, *args, **kwargs)
        for attr in _FSDP_STREAMS:
            if hasattr(self, attr):
                names[id(getattr(self, attr))] = attr.removesuffix("_stream")
        return out

    @contextlib.contextmanager
    def stream(s):
        with original_stream(s), _tracker.allocation_stream(names.get(id(s), "default")):
            yield

    torch.cpu.stream, FSDPCommContext.lazy_init = stream, lazy_init
    try:
        yield
    finally:
        torch.cpu.stream, FSDPCommContext.lazy_init = original_stream, original_init


class _StepMark:
    """The `around_step` of `measure_train_step`: marks where the step starts and ends in the trace."""

    def __init__(self, recorder: _tracker.MemoryTracker):
        self.recorder = recorder

    def __enter__(self):
        self.recorder.events.append(("mark", "step"))
        return self

    def __exit__(self, *exc):
        self.recorder.events.append(("mark", "end"))
        return False


def record_step_trace(case, settings, *, world_size: int) -> tuple[list[tuple], dict]:
    """(events, result): the allocation trace of rank 0's build and step, and `measure_train_step`'s result.

    Events: ``("a", key, nbytes, stream)``, ``("f", key)``, ``("mark", "step" | "end")``; a key is reused only
    after its free. `case`: a `hf_upipe.planning.model_step.StepCase` (its kernel: the attention kernel).
    """
    from hf_upipe.planning.train_step import fsdp_mesh, measure_train_step

    with simulated_world(world_size), _named_cpu_streams():
        mesh = fsdp_mesh()
        with fake_tensors(torch.float32):
            with _tracker.MemoryTracker(record_events=True) as recorder:
                result = measure_train_step(
                    case, settings, mesh=mesh, around_step=_StepMark(recorder)
                )
    return recorder.events, result


# ---- the caching allocator model
ROUND = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" request
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: segment of the small pool; page of its expandable segment
LARGE_BUFFER = (
    20 * MiB
)  # kLargeBuffer: segment for 1-10 MiB requests; page of a large expandable segment
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
_SPAN = 2**50  # address space of one expandable segment (virtual; only mapped pages count)


def round_size(nbytes: int) -> int:
    """The allocator's block size for a request (at least 512 bytes, a multiple of 512)."""
    return max(ROUND, -(-nbytes // ROUND) * ROUND)


def segment_size(size: int) -> int:
    """Bytes cudaMalloc'ed for a rounded request that no cached block fits (default mode)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclasses.dataclass(eq=False)
class Block:
    """A range of one segment: allocated, cached free, or (expandable segments) not mapped."""

    addr: int
    size: int
    pool: tuple  # (stream, small)
    allocated: bool = False
    mapped: bool = True
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclasses.dataclass
class Replay:
    """What a replay predicts: bytes reserved at most during the step, and where they are.

    Attributes:
        max_reserved: `torch.cuda.max_memory_reserved()` over the step (after the peak reset at its start).
        max_allocated: the allocator's `max_memory_allocated()` over the step (rounded block sizes).
        reserved_at_start: reserved after the `empty_cache()` at the step's start.
        by_stream: {stream: reserved bytes} at the moment of `max_reserved`.
        allocated_by_stream: {stream: allocated bytes} at that moment.
    """

    max_reserved: int
    max_allocated: int
    reserved_at_start: int
    by_stream: dict
    allocated_by_stream: dict


class CachingAllocatorModel:
    """The caching allocator of one device (see the module docstring for the policy)."""

    def __init__(self, expandable: bool = False):
        self.expandable = expandable
        self._free: dict[
            tuple, list
        ] = {}  # pool -> sorted [(size, addr, id, block)] of mapped free blocks
        self._segments: dict[tuple, Block] = {}  # expandable: pool -> first block of its segment
        self._next_addr = 0
        self.allocated = self.reserved = self.max_reserved = self.max_allocated = 0
        self._reserved_of: dict[str, int] = {}
        self._allocated_of: dict[str, int] = {}
        self.at_peak: tuple[dict, dict] = ({}, {})

    # ---- free lists
    def _insert(self, b: Block) -> None:
        bisect.insort(self._free.setdefault(b.pool, []), (b.size, b.addr, id(b), b))

    def _remove(self, b: Block) -> None:
        lst = self._free[b.pool]
        i = bisect.bisect_left(lst, (b.size, b.addr, id(b)))
        assert lst[i][3] is b
        del lst[i]

    def _best_fit(self, pool: tuple, size: int) -> Block | None:
        lst = self._free.get(pool, [])
        i = bisect.bisect_left(lst, (size, -1))
        return lst[i][3] if i < len(lst) else None

    # ---- counters
    def _reserve(self, stream: str, nbytes: int) -> None:
        self.reserved += nbytes
        self._reserved_of[stream] = self._reserved_of.get(stream, 0) + nbytes
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved
            self.at_peak = (dict(self._reserved_of), dict(self._allocated_of))

    def _use(self, stream: str, nbytes: int) -> None:
        self.allocated += nbytes
        self._allocated_of[stream] = self._allocated_of.get(stream, 0) + nbytes
        self.max_allocated = max(self.max_allocated, self.allocated)

    def reset_peak(self) -> None:
        self.max_reserved, self.max_allocated = self.reserved, self.allocated
        self.at_peak = (dict(self._reserved_of), dict(self._allocated_of))

    def reserved_by_stream(self) -> dict:
        return {k: v for k, v in self._reserved_of.items() if v}

    # ---- malloc / free
    def malloc(self, nbytes: int, stream: str = "default") -> Block:
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE)
        block = self._best_fit(pool, size)
        if block is not None:
            self._remove(block)
        elif self.expandable:
            block = self._grow(pool, size)
        else:
            block = Block(self._next_addr, segment_size(size), pool)
            self._next_addr += block.size + SMALL_BUFFER
            self._reserve(stream, block.size)
        self._split(block, size)
        block.allocated = True
        self._use(stream, block.size)
        return block

    def _split(self, block: Block, size: int) -> None:
        rest = block.size - size
        small = block.pool[1]
        if (small and rest >= ROUND) or (not small and rest > SMALL_SIZE):
            tail = Block(block.addr + size, rest, block.pool, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        self._allocated_of[block.pool[0]] -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._remove(other)
                block = self._merge(block, other)
        self._insert(block)

    @staticmethod
    def _merge(a: Block, b: Block) -> Block:
        """Merges neighbours a and b (either order) into the lower one; returns it."""
        lo, hi = (a, b) if a.addr < b.addr else (b, a)
        lo.size += hi.size
        lo.next = hi.next
        if hi.next is not None:
            hi.next.prev = lo
        return lo

    # ---- expandable segments
    def _grow(self, pool: tuple, size: int) -> Block:
        """Maps pages at the lowest address of the pool's segment where `size` fits; returns the free block."""
        page = SMALL_BUFFER if pool[1] else LARGE_BUFFER
        first = self._segments.get(pool)
        if first is None:
            first = self._segments[pool] = Block(self._next_addr, _SPAN, pool, mapped=False)
            self._next_addr += _SPAN
        b = first
        while True:  # runs of free or unmapped blocks, in address order
            while b.allocated:
                b = b.next
            run, total = [b], b.size
            while total < size and run[-1].next is not None and not run[-1].next.allocated:
                run.append(run[-1].next)
                total += run[-1].size
            if total >= size and any(not r.mapped for r in run):
                break
            b = run[-1].next
        need = size
        for r in run:  # map the unmapped parts the request covers, page-rounded
            if need <= 0:
                break
            if not r.mapped:
                mapped = min(r.size, -(-need // page) * page)
                if mapped < r.size:
                    rest = Block(r.addr + mapped, r.size - mapped, pool, mapped=False)
                    rest.prev, rest.next = r, r.next
                    if r.next is not None:
                        r.next.prev = rest
                    r.next, r.size = rest, mapped
                r.mapped = True
                self._reserve(pool[0], mapped)
            else:
                self._remove(r)
            need -= r.size
        block = run[0]
        for r in run[1:]:
            if r.mapped and r.prev is block:
                block = self._merge(block, r)
        return block

    def empty_cache(self) -> None:
        """Returns cached memory: whole free segments (default) or the free blocks' whole pages (expandable)."""
        for pool, lst in self._free.items():
            keep = []
            for item in lst:
                b = item[3]
                if not self.expandable:
                    if b.prev is None and b.next is None:
                        self._reserve(pool[0], -b.size)
                    else:
                        keep.append(item)
                    continue
                keep.extend(self._unmap(b))
            self._free[pool] = sorted(keep)

    def _unmap(self, b: Block) -> list:
        """Unmaps the pages inside free block b; returns the free-list entries of its mapped remainders."""
        page = SMALL_BUFFER if b.pool[1] else LARGE_BUFFER
        lo, hi = -(-b.addr // page) * page, (b.addr + b.size) // page * page
        if hi <= lo:
            return [(b.size, b.addr, id(b), b)]
        parts = []
        for start, end, mapped in (
            (b.addr, lo, True),
            (lo, hi, False),
            (hi, b.addr + b.size, True),
        ):
            if end > start:
                parts.append(Block(start, end - start, b.pool, mapped=mapped))
        for x, y in zip(parts, parts[1:]):
            x.next, y.prev = y, x
        parts[0].prev, parts[-1].next = b.prev, b.next
        if b.prev is not None:
            b.prev.next = parts[0]
        elif self._segments.get(b.pool) is b:
            self._segments[b.pool] = parts[0]
        if b.next is not None:
            b.next.prev = parts[-1]
        self._reserve(b.pool[0], -(hi - lo))
        for u in parts:  # unmapped neighbours merge
            if not u.mapped:
                for other in (u.next, u.prev):
                    if other is not None and not other.mapped and not other.allocated:
                        u = self._merge(u, other)
        return [(p.size, p.addr, id(p), p) for p in parts if p.mapped]


def replay(events, expandable: bool = False) -> Replay:
    """Replays a trace (`record_step_trace`): allocations and frees in order; at
    ("mark", "step") `empty_cache()` and a peak reset, as the measurement does before the step; the result is the
    step's peaks (up to ("mark", "end"), or the trace's end)."""
    model = CachingAllocatorModel(expandable)
    live: dict[int, Block] = {}
    start = None
    for ev in events:
        kind = ev[0]
        if kind == "a":
            live[ev[1]] = model.malloc(ev[2], ev[3])
        elif kind == "f":
            block = live.pop(ev[1], None)
            if block is not None:
                model.free(block)
        elif ev[1] == "step":
            model.empty_cache()
            model.reset_peak()
            start = model.reserved
        elif ev[1] == "end":
            break
    by_stream, allocated_by_stream = model.at_peak
    return Replay(
        max_reserved=model.max_reserved,
        max_allocated=model.max_allocated,
        reserved_at_start=model.reserved if start is None else start,
        by_stream={k: v for k, v in by_stream.items() if v},
        allocated_by_stream={k: v for k, v in allocated_by_stream.items() if v},
    )
