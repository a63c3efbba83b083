"""Offloaded checkpoint inputs: bit-identical gradients, inputs really leave memory, nothing is left behind."""

import functools
import os
import time

import pytest
import torch

from hf_upipe.planning.tracker import MemoryTracker
from hf_upipe.training.offload import offload_checkpoints
from tests.integrations._models import tiny_config

B, S, LAYERS, HIDDEN = 2, 64, 4, 48


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", layers=LAYERS), attn_implementation="sdpa"
    )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _batch():
    ids = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _grads(model, ctx):
    model.zero_grad()
    with ctx as store:
        loss = model(**_batch()).loss
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, store


@pytest.mark.parametrize("force_host_copy", [False, True])
def test_offload_gives_bit_identical_gradients(tmp_path, force_host_copy):
    model = _model()
    ref, _ = _grads(model, offload_checkpoints(model, "none"))
    if force_host_copy:  # the "cpu" target's buffer/prefetch path, run synchronously on CPU tensors
        from hf_upipe.training import offload as mod

        original = mod.OffloadStore.stays
        mod.OffloadStore.stays = lambda self, t: t.numel() * t.element_size() < self.min_bytes
        try:
            got, store = _grads(model, offload_checkpoints(model, "cpu", min_bytes=0))
        finally:
            mod.OffloadStore.stays = original
        assert store.bytes_offloaded == (LAYERS - 1) * B * S * HIDDEN * 4
    else:
        got, store = _grads(
            model, offload_checkpoints(model, "disk", path=str(tmp_path), min_bytes=0)
        )
        assert store.files_written == LAYERS - 1  # every layer input but the last one's
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert os.listdir(tmp_path) == []  # the step's folder is gone
    assert all(
        isinstance(layer._gradient_checkpointing_func, functools.partial)
        for layer in model.model.layers
    )  # the layers got their own checkpoint function back


def test_offload_removes_checkpointed_inputs_from_memory(tmp_path):
    model = _model()
    live = {}
    for target in ("none", "disk"):
        with offload_checkpoints(model, target, path=str(tmp_path), min_bytes=0) as store:
            with MemoryTracker() as tracker:
                loss = model(**_batch()).loss
                live[target] = tracker.current_bytes  # after forward: what the backward will need
            if store is not None:
                # the writes run on a background thread: wait (bounded) for them to land
                deadline = time.monotonic() + 60
                while len(os.listdir(store.folder)) < LAYERS - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert len(os.listdir(store.folder)) == LAYERS - 1
                on_disk = sum(
                    os.path.getsize(os.path.join(store.folder, f)) for f in os.listdir(store.folder)
                )
            loss.backward()
    one_input = B * S * HIDDEN * 4
    assert live["none"] - live["disk"] == (LAYERS - 1) * one_input
    assert on_disk >= (LAYERS - 1) * one_input
    assert os.listdir(tmp_path) == []


def test_failed_backward_leaves_no_files(tmp_path):
    model = _model()
    seen = []

    def explode(grad):
        seen.append(sum(len(files) for _, _, files in os.walk(tmp_path)))
        raise RuntimeError("boom in backward")

    model.model.layers[1].mlp.down_proj.weight.register_hook(explode)
    with pytest.raises(RuntimeError, match="boom in backward"):
        with offload_checkpoints(model, "disk", path=str(tmp_path), min_bytes=0):
            model(**_batch()).loss.backward()
    assert seen and seen[0] >= 1  # files existed while the backward ran
    assert os.listdir(tmp_path) == []


def test_errors_name_the_fix():
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1))
    with pytest.raises(ValueError, match="needs activation checkpointing"):
        with offload_checkpoints(plain, "disk"):
            pass
    with pytest.raises(ValueError, match="use one of"):
        with offload_checkpoints(plain, "nvme"):
            pass
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        with offload_checkpoints(plain, "disk", keep_last=False):
            pass


def test_host_buffers_are_reused_across_steps_and_returned_after_a_failure(monkeypatch):
    """The "cpu" target's buffer pool (its CPU-tensor path forced): the second step allocates nothing new, and a
    backward that raises gives every buffer back."""
    from hf_upipe.training import offload as mod

    monkeypatch.setattr(mod, "HOST_POOL", mod.HostBufferPool())
    model = _model()
    original = mod.OffloadStore.stays
    mod.OffloadStore.stays = lambda self, t: t.numel() * t.element_size() < self.min_bytes
    try:
        before = mod.HOST_POOL.allocated
        _grads(model, offload_checkpoints(model, "cpu", min_bytes=0))
        first = mod.HOST_POOL.allocated - before
        free_after_first = mod.HOST_POOL.free_bytes
        _grads(model, offload_checkpoints(model, "cpu", min_bytes=0))
        assert (
            first == LAYERS - 1 and mod.HOST_POOL.allocated - before == first
        )  # reused, not reallocated
        hook = model.model.layers[1].mlp.down_proj.weight.register_hook(
            lambda g: (_ for _ in ()).throw(RuntimeError("boom"))
        )
        with pytest.raises(RuntimeError, match="boom"):
            with offload_checkpoints(model, "cpu", min_bytes=0):
                model(**_batch()).loss.backward()
        hook.remove()
        import gc

        gc.collect()
        assert mod.HOST_POOL.free_bytes == free_after_first  # every buffer is back in the pool
    finally:
        mod.OffloadStore.stays = original


def test_host_buffers_stay_on_the_host_under_a_default_device():
    """A default device (`torch.set_default_device("cuda")`, `with torch.device(...)`) must not move the pinned host
    buffers there: on a GPU that was "Only dense CPU tensors can be pinned" (found by benchmarks/gpu/memory.py)."""
    from hf_upipe.training.offload import HostBufferPool

    pool = HostBufferPool()
    with torch.device(
        "meta"
    ):  # stands for "cuda" on this CPU-only machine: any non-CPU default device
        buf = pool.take((4, 3), torch.bfloat16)
    assert buf.device.type == "cpu" and buf.shape == (4, 3) and buf.dtype == torch.bfloat16


def test_copy_back_is_allocated_on_the_compute_stream(monkeypatch):
    """The CUDA path of the "cpu" target's copy back, with the stream API replaced by recorders: the device tensor
    is allocated outside the side stream's context (the compute stream's pool), the side stream waits for the
    compute stream before writing it, and the values are the host buffer's, bit for bit."""
    import contextlib

    from hf_upipe.planning.tracker import allocation_stream
    from hf_upipe.training import offload

    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            calls.append(("wait_event", self.name))

    class Event:
        def record(self, stream):
            calls.append(("record", stream.name))

    side, main = Stream("side"), Stream("main")

    @contextlib.contextmanager
    def stream(s):
        calls.append(("enter", s.name))
        with allocation_stream(s.name):
            yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append(("rs", s.name)))
    store = offload.OffloadStore("cpu")
    monkeypatch.setattr(store, "_side_stream", lambda device: side)
    saved = torch.randn(3, 5, 7)
    handle = offload._Handle(saved)
    handle.host = saved.clone()
    with MemoryTracker(record_events=True) as tracker:
        out = store._copy_back(handle)
    assert torch.equal(out, saved) and out.dtype == saved.dtype
    (alloc,) = [e for e in tracker.events if e[0] == "a"]
    assert alloc[3] == "default"  # not the side stream's pool
    assert calls.index(("wait_stream", "side", "main")) < calls.index(("enter", "side"))
    assert ("rs", "side") in calls and calls[-1] == ("record", "side")


def test_without_prefetch_one_layer_input_less_at_the_backwards_peak(monkeypatch):
    """The "cpu" target copies each input back when its layer needs it (the default): bit-identical gradients to
    no offload and to the prefetching store, and the tracker's backward peak is exactly one layer input lower
    (the prefetched previous input no longer waits beside the layer's backward). Run on CPU tensors through the
    host-copy path; the host buffers come from the warmed pool, so only the copies back are counted."""
    from hf_upipe.training import offload as mod

    monkeypatch.setattr(
        mod.OffloadStore, "stays", lambda self, t: t.numel() * t.element_size() < self.min_bytes
    )
    model = _model()
    ref, _ = _grads(model, offload_checkpoints(model, "none"))
    peak, grads = {}, {}
    for prefetch in (True, False, True, False):  # the first two warm the host pool
        # the gradients exist already: the peak is inside a layer's backward
        model.zero_grad(set_to_none=False)
        with offload_checkpoints(model, "cpu", min_bytes=0, prefetch=prefetch):
            loss = model(**_batch()).loss
            with MemoryTracker() as tracker:
                loss.backward()
        peak[prefetch] = tracker.peak_bytes
        grads[prefetch] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name in ref:
        assert torch.equal(grads[False][name], ref[name]), name
        assert torch.equal(grads[True][name], ref[name]), name
    assert peak[True] - peak[False] == B * S * HIDDEN * 4, peak


def _lora_model():
    from peft import LoraConfig

    from hf_upipe.models.peft import get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # as a run enables it: transformers then makes the frozen embedding's output require grad (a leaf)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_lora_first_layer_input_leaves_memory_like_the_others(tmp_path):
    """With a frozen embedding (LoRA) the first layer's input is a leaf that requires grad, which the autograd graph
    held through the whole backward, offloaded or not; it is now handed on as a non-leaf alias: every offloaded
    input leaves memory (tracked on a real step), and the adapters' gradients stay bit-identical."""
    model = _lora_model()
    emb = model.get_input_embeddings()(_batch()["input_ids"])
    assert emb.requires_grad and emb.grad_fn is None  # the case: a leaf that requires grad
    live, grads = {}, {}
    for target in ("none", "disk"):
        model.zero_grad()
        with offload_checkpoints(model, target, path=str(tmp_path), min_bytes=0) as store:
            with MemoryTracker() as tracker:
                loss = model(**_batch()).loss
                for ref in store._order if store is not None else []:  # the writes have landed
                    ref().future.result()
                live[target] = tracker.current_bytes  # after forward: what the backward will need
            loss.backward()
        grads[target] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert live["none"] - live["disk"] == (LAYERS - 1) * B * S * HIDDEN * 4
    assert grads["none"].keys() == grads["disk"].keys() and len(grads["none"]) == 2 * LAYERS * 2
    for name, g in grads["none"].items():
        assert torch.equal(grads["disk"][name], g), name
