"""model_offload='cpu' in the measured and simulated step: what leaves the GPU, measured by the tracker.

A real 2-rank gloo step (`measure_train_step` on real tensors: FSDP2 with `CPUOffloadPolicy`, AdamW, checkpointing,
SP 2), full fine-tune in bf16 compute and LoRA in fp32, with and without the model offload:
- the tracker's device categories lose the optimizer's states and step, the fp32 parameter shards and the reduced
  gradient shards, which it counts in host memory instead (`host_peak`: at least the shards and AdamW's states);
- the planner's simulation (`simulate_train_step`, fake tensors, fake world) gives the same device peak, categories
  and host peak as the real step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_upipe.planning.train_step import (
    StepCase,
    StepSettings,
    measure_train_step,
    simulate_train_step,
)
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
S, WORLD, LAYERS = 512, 2, 3
LORA = (4, ("q_proj", "v_proj", "gate_proj"))
CASES = [(torch.bfloat16, None), (torch.float32, LORA)]  # (compute dtype, lora)


def _settings(model_offload: str) -> StepSettings:
    return StepSettings(impl="fused", offload="none", model_offload=model_offload)


def _real(rank, world):
    settle_collectives()
    out = {}
    for i, (dtype, lora) in enumerate(CASES):
        for mo in ("none", "cpu"):
            case = StepCase(TINY, S, sp_size=2, layers=LAYERS, dtype=dtype, lora=lora)
            r = measure_train_step(case, _settings(mo))
            out[i, mo] = {k: r[k] for k in ("peak", "by_category", "static", "host_peak")}
    return out


@functools.lru_cache(maxsize=1)
def real_runs() -> dict:
    return run_distributed(_real, WORLD)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=["full-bf16", "lora-fp32"])
def test_model_offload_moves_state_off_the_device(case):
    plain, off = real_runs()[case, "none"], real_runs()[case, "cpu"]
    static = plain["static"]
    assert off["static"] == static
    assert plain["host_peak"] == 0
    host_state = static["parameters"] + static["optimizer"] + static["gradients"]
    assert off["host_peak"] >= host_state, (off["host_peak"], static)
    assert off["by_category"].get("optimizer", 0) == 0  # states and step on the host
    assert plain["by_category"].get("optimizer", 0) >= static["optimizer"] > 0
    # the device keeps the gathered layers (and each shard's copy for its all-gather), not the fp32 shards
    assert off["by_category"]["parameters"] < plain["by_category"]["parameters"]
    assert off["by_category"].get("gradients", 0) < plain["by_category"].get("gradients", 0) or (
        plain["by_category"].get("gradients", 0) == 0
    )
    # at least the shards and the optimizer's states leave the device's peak
    assert plain["peak"] - off["peak"] >= static["parameters"] + static["optimizer"] - 64 * LAYERS


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=["full-bf16", "lora-fp32"])
def test_simulated_model_offload_equals_real_step(case):
    dtype, lora = CASES[case]
    real = real_runs()[case, "cpu"]
    case = StepCase(TINY, S, sp_size=2, layers=LAYERS, dtype=dtype, lora=lora)
    sim = simulate_train_step(case, _settings("cpu"), world_size=WORLD)
    assert sim["host_peak"] == real["host_peak"]
    assert abs(sim["peak"] - real["peak"]) <= 64 * LAYERS, (sim["peak"], real["peak"])
    assert set(sim["by_category"]) == set(real["by_category"])
    for category, nbytes in real["by_category"].items():
        assert abs(sim["by_category"][category] - nbytes) <= 64 * LAYERS, category
