"""Whole-model step memory: the fake simulation equals real gloo runs, and each stack piece removes what it should.

(a) `simulate_model_step` (rank 0 of a fake 2-rank world) gives exactly the tracked peaks of rank 0 of a real 2-rank
    gloo run on real fp32 tensors: a 3-layer Llama with checkpointing and the tiled loss, registered and fused
    UPipe, with and without the tiled MLP; also one decoder layer alone (`simulate_layer_step`).
(b) In the simulation, offloading the checkpointed inputs takes them off the device: the peak stops growing with
    the number of layers.
"""

from __future__ import annotations

import pytest
import torch

from hf_upipe.planning.activation_step import (
    measure_layer_step,
    measure_model_step,
    simulate_layer_step,
    simulate_model_step,
)
from hf_upipe.planning.model_step import StepCase, StepSettings
from tests._dist import run_distributed, settle_collectives

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=256,
)
CASES = [("upipe", False), ("fused", False), ("fused", True), ("ulysses", True)]
S, P = 512, 2


def _settings(impl: str, tiled: bool) -> StepSettings:
    """One head per chunk, checkpoints kept on the device, the tiled loss: the activation steps' stack."""
    return StepSettings(impl, 1, tiled_mlp=tiled, offload="none")


def _real(rank, world):
    import torch.distributed as dist

    settle_collectives()
    out = []
    for impl, tiled in CASES:
        case = StepCase(TINY, S, world, layers=3, dtype=torch.float32)
        r = measure_model_step(case, _settings(impl, tiled), group=dist.group.WORLD)
        out.append((r["forward_peak"], r["peak"]))
    case = StepCase(TINY, S, world, layers=1, dtype=torch.float32)
    layer = measure_layer_step(case, _settings("fused", True), group=dist.group.WORLD)
    return out, (layer["forward_peak"], layer["peak"])


def test_model_step_simulation_equals_real_gloo_run():
    real = run_distributed(_real, P)
    sim = []
    for impl, tiled in CASES:
        case = StepCase(TINY, S, P, layers=3, dtype=torch.float32)
        r = simulate_model_step(case, _settings(impl, tiled))
        sim.append((r["forward_peak"], r["peak"]))
    case = StepCase(TINY, S, P, layers=1, dtype=torch.float32)
    layer = simulate_layer_step(case, _settings("fused", True))
    assert real[0][0] == sim, (real[0][0], sim)
    assert real[0][1] == (layer["forward_peak"], layer["peak"])
    assert sim[2][1] < sim[1][1]  # the tiled MLP lowers the step's peak


@pytest.mark.slow
def test_offload_makes_the_peak_independent_of_depth():
    big = dict(
        TINY, hidden_size=256, intermediate_size=512, vocab_size=64
    )  # layer inputs dominate the loss
    peaks = {}
    for offload in ("none", "cpu"):
        for layers in (3, 6):
            case = StepCase(big, 8192, P, layers=layers, dtype=torch.float32)
            r = simulate_model_step(case, StepSettings("fused", 1, True, offload=offload))
            peaks[offload, layers] = r["peak"]
            unit = r["unit"]
    extra = peaks["none", 6] - peaks["none", 3]
    assert (
        3 * unit <= extra < 3 * unit + 1024
    )  # one checkpointed input per layer (+ a few bytes of bookkeeping)
    assert (
        abs(peaks["cpu", 6] - peaks["cpu", 3]) < 1024
        and peaks["none", 6] - peaks["cpu", 6] >= 3 * unit
    )
