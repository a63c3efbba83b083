"""Exact, device-agnostic accounting of tensor storage memory in one process.

Entry points:

* :class:`MemoryTracker`: a ``TorchDispatchMode`` that counts the bytes of every tensor storage created while it is
  active, and keeps ``current_bytes`` / ``peak_bytes`` up to date as those storages are freed. Phases are labelled
  with :meth:`MemoryTracker.mark`.
* :class:`StorageRecord`: one live storage as recorded by ``snapshot_at_peak=True``.
* :func:`storage_label`: a context manager naming the label of the storages created inside it, over any labeler
  (code that knows what it allocates, such as the offload's copy back of a checkpoint, says so);
  :func:`checkpoint_label`: ``storage_label("checkpoints")``, the planner's restore context for the offload;
  :func:`allocation_stream`: storages created inside are logged as allocated on stream ``name`` by trackers with
  ``record_events`` (`hf_upipe.planning.reserved`). ``LABEL_OVERRIDE`` / ``STREAM`` / ``HOST``: the stacks of
  those scopes, innermost last.
* :func:`host_memory` and :func:`to_host`: host memory apart from the
  device. Storages created (or :meth:`MemoryTracker.track` -ed) inside ``host_memory()`` count in
  :attr:`MemoryTracker.host_bytes` / :attr:`MemoryTracker.host_peak_bytes`, never in the device's counters or
  events; ``to_host(*tensors)`` moves tracked device storages there (a copy to the host and the device's copy freed,
  as FSDP2's host offload does with each reduced gradient shard). This is how a CPU step (real or simulated), where
  the host and the device are the same memory, accounts for what a GPU keeps on the host.
* :data:`GiB` / :data:`MiB`: byte units for reporting.

What is counted, exactly:

* every storage that an aten op *returns* and that is new (for a wrapper subclass such as DTensor: its local
  tensor's storage): an output whose storage is also the storage of one of the
  op's inputs (views, in-place ops, ``out=``) is not new. Each storage is counted once, by ``nbytes()``, from the first
  op that returned it until it is garbage collected (a ``weakref.finalize`` on the storage).
* storages resized in place (``UntypedStorage.resize_``, as FSDP2 does to free and re-allocate unsharded
  parameters): a tracked one follows its new size; an untracked one that grows from zero bytes is counted from then on.
* not counted: pinned host memory (the offload's buffers on a GPU machine: host memory, not the device's; nothing
  is pinned on a machine without a GPU, where the tracker counts CPU tensors as the device);
* not counted: tensors that existed before the tracker started (inputs, parameters) unless they are registered with
  :meth:`MemoryTracker.track`; kernel-internal scratch that never becomes an op output; allocator rounding and
  fragmentation; communication buffers of the backend (NCCL, gloo).

The tracker works on real CPU tensors and on ``FakeTensor`` s (see :func:`hf_upipe.planning.simulate.fake_tensors`),
and gives identical numbers for both, because a fake tensor's storage has the same ``nbytes()`` as the real one.
Always create fake inputs first and enter the tracker *inside* the fake mode, so that it sees fake tensors as outputs::

    with fake_tensors():
        q = torch.empty(1, 8, 4096, 64, requires_grad=True)   # input: not counted
        with MemoryTracker() as tracker:
            out = attention(q, q, q)
            tracker.mark("forward")
            out.sum().backward()
            tracker.mark("backward")
    print(tracker.phase_peaks["forward"] / GiB)

(In recent torch, verified on 2.13, ``FakeTensorMode`` is an "infra" mode that always dispatches below user modes,
so a tracker entered *before* the fake mode also sees fake outputs and gives the same numbers. Entering it inside is
the order that does not rely on this.)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    "GiB",
    "MiB",
    "MemoryTracker",
    "StorageRecord",
    "allocation_stream",
    "checkpoint_label",
    "host_memory",
    "storage_label",
    "to_host",
]

GiB: int = 2**30
"""Bytes in one gibibyte."""
MiB: int = 2**20
"""Bytes in one mebibyte."""

# the scopes that name the storages created inside them (see the module docstring)
LABEL_OVERRIDE: list[str] = []  # the label of storages created now, innermost last
STREAM: list[str] = []  # the stream allocations are made on, innermost last
HOST: list[bool] = []  # non-empty: storages created now are host memory


def checkpoint_label():
    """`storage_label("checkpoints")`: the planner passes it as the offload's `restore_context`, so the layer inputs
    copied back to the device in backward are counted as checkpoints (hf_upipe.planning.categories)."""
    return storage_label("checkpoints")


@contextlib.contextmanager
def storage_label(label: str) -> Iterator[None]:
    """Storages created inside get `label` in every labeling `MemoryTracker`, whatever its labeler says."""
    LABEL_OVERRIDE.append(label)
    try:
        yield
    finally:
        LABEL_OVERRIDE.pop()


@contextlib.contextmanager
def allocation_stream(name: str) -> Iterator[None]:
    """Storages created inside are logged as allocated on stream `name` by trackers with ``record_events``."""
    STREAM.append(name)
    try:
        yield
    finally:
        STREAM.pop()


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Storages created (or `track`-ed) inside are host memory: trackers count them apart from the device."""
    HOST.append(True)
    try:
        yield
    finally:
        HOST.pop()


# trackers inside their `with` block, which follow storage resizes
_ACTIVE: list[MemoryTracker] = []
_RESIZE_LOCK = threading.Lock()
_C_RESIZE = torch._C.StorageBase.resize_
_PRIM_DEVICE = torch.ops.prim.device.default


def _tracked_resize(storage, size):
    """`UntypedStorage.resize_` while a tracker is active: FSDP2 frees and re-allocates its unsharded parameters by
    resizing their storages in place, which no op dispatch sees."""
    out = _C_RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        tracker._on_resize(storage)
    return out


def to_host(*tensors: torch.Tensor) -> None:
    """In every active tracker: the tracked device storages of `tensors` become host memory (see the module
    docstring)."""
    for tracker in list(_ACTIVE):
        tracker.move_to_host(*tensors)


def _inner_tensors(leaves) -> Iterator[torch.Tensor]:
    """The tensors that own storage: wrapper subclasses (DTensor) are replaced by their inner (local) tensors."""
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            yield from _inner_tensors(getattr(t, a) for a in attrs)
        else:
            yield t


def _pinned_host(t: torch.Tensor) -> bool:
    """Pinned host memory (only on a machine with CUDA; fake tensors are never pinned)."""
    if t.device.type != "cpu" or not torch.cuda.is_available():
        return False
    try:
        return bool(t.is_pinned())
    except (RuntimeError, NotImplementedError):  # fake or other subclasses without storage data
        return False


class StorageRecord(NamedTuple):
    """One tracked storage, described by the first tensor that was seen with it.

    Attributes:
        shape: Shape of that tensor.
        dtype: Its dtype.
        nbytes: Bytes of the whole storage (may exceed ``numel * itemsize`` of the tensor).
        op: Name of the aten op that returned it, or ``"track"`` for tensors registered with ``track()``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    op: str


def _tensor_leaves(tree, out: list | None = None) -> list:
    """The tensors in an op's arguments or outputs, in order: through lists, tuples and dicts (the only containers
    an aten schema has; `torch.utils._pytree.tree_leaves` gives the same tensors, at several times the cost)."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _tensor_leaves(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensor_leaves(x, out)
    return out


def _storage_keys(leaves) -> set[int]:
    """The storage keys of the tensors among `leaves` (through wrapper subclasses)."""
    keys = set()
    for t in _inner_tensors(leaves):
        found = _storage_key(t)
        if found is not None:
            keys.add(found[0])
    return keys


def _storage_key(t: torch.Tensor) -> tuple[int, torch.UntypedStorage] | None:
    """Returns ``(key, storage)`` for a tensor with a storage, or None (sparse, nested, ... tensors)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage._cdata, storage


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages created while the mode is active.

    Use it as a context manager. ``current_bytes`` and ``peak_bytes`` stay valid after exit (storages created inside
    and freed later are still subtracted). Peaks are absolute: the bytes live from tensors created inside the tracker
    (plus those given to :meth:`track`), not deltas between phases.

    Args:
        snapshot_at_peak: Record the storages live at the peak (see :attr:`peak_snapshot`). Costs one copy of the live
            set each time memory is freed right after a new peak; meant for debugging.
        labeler: Called when a storage is first counted; its label is summed in :attr:`peak_by_label` (what was live
            at the peak, by label). :meth:`relabel` moves a storage to another label later.
        record_events: Log every allocation and free in :attr:`events`, in order: ``("a", key, nbytes, stream)``
            and ``("f", key)`` (``stream``: the innermost of ``STREAM``, else ``"default"``); a resize in place is
            a free and an allocation. The allocator model replays them (hf_upipe.planning.reserved.replay).

    Attributes:
        phase_peaks: ``{name: peak bytes}`` filled by :meth:`mark`, in the order the phases were first marked.
    """

    def __init__(
        self,
        snapshot_at_peak: bool = False,
        labeler: Callable[[], str] | None = None,
        record_events: bool = False,
    ) -> None:
        super().__init__()
        self.events: list[tuple] | None = [] if record_events else None
        self.snapshot_at_peak = snapshot_at_peak
        self.labeler = labeler
        self._at_peak = snapshot_at_peak or labeler is not None  # keep state as of the peak
        self._label_of: dict[int, str] = {}  # storage key -> label (only with a labeler)
        self._label_bytes: dict[str, int] = {}  # label -> live bytes
        self._peak_labels: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self._live: dict[int, int] = {}  # storage key -> nbytes
        self._host_live: dict[
            int, int
        ] = {}  # host memory: storage key -> nbytes (`host_memory`, `to_host`)
        self._host_current = 0
        self._host_peak = 0
        self._records: dict[int, StorageRecord] = {}  # only with snapshot_at_peak
        self._current = 0
        self._peak = 0
        self._phase_peak = 0
        self._snapshot: list[StorageRecord] = []
        self._snapshot_pending = self._at_peak
        self._lock = threading.RLock()  # finalizers may run on another thread

    # ------------------------------------------------------------------ counters
    @property
    def current_bytes(self) -> int:
        """Bytes of tracked storages that are still alive."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since the tracker was created or :meth:`reset_peak` was last called."""
        return self._peak

    @property
    def host_bytes(self) -> int:
        """Bytes of live host-memory storages (`host_memory`, `to_host`), not in ``current_bytes``."""
        return self._host_current

    @property
    def host_peak_bytes(self) -> int:
        """Highest ``host_bytes`` since the tracker was created."""
        return self._host_peak

    def move_to_host(self, *tensors: torch.Tensor) -> None:
        """The tracked device storages of `tensors` become host memory (freed on the device, at the same size)."""
        for t in _inner_tensors(tensors):
            found = _storage_key(t)
            if found is None or found[0] not in self._live:
                continue
            with self._lock:
                nbytes = self._drop_device(found[0])
                self._add_host(found[0], nbytes)

    @property
    def num_live_storages(self) -> int:
        """Number of tracked storages that are still alive."""
        return len(self._live)

    @property
    def peak_snapshot(self) -> list[StorageRecord]:
        """Storages live at the last peak, largest first. Empty unless ``snapshot_at_peak=True``."""
        with self._lock:
            if self._snapshot_pending:
                self._take_snapshot()
            return list(self._snapshot)

    @property
    def peak_by_label(self) -> dict[str, int]:
        """``{label: bytes}`` of the storages live at the last peak (needs a ``labeler``), largest first."""
        with self._lock:
            if self._snapshot_pending:
                self._take_snapshot()
            return dict(sorted(self._peak_labels.items(), key=lambda kv: -kv[1]))

    def relabel(self, t: torch.Tensor, label: str) -> None:
        """Moves a tracked tensor's storage to ``label`` (e.g. a checkpointed input, known only once it is saved)."""
        found = _storage_key(t)
        with self._lock:
            if self.labeler is None or found is None or found[0] not in self._live:
                return
            key, nbytes = found[0], self._live[found[0]]
            old = self._label_of[key]
            self._label_bytes[old] -= nbytes
            self._label_bytes[label] = self._label_bytes.get(label, 0) + nbytes
            self._label_of[key] = label

    def reset_peak(self) -> None:
        """Sets ``peak_bytes`` to ``current_bytes`` (phase marks are not affected)."""
        with self._lock:
            self._peak = self._current
            self._snapshot_pending = self._at_peak

    def mark(self, name: str) -> int:
        """Ends a phase: records the peak since the previous mark (or since creation) as ``phase_peaks[name]``.

        The next phase's peak starts from ``current_bytes``. Marking the same name again keeps the larger of the two
        peaks, so a phase can be marked once per training step.

        Args:
            name: Phase label, e.g. ``"forward"`` or ``"backward"``.

        Returns:
            The peak bytes of the phase that just ended.
        """
        with self._lock:
            peak = self._phase_peak
            self.phase_peaks[name] = max(peak, self.phase_peaks.get(name, 0))
            self._phase_peak = self._current
        return peak

    def track(self, *tensors: torch.Tensor) -> None:
        """Counts already existing tensors (inputs, parameters) as if they had been created inside the tracker.

        Storages that are already tracked, and tensors without a storage, are ignored. Inside ``host_memory()``
        they count as host memory.

        Args:
            *tensors: Tensors whose storages should be counted until they are freed.
        """
        for t in _inner_tensors(tensors):
            found = _storage_key(t)
            if found is not None and found[0] not in self._live and found[0] not in self._host_live:
                self._add(found[0], found[1], t, "track")

    def summary(self) -> str:
        """Returns a one-line human-readable report in GiB."""
        phases = ", ".join(f"{k}={v / GiB:.3f}" for k, v in self.phase_peaks.items())
        text = f"current={self._current / GiB:.3f} GiB, peak={self._peak / GiB:.3f} GiB"
        return f"{text}, phases: {phases}" if phases else text

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, key: int, storage: torch.UntypedStorage, t: torch.Tensor, op: str) -> None:
        nbytes = storage.nbytes()
        if HOST:
            with self._lock:
                self._add_host(key, nbytes)
            weakref.finalize(storage, self._free, key).atexit = False
            return
        with self._lock:
            self._live[key] = nbytes
            self._log_alloc(key, nbytes)
            if self.snapshot_at_peak:
                self._records[key] = StorageRecord(tuple(t.shape), t.dtype, nbytes, op)
            if self.labeler is not None:
                label = LABEL_OVERRIDE[-1] if LABEL_OVERRIDE else self.labeler()
                self._label_of[key] = label
                self._label_bytes[label] = self._label_bytes.get(label, 0) + nbytes
            self._grow(nbytes)
        fin = weakref.finalize(storage, self._free, key)
        fin.atexit = False

    def _resize(self, key: int, storage: torch.UntypedStorage) -> None:
        """Follows a tracked storage that an in-place op or ``out=`` resized."""
        nbytes = storage.nbytes()
        with self._lock:
            delta = nbytes - self._live.get(key, nbytes)
            if delta == 0:
                return
            if delta < 0 and self._snapshot_pending:
                self._take_snapshot()
            self._live[key] = nbytes
            if self.events is not None:
                self.events.append(("f", key))
                self._log_alloc(key, nbytes)
            if key in self._records:
                self._records[key] = self._records[key]._replace(nbytes=nbytes)
            if key in self._label_of:
                self._label_bytes[self._label_of[key]] += delta
            self._grow(delta)

    def _log_alloc(self, key: int, nbytes: int) -> None:
        if self.events is not None and nbytes:
            self.events.append(("a", key, nbytes, STREAM[-1] if STREAM else "default"))

    def _grow(self, delta: int) -> None:
        self._current += delta
        if self._current > self._phase_peak:
            self._phase_peak = self._current
        if self._current > self._peak:
            self._peak = self._current
            self._snapshot_pending = self._at_peak

    def _free(self, key: int) -> None:
        with self._lock:
            if key in self._host_live:
                self._host_current -= self._host_live.pop(key)
            elif key in self._live:
                self._drop_device(key)

    def _add_host(self, key: int, nbytes: int) -> None:
        self._host_live[key] = nbytes
        self._host_current += nbytes
        self._host_peak = max(self._host_peak, self._host_current)

    def _drop_device(self, key: int) -> int:
        """Removes a live device storage from the device's counts (a free); its bytes."""
        if self._snapshot_pending:
            # The live set only grew since the last peak, so it *is* the live set at the peak.
            self._take_snapshot()
        nbytes = self._live.pop(key)
        if self.events is not None:
            self.events.append(("f", key))
        self._current -= nbytes
        self._records.pop(key, None)
        label = self._label_of.pop(key, None)
        if label is not None:
            self._label_bytes[label] -= nbytes
        return nbytes

    def _take_snapshot(self) -> None:
        if self.snapshot_at_peak:
            self._snapshot = sorted(self._records.values(), key=lambda r: r.nbytes, reverse=True)
        self._peak_labels = {k: v for k, v in self._label_bytes.items() if v}
        self._snapshot_pending = False

    # ------------------------------------------------------------------ storage resizes
    def __enter__(self):
        with _RESIZE_LOCK:
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _tracked_resize
            _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with _RESIZE_LOCK:
                _ACTIVE.remove(self)
                if not _ACTIVE:
                    del torch.UntypedStorage.resize_  # the C method again

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place: follow a tracked one; count one that grows from nothing as new."""
        key = storage._cdata
        if key in self._live:
            self._resize(key, storage)
        elif storage.nbytes() > 0 and key not in self._host_live:
            self._add(
                key,
                storage,
                torch.empty(0, dtype=torch.uint8, device="meta"),
                "UntypedStorage.resize_",
            )

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # half of a step's dispatches: the autograd engine asks each tensor's device (no storage)
        if func is _PRIM_DEVICE:
            return out
        inputs = None  # the inputs' storage keys, gathered once an output needs them
        for t in _inner_tensors(_tensor_leaves(out)):
            found = _storage_key(t)
            if found is None:
                continue
            key, storage = found
            if key in self._live:
                self._resize(key, storage)  # no-op unless an in-place op / out= changed its size
                continue
            if key in self._host_live:
                continue
            if inputs is None:
                inputs = _storage_keys(_tensor_leaves((args, kwargs)))
            if key not in inputs and not _pinned_host(t):
                self._add(key, storage, t, str(func))
        return out
