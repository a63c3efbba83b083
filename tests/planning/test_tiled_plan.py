"""The planner's view of the tiled attention backward (`hf_upipe.ops.tiled_backward`): the attention allowance
counts the tokens of one tile where the backward is tiled, the tiles' fp32 accumulators are simulated tensors, and
the step-time model charges the tiles' extra traffic."""

import pytest
import torch

from hf_upipe.models.presets import resolve
from hf_upipe.ops.tiled_backward import ENV
from hf_upipe.planning.reserved import UNSEEN_PER_TOKEN, Allowance, kernel_call_tokens
from hf_upipe.planning.step_time import step_time
from hf_upipe.planning.train_step import StepSettings

STACK = dict(tiled_mlp=True, offload="cpu")
M8 = 8 * 2**20


def _llama():
    return resolve("llama3-8b")[1]


def test_allowance_counts_one_tile(monkeypatch):
    cfg, fused = _llama(), StepSettings("fused", 1, **STACK)
    rate = UNSEEN_PER_TOKEN[("fused", 1)]
    monkeypatch.delenv(ENV, raising=False)
    assert Allowance().attention_workspace(cfg, fused, M8, 8) == 2**18 * rate
    assert (
        Allowance().attention_workspace(cfg, fused, 2**17, 8) == 2**17 * rate
    )  # shorter than a tile
    ring = StepSettings("fused", 1, ring_size=2, **STACK)
    assert kernel_call_tokens(cfg, ring, 2**18) == 2**17  # the ring's shard
    deepspeed = StepSettings("deepspeed", None, **STACK)
    assert kernel_call_tokens(cfg, deepspeed, M8) == M8  # not ours: not tiled
    windowed = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg, sliding_window=4096)
    assert kernel_call_tokens(windowed, fused, M8) == M8  # a window wraps the kernel: not tiled
    # a window switched off (Qwen's use_sliding_window=False), or layer kinds all full attention: tiled
    assert kernel_call_tokens(dict(windowed, use_sliding_window=False), fused, M8) == 2**18
    full = dict(windowed, layer_types=["full_attention"] * 32)
    assert kernel_call_tokens(full, fused, M8) == 2**18
    mixed = dict(windowed, layer_types=["sliding_attention", "full_attention"] * 16)
    assert kernel_call_tokens(mixed, fused, M8) == M8
    monkeypatch.setenv(ENV, "0")
    assert Allowance().attention_workspace(cfg, fused, M8, 8) == M8 * rate
    monkeypatch.setenv(ENV, str(2**20))
    assert kernel_call_tokens(cfg, fused, M8) == 2**20


def test_step_time_charges_the_tiles(monkeypatch):
    cfg, fused = _llama(), StepSettings("fused", 1, **STACK)
    monkeypatch.delenv(ENV, raising=False)
    short = step_time(cfg, fused, seq_len=2**18, sp_size=8, world=8, gpus_per_node=8)
    assert short.parts["attention_tiles"] == 0.0  # one tile: the kernel's own call
    tiled = step_time(cfg, fused, seq_len=M8, sp_size=8, world=8, gpus_per_node=8)
    monkeypatch.setenv(ENV, "0")
    whole = step_time(cfg, fused, seq_len=M8, sp_size=8, world=8, gpus_per_node=8)
    extra = tiled.parts["attention_tiles"]
    # 32 tiles per call: 528 tile calls per stage, 4 stages, 32 layers; each adds 256K x 128 x 3 x 10 bytes
    hbm = 3.35e12 * 0.8
    per_layer = 4 * ((528 * 2**18 * 128 * 3 * 10 + M8 * 128 * 3 * 6) / hbm + 527 * 20e-6)
    assert extra == pytest.approx(32 * per_layer)
    assert tiled.seconds == pytest.approx(whole.seconds + extra)
    assert 0 < extra < 0.002 * whole.seconds


@pytest.mark.parametrize("h,hk", [(1, 1), (4, 1)], ids=["keys-outer", "queries-outer"])
def test_simulation_holds_the_fp32_accumulators(h, hk):
    """On fake tensors the tiled backward allocates what it allocates on a GPU, each tile's outputs and
    accumulators and the float32 buffer of one side, so the planner's simulated tensors count them: with one
    head (keys outer) the peak is the end, dq fp32 beside its bf16 cast and dk, dv; with four query heads on one
    k/v head (queries outer) it is in the loop; against dq, dk, dv of the kernel's own call."""
    from hf_upipe.ops.kernels import get_kernel
    from hf_upipe.ops.tiled_backward import tiled_backward
    from hf_upipe.planning.simulate import fake_tensors
    from hf_upipe.planning.tracker import MemoryTracker

    kern = get_kernel("sdpa", "cpu", torch.bfloat16)
    S, T, D = 2**14, 2**11, 128
    peaks = {}
    with fake_tensors():
        q, dout, out = (torch.empty(1, S, h, D, dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.empty(1, S, hk, D, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.empty(1, h, S)
        for block in (0, T):
            with MemoryTracker() as tracker:
                grads = tiled_backward(
                    kern, dout, q, k, v, out, lse, scale=1.0, causal=True, block=block
                )
                del grads
            peaks[block] = tracker.peak_bytes
    assert peaks[0] == S * D * 2 * (h + 2 * hk)
    if h <= 2 * hk:
        assert peaks[T] == S * D * (4 * h + 2 * h + 2 * 2 * hk)
    else:
        # in the loop: dq, dk and dv fp32, and one tile's dq, dk, dv, its fp32 dq and log-sum-exp rows
        assert peaks[T] == S * D * (2 * h + 8 * hk) + T * D * (2 * h + 4 * hk + 4 * h) + T * h * 4
