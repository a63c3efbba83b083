"""Offload the layer inputs that activation checkpointing keeps: to host memory (CUDA) or to files (any device).

Entry points:
- `offload_checkpoints(model, target="disk", *, path=None, keep_last=True, min_bytes=1 MiB, max_pending=2,
  prefetch=False)`: a
  context manager around ONE training step (forward and backward). While it is active, the model's checkpointed
  layers (transformers' `GradientCheckpointingLayer`s with activation checkpointing on, non-reentrant) save their
  inputs through `OffloadStore`; on exit (normal or exception) the layers get their own checkpoint function back,
  and every file and host buffer of the step is released.
- `OffloadStore(target, path=None, min_bytes=..., max_pending=2, prefetch=False)`: the pack/unpack pair for
  `torch.autograd.graph.saved_tensors_hooks`, usable on its own.

How: non-reentrant `torch.utils.checkpoint` saves a checkpointed layer's inputs as ordinary saved tensors, before
it enters its own (inner) saved-tensor hooks for the layer's body. An outer `saved_tensors_hooks` installed only
around the checkpoint call therefore sees exactly those inputs, nothing saved inside the layer and nothing saved
outside checkpointed layers. The hook is set through the layer's `_gradient_checkpointing_func`, the attribute
transformers' `gradient_checkpointing_enable` itself sets; no torch or transformers class is replaced.

Targets:
- "disk": each input is written by a background thread to `<path>/upipe-offload-<pid>-<n>/<k>.pt` (at most
  `max_pending` writes in flight, holding their tensors: a bounded buffer pool) and read back when the backward
  recomputes the layer; the round trip is bit-exact. Files are deleted as soon as autograd frees the saved input,
  and the step's folder on exit.
- "cpu": copies into pinned host buffers (`HOST_POOL`, reused across steps, bounded) on a side CUDA stream; in
  backward each input is copied back when its layer's recompute needs it, so one offloaded layer input is on the
  device at a time. With `prefetch=True`, unpacking layer i also starts the copy back of layer i-1's input, which
  hides that copy behind layer i's backward but holds two layer inputs on the device through it (at 573,440 tokens
  of hidden 4096 in bf16, 4.375 GiB more at the step's peak, for about 0.09 s per layer of PCIe time: the planner
  prices the unhidden copy in `hf_upipe.planning.step_time`). For tensors already in host
  memory this target is a no-op, except fake tensors (`hf_upipe.ops.fake`), which stand for device
  memory: their "copy" frees the device tensor and the copy back allocates a new one, so the simulation counts
  exactly what a GPU would hold.
`keep_last` leaves the last checkpointed layer's input on the device: the backward needs it first.

A frozen embedding (LoRA) makes the first layer's input a tensor that needs no gradient, so transformers'
`enable_input_require_grads` hook (which `activation_checkpointing_enable` installs) turns it into a leaf that
requires one. A leaf is held by its gradient accumulator, and so by the autograd graph, until the backward ends:
offloaded or not, its device memory stayed (one layer input more on the device through the whole backward than a
full fine-tune). While `offload_checkpoints` is active, the input embeddings' output is instead handed on as a
non-leaf alias that requires grad (`_GradientRoot`, rooted at an empty anchor), which nothing in the graph holds;
the gradient of that leaf was never read (the embedding is frozen), so every other gradient is unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, ContextManager

import torch
from torch import nn

from hf_upipe.ops.fake import is_fake

__all__ = [
    "HOST_POOL",
    "HostBufferPool",
    "OffloadStore",
    "checkpointed_layers",
    "offload_checkpoints",
]

TARGETS = ("none", "cpu", "disk")
RESTORE_STREAM = "default"
"""The CUDA stream whose allocator pool holds the "cpu" target's copies back to the device: the compute stream's
(the copy itself runs on the side stream, into a block allocated on the compute stream)."""


class _Handle:
    """What the pack hook returns in place of an offloaded tensor."""

    __slots__ = (
        "shape",
        "dtype",
        "device",
        "path",
        "future",
        "host",
        "event",
        "prefetched",
        "release",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.path = self.future = self.host = self.event = self.prefetched = self.release = None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class HostBufferPool:
    """Host (pinned on CUDA machines) buffers reused across steps, keyed by (shape, dtype); at most `max_bytes`
    of free buffers are kept, the rest are released. One process-wide pool: `HOST_POOL`."""

    def __init__(self, max_bytes: int = 64 * 2**30):
        self.max_bytes = max_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.free_bytes = 0
        self.allocated = (
            0  # buffers ever created (a pool that reuses them stops growing after one step)
        )

    def take(self, shape, dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                buf = free.pop()
                self.free_bytes -= buf.numel() * buf.element_size()
                return buf
            self.allocated += 1
        # device="cpu" explicitly: under a default device (`torch.set_default_device("cuda")`, `with
        # torch.device(...)`) a bare torch.empty would land there, and pinning a CUDA tensor is an error
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())

    def give(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        with self._lock:
            if self.free_bytes + nbytes <= self.max_bytes:
                self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
                self.free_bytes += nbytes


HOST_POOL = HostBufferPool()


class OffloadStore:
    """pack/unpack hooks that move tensors of at least `min_bytes` to disk ("disk") or pinned host memory ("cpu").

    Args:
        target: "disk" or "cpu".
        path: parent folder for "disk" (default: the system temp folder); a fresh subfolder is used per store.
        min_bytes: smaller tensors stay where they are.
        max_pending: disk writes in flight at once (each holds its tensor until written).
        restore_context: a factory of the context each copy back to the device runs in (a re-allocation an
            observer may want to see, e.g. the planner's memory label); default none.
        prefetch: "cpu" target: also start copying back the previous layer's input when a layer's is unpacked
            (two inputs on the device through each layer's backward instead of one; module docstring).
    """

    def __init__(
        self,
        target: str,
        path: str | None = None,
        *,
        min_bytes: int = 2**20,
        max_pending: int = 2,
        restore_context: Callable[[], ContextManager] | None = None,
        prefetch: bool = False,
    ):
        if target not in ("cpu", "disk"):
            raise ValueError(
                f"offload target {target!r}: use 'cpu' (pinned host memory, CUDA) or 'disk' (any device)."
            )
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.target, self.min_bytes, self.prefetch = target, min_bytes, prefetch
        self.restore_context = restore_context or contextlib.nullcontext
        self.folder = None
        if target == "disk":
            parent = path or tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix=f"upipe-offload-{os.getpid()}-", dir=parent)
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="upipe-offload")
            self._slots = threading.BoundedSemaphore(max_pending)
        self._ids = itertools.count()
        self._order: list[weakref.ref] = []  # handles in pack order (prefetch walks it backwards)
        self._stream = None
        self.files_written = 0
        self.bytes_offloaded = 0

    # ---- hooks ----
    def stays(self, t: torch.Tensor) -> bool:
        """Whether `t` is kept as is: small, or already in host memory for the "cpu" target."""
        on_host = t.device.type == "cpu" and not is_fake(t)
        return t.numel() * t.element_size() < self.min_bytes or (self.target == "cpu" and on_host)

    def pack(self, t: torch.Tensor):
        if self.stays(t):
            return t
        nbytes = t.numel() * t.element_size()
        handle = _Handle(t)
        if self.target == "disk":
            self._write(handle, t)
        else:
            self._to_host(handle, t)
        self.bytes_offloaded += nbytes
        self._order.append(weakref.ref(handle))
        return handle

    def unpack(self, obj):
        if isinstance(obj, torch.Tensor):
            return obj
        if self.target == "disk":
            obj.future.result()  # re-raises a failed write
            return torch.load(obj.path, weights_only=True).to(obj.device)
        if self.prefetch:
            self._prefetch_previous(obj)
        return self._from_host(obj)

    # ---- disk ----
    def _write(self, handle: _Handle, t: torch.Tensor) -> None:
        handle.path = os.path.join(self.folder, f"{next(self._ids)}.pt")
        handle.release = weakref.finalize(
            handle, _remove, handle.path
        )  # once autograd frees the saved input
        data = t.detach()
        if (
            data.untyped_storage().nbytes() != data.numel() * data.element_size()
            or not data.is_contiguous()
        ):
            data = (
                data.contiguous().clone()
            )  # torch.save writes whole storages: never write a view's base
        self._slots.acquire()  # bounded: at most max_pending tensors wait for the disk
        future = self._writer.submit(torch.save, data.to("cpu"), handle.path)
        future.add_done_callback(lambda _: self._slots.release())
        handle.future = future
        self.files_written += 1

    # ---- host memory ----
    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, handle: _Handle, t: torch.Tensor) -> None:
        if is_fake(t):  # simulation: the device copy is released; _copy_back allocates a new one
            handle.host = "fake"
            return
        host = HOST_POOL.take(t.shape, t.dtype)
        stream = self._side_stream(t.device)
        if stream is None:
            host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)
                handle.event = torch.cuda.Event()
                handle.event.record(stream)
        handle.host = host
        handle.release = weakref.finalize(
            handle, HOST_POOL.give, host
        )  # once autograd frees the saved input

    def _copy_back(self, handle: _Handle) -> torch.Tensor:
        with self.restore_context():
            return self._copy_back_in_context(handle)

    def _copy_back_in_context(self, handle: _Handle) -> torch.Tensor:
        if handle.host == "fake":
            return torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        stream = self._side_stream(handle.device)
        if stream is None:
            return handle.host.to(handle.device, copy=True)
        # Allocated on the compute stream, so its block returns to the pool the compute stream reuses (a block
        # allocated on the side stream would stay cached for the side stream only). The side stream first waits for
        # the compute stream's queued work, which may still use that memory, then writes it.
        out = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        stream.wait_stream(torch.cuda.current_stream(handle.device))
        with torch.cuda.stream(stream):
            if handle.event is not None:
                stream.wait_event(handle.event)
            out.copy_(handle.host, non_blocking=True)
            out.record_stream(
                stream
            )  # a copy still in flight keeps its block (e.g. a prefetch never used)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        return out

    def _prefetch_previous(self, handle: _Handle) -> None:
        """Start copying back the input packed just before `handle` (the layer the backward reaches next)."""
        for i, ref in enumerate(self._order):
            if ref() is handle:
                prev = self._order[i - 1]() if i > 0 else None
                if prev is not None and prev.prefetched is None and prev.host is not None:
                    prev.prefetched = self._copy_back(prev)
                return

    def _from_host(self, handle: _Handle) -> torch.Tensor:
        out, handle.prefetched = (
            (handle.prefetched, None)
            if handle.prefetched is not None
            else (self._copy_back(handle), None)
        )
        if handle.event is not None:
            torch.cuda.current_stream(handle.device).wait_event(handle.event)
        return out

    # ---- lifetime ----
    def close(self) -> None:
        """Wait for pending writes, then release every file and host buffer of the step, also after a failure.

        A backward that raises can leave its graph alive in a reference cycle through autograd's C++ nodes, which
        Python's collector cannot free; the handles it still holds are released here (each at most once), so
        neither files nor buffers outlive the step.
        """
        if self.folder is not None:
            self._writer.shutdown(wait=True)
        for ref in self._order:
            handle = ref()
            if handle is not None and handle.release is not None:
                handle.release()  # weakref.finalize: runs once, now or never again
                handle.host = handle.prefetched = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._order.clear()


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that run under transformers' activation checkpointing, in model order."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False)
        and callable(getattr(m, "_gradient_checkpointing_func", None))
    ]


@contextmanager
def offload_checkpoints(
    model: nn.Module,
    target: str = "disk",
    *,
    path: str | None = None,
    keep_last: bool = True,
    min_bytes: int = 2**20,
    max_pending: int = 2,
    restore_context: Callable[[], ContextManager] | None = None,
    prefetch: bool = False,
):
    """Offload the checkpointed layers' saved inputs for the forward and backward run inside this block.

    Args:
        model: a transformers model (plain, PEFT or wrapped) with activation checkpointing enabled.
        target: "disk", "cpu" or "none" (then nothing changes).
        path: parent folder for "disk" files.
        keep_last: keep the last checkpointed layer's input where it is.
        min_bytes: inputs smaller than this stay where they are.
        max_pending: disk writes in flight at once.
        restore_context, prefetch: see `OffloadStore`.

    Yields:
        The `OffloadStore` (None for "none"): `files_written`, `bytes_offloaded`.

    Raises:
        ValueError: unknown target, or activation checkpointing is off (nothing would be offloaded).
    """
    if target not in TARGETS:
        raise ValueError(f"offload target {target!r}: use one of {TARGETS}.")
    if target == "none":
        yield None
        return
    layers = checkpointed_layers(model)
    if not layers:
        raise ValueError(
            "offload_checkpoints needs activation checkpointing: call "
            "model.activation_checkpointing_enable() (or TrainingArguments("
            "activation_checkpointing=True)), or use offload target 'none'."
        )
    store = OffloadStore(
        target,
        path,
        min_bytes=min_bytes,
        max_pending=max_pending,
        restore_context=restore_context,
        prefetch=prefetch,
    )
    originals = [(layer, layer._gradient_checkpointing_func) for layer in layers]
    embeddings = _input_embeddings(model)
    rooted = (
        None if embeddings is None else embeddings.register_forward_hook(_unpinned_embedding_output)
    )
    try:
        for layer, original in originals[:-1] if keep_last else originals:
            layer._gradient_checkpointing_func = _offloading(original, store)
        yield store
    finally:
        for layer, original in originals:
            layer._gradient_checkpointing_func = original
        if rooted is not None:
            rooted.remove()
        store.close()


class _GradientRoot(torch.autograd.Function):
    """x's alias that requires grad through an empty `anchor` leaf, so the graph holds no tensor of x's size."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _unpinned_embedding_output(module, args, output):
    """Forward hook (after transformers' `enable_input_require_grads`): a leaf output that requires grad (a frozen
    embedding made to) becomes a non-leaf alias, so the graph does not keep it for the whole backward (module
    docstring). Any other output is left as it is."""
    if isinstance(output, torch.Tensor) and output.requires_grad and output.grad_fn is None:
        anchor = torch.empty(0, device=output.device, requires_grad=True)
        return _GradientRoot.apply(anchor, output.detach())
    return None


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's input embedding module (plain, PEFT or wrapped), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None


def _offloading(checkpoint_fn, store: OffloadStore):
    """The layer's checkpoint function, called with the store's hooks around it (they see only its inputs)."""
    keywords = getattr(checkpoint_fn, "keywords", {}) or {}
    if keywords.get("use_reentrant", False):
        raise ValueError(
            "offload_checkpoints needs non-reentrant activation checkpointing (the transformers 5 "
            "default): drop use_reentrant=True from the checkpointing kwargs."
        )

    def run(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
            return checkpoint_fn(*args, **kwargs)

    return run
