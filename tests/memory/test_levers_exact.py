"""The memory levers in training: each exact against the run without it, and its saving measured by the tracker.

One FSDP2 run per lever, 3 AdamW steps of a 4-layer tiny Llama in fp32 with activation checkpointing, SP over all
ranks (2 and 4 gloo ranks), the same global batches:
- the tiled attention backward (`UPIPE_BACKWARD_BLOCK=5`: the kernel calls see 30 or 32 tokens, 6 or 7 tiles a
  side; counted) against the untiled run: the tiles sum dq over key tiles in float32, a legitimate reordering, so
  losses agree to rtol 1e-6 and final weights to atol 1e-6 (measured: at most 5.1e-7, a few float32 ulps, where 3
  AdamW steps of lr 2e-3 move a weight by up to 6e-3), not bit for bit;
- checkpoint offload to host without prefetch (the default) against with prefetch, and against no offload;
- checkpoint offload to disk against offload to host;
  all three bit for bit (the offload only moves the saved inputs).
The host target runs its host-copy path on CPU tensors (as `tests/memory/test_offload.py` does), with a fresh buffer
pool whose buffers the tracker counts as host memory. On the first step the tracker measures, per rank: what is
live on the device and on the host after the forward (disk: once its writes have landed), and the backward's peak.
(Disk's backward peak is not compared: on CPU `torch.load` makes the restored input without an aten op, so the
tracker does not see it; on a GPU its copy to the device is seen, and equals the host target's.)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import pytest
import torch

from tests._dist import run_distributed, settle_collectives

LAYERS, ROWS = 4, 4
BLOCK = 5  # tokens per tile of the attention backward in the tiled run
# name: (UPIPE_BACKWARD_BLOCK, checkpoint offload target, prefetch)
RUNS = {
    "plain": ("0", "none", False),
    "tiled": (str(BLOCK), "none", False),
    "cpu-prefetch": ("0", "cpu", True),
    "cpu": ("0", "cpu", False),
    "disk": ("0", "disk", False),
}


def _model():
    from transformers import AutoModelForCausalLM

    from tests.integrations._models import tiny_config

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", layers=LAYERS), attn_implementation="sdpa", dtype=torch.float32
    )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@contextlib.contextmanager
def _host_path_on_cpu():
    """The "cpu" target's host copies on CPU tensors (else a no-op there), its buffers from a fresh pool, created as
    host memory for the tracker."""
    from hf_upipe.planning.tracker import host_memory
    from hf_upipe.training import offload as mod

    stays, pool = mod.OffloadStore.stays, mod.HOST_POOL
    mod.OffloadStore.stays = lambda self, t: t.numel() * t.element_size() < self.min_bytes
    mod.HOST_POOL = mod.HostBufferPool()
    take = mod.HOST_POOL.take

    def take_on_host(shape, dtype):
        with host_memory():
            return take(shape, dtype)

    mod.HOST_POOL.take = take_on_host
    try:
        yield
    finally:
        mod.OffloadStore.stays, mod.HOST_POOL = stays, pool


def _landed(store) -> None:
    """Waits (bounded) until every disk write of `store` is a file."""
    deadline = time.monotonic() + 60
    while len(os.listdir(store.folder)) < store.files_written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir(store.folder)) == store.files_written


def _step(model, upipe, shard, n, offload, tracked: bool) -> tuple[torch.Tensor, dict]:
    """Forward and backward of one step inside the checkpoint offload; on `tracked` steps the tracker's figures."""
    from hf_upipe.planning.tracker import MemoryTracker
    from hf_upipe.training.offload import offload_checkpoints

    target, prefetch, path = offload
    seen = {}
    with offload_checkpoints(model, target, path=path, min_bytes=0, prefetch=prefetch) as store:
        with MemoryTracker() if tracked else contextlib.nullcontext() as tracker:
            loss = upipe.loss(model, shard, n)
            if tracked:
                if target == "disk":
                    _landed(store)
                seen["device_after_forward"] = tracker.current_bytes
                seen["host_after_forward"] = tracker.host_bytes
                seen["offloaded"] = 0 if store is None else store.bytes_offloaded
                tracker.reset_peak()
            loss.backward()
            if tracked:
                seen["backward_peak"] = tracker.peak_bytes
    return loss, seen


def _run(rank: int, world: int, block: str, offload: tuple) -> dict:
    """3 AdamW steps under FSDP2 with SP `world`: global losses, final weights, the first step's tracker figures,
    the number of tiled backward calls."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_upipe import UPipeConfig, init_sequence_parallel, prepare_model, shard_batch
    from hf_upipe.ops import tiled_backward as tb
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.training._plugin_runs import _batches

    os.environ[tb.ENV] = block
    tiled, tiles = [0], tb.tiles

    def counting(*args, **kwargs):
        yes = tiles(*args, **kwargs)
        tiled[0] += yes
        return yes

    tb.tiles = counting
    try:
        model = _model()
        cfg = UPipeConfig(sp_size=world, loss_chunk_tokens=7)
        state = init_sequence_parallel(world)
        prepare_model(model, cfg)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
        losses, seen = [], {}
        for i, full in enumerate(_batches(3, ROWS)):
            shard = shard_batch(full, state.sp_rank, state.sp_size)
            loss, tracked = _step(model, upipe, shard, upipe.count([shard]), offload, i == 0)
            seen.update(tracked)
            opt.step()
            opt.zero_grad()
            total = torch.tensor(loss.item() / world)
            torch.distributed.all_reduce(total)
            losses.append(total.item())
        weights = {
            n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()
        }
        # a layer's input: [rows, this rank's tokens, hidden] in fp32
        seen["layer_input"] = shard["input_ids"].numel() * model.config.hidden_size * 4
        return {"losses": losses, "weights": weights, "seen": seen, "tiled": tiled[0]}
    finally:
        tb.tiles = tiles
        del os.environ[tb.ENV]


def _all(rank: int, world: int) -> dict:
    settle_collectives()
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, (block, target, prefetch) in RUNS.items():
            with (
                _host_path_on_cpu()
            ):  # a fresh pool per run: its buffers are created inside the tracker
                out[name] = _run(rank, world, block, (target, prefetch, folder))
    return out


@pytest.fixture(scope="module")
def lever_runs():
    return {world: run_distributed(_all, world, timeout=600) for world in (2, 4)}


def _same(a: dict, b: dict, exact: bool, where) -> None:
    if exact:
        assert a["losses"] == b["losses"], (where, a["losses"], b["losses"])
    else:
        torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-6, atol=0)
    assert a["losses"][0] != a["losses"][-1], where  # the steps did train
    assert a["weights"].keys() == b["weights"].keys()
    for name, w in b["weights"].items():
        if exact:
            assert a["weights"][name] == w, (where, name)
        else:
            got, want = torch.tensor(a["weights"][name]), torch.tensor(w)
            # AdamW moves each weight by up to lr = 2e-3 a step; the tiles' reordering shifts it by float32 ulps,
            # except in the q/k projection biases, whose small gradients (near zero for k: docs/trainer.md) AdamW
            # divides by their own size: there 1e-3 of the tensor's largest entry, the rule of
            # tests/training/test_trainer.py (transformers 5.25's rounding moved q_proj.bias by 1.07e-6 at P = 4)
            scores = name.endswith(("q_proj.bias", "k_proj.bias"))
            atol = 1e-3 * float(want.abs().max()) if scores else 1e-6
            err = (got - want).abs()
            bad = err > atol + 1e-6 * want.abs()
            assert not bool(bad.any()), (where, name, float(err.max()), float(want.abs().max()))


@pytest.mark.slow
def test_tiled_attention_backward_is_exact_in_training(lever_runs):
    for world, ranks in lever_runs.items():
        for rank, out in enumerate(ranks):
            # every layer's backward was tiled, in every step
            assert out["tiled"]["tiled"] >= 3 * LAYERS, (world, rank)
            assert out["plain"]["tiled"] == 0
            _same(out["tiled"], out["plain"], exact=False, where=(world, rank))
            # the tracker sees tensors only: the tiles' float32 gradients (at most five of one tile, one head, every
            # row) are all the tiling adds; the kernel scratch it saves is not a tensor (a GPU measurement)
            tiled, plain = out["tiled"]["seen"], out["plain"]["seen"]
            assert tiled["device_after_forward"] == plain["device_after_forward"]
            tile = 5 * ROWS * BLOCK * 8 * 4  # head_dim 8
            assert 0 <= tiled["backward_peak"] - plain["backward_peak"] <= tile, (tiled, plain)


@pytest.mark.slow
def test_checkpoint_offload_without_prefetch_is_exact_and_holds_one_input_less(lever_runs):
    for world, ranks in lever_runs.items():
        for rank, out in enumerate(ranks):
            _same(out["cpu"], out["cpu-prefetch"], exact=True, where=(world, rank))
            _same(out["cpu"], out["plain"], exact=True, where=(world, rank))
            off, pre, plain = out["cpu"]["seen"], out["cpu-prefetch"]["seen"], out["plain"]["seen"]
            one = off["layer_input"]
            assert pre["backward_peak"] - off["backward_peak"] == one, (world, rank, pre, off)
            # offloaded: every layer input but the last leaves the device for the host
            assert plain["device_after_forward"] - off["device_after_forward"] == (LAYERS - 1) * one
            assert off["host_after_forward"] == off["offloaded"] == (LAYERS - 1) * one


@pytest.mark.slow
def test_checkpoint_offload_to_disk_is_exact_and_frees_the_host(lever_runs):
    for world, ranks in lever_runs.items():
        for rank, out in enumerate(ranks):
            _same(out["disk"], out["cpu"], exact=True, where=(world, rank))
            disk, host = out["disk"]["seen"], out["cpu"]["seen"]
            assert disk["device_after_forward"] == host["device_after_forward"], (disk, host)
            assert host["host_after_forward"] == (LAYERS - 1) * host["layer_input"]
            assert disk["host_after_forward"] == 0  # the inputs are files once written
