"""A model of PyTorch's CUDA caching allocator, replaying an allocation trace to predict `max_memory_reserved`.

Entry points:

* `CachingAllocatorModel(expandable=False)`: `malloc(nbytes, stream) -> Block`, `free(block)`, `empty_cache()`,
  `reset_peak()`; counters `allocated`, `reserved`, `max_reserved`, `reserved_by_stream()`.
* `replay(events, expandable=False) -> Replay`: runs a trace of `hf_upipe.planning.alloc_trace` through the model,
  the way the GPU measurement brackets a step (`empty_cache()` and a peak reset where the step starts).

The policy modelled is the one documented in c10/cuda/CUDACachingAllocator.cpp (the defaults of
`PYTORCH_CUDA_ALLOC_CONF`: no `max_split_size_mb`, no rounding to powers of two, no garbage collection threshold):

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
import dataclasses

__all__ = ["Block", "CachingAllocatorModel", "Replay", "replay"]

MiB = 2**20
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

    # ---------------------------------------------------------------- free lists
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

    # ---------------------------------------------------------------- counters
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

    # ---------------------------------------------------------------- malloc / free
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

    # ---------------------------------------------------------------- expandable segments
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
    """Replays a trace (`hf_upipe.planning.alloc_trace.record_step_trace`): allocations and frees in order; at
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
