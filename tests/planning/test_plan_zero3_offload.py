"""The peer planned as ALST runs it: DeepSpeed's Ulysses under ZeRO-3 with the optimizer on the host.

- The accounting (`hf_upipe.planning.zero3_offload`) against an independent count: the parameters of a Llama
  geometry written out by hand, DeepSpeed 0.19.8's rules applied to them (partitions of ceil(n / world), parameters
  of at most 1e5 elements also kept whole, a reduce bucket of 5e8 bf16 elements; 18 host bytes per trained
  parameter of a partition), and DeepSpeed's own config defaults.
- The planner: `--impl deepspeed` plans it by default (and "none" still plans the model state on the GPU); the
  GPU's categories are the simulated step's plus exactly those buffers (the bucket also without it; under LoRA the
  bucket only: the frozen base stays on the GPU), the reserve grows by them in 2 MiB pages, the host memory is
  checked (a host one byte short does not fit).
- The step time: CPU Adam over a GPU's partition and the exposed copies, for Llama3-8B on 8 GPUs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hf_upipe.cli import main
from hf_upipe.models.architectures import model_geometry
from hf_upipe.models.presets import resolve
from hf_upipe.planning import zero3_offload as z3
from hf_upipe.planning.planner import Estimator, plan
from hf_upipe.planning.step_time import (
    HOST_ADAMW_SECONDS_PER_PARAM,
    HOST_LINK_BYTES_PER_S,
    step_time,
    zero3_copy_bytes,
)
from hf_upipe.planning.train_step import StepCase, StepSettings
from tests.planning.test_planner import _tiny_model

MiB = 2**20
PEER = StepSettings("deepspeed", None, tiled_mlp=True, offload="cpu")
KW = dict(gpus=2, gpu_memory="64GiB", seq_len=4096)


def _require_deepspeed() -> None:
    """The peer's step runs DeepSpeed's own attention class: planning it needs DeepSpeed."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")


def _llama_sizes(c: dict) -> list[int]:
    """Every parameter of a Llama geometry (untied head), written out: embeddings, per layer q, k, v, o, gate,
    up, down and the two norms, the final norm, the lm_head."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, h, h]
    return [c["vocab_size"] * h] + layer * c["num_hidden_layers"] + [h, c["vocab_size"] * h]


def _expected_device(sizes, world, threshold=100_000, bucket=500_000_000) -> dict:
    kept = sum(n for n in sizes if n <= threshold)
    return {
        "parameters": 2 * (kept + sum(-(-n // world) for n in sizes)),
        "gradients": 2 * bucket,
    }


def test_defaults_are_deepspeeds():
    """The accounting's ZeRO-3 settings are DeepSpeed's own defaults (ALST's recipe sets no bucket size)."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    ds = config.DeepSpeedZeroConfig()
    assert z3.ALST_ZERO3.reduce_bucket_size == ds.reduce_bucket_size == 500_000_000
    assert z3.ALST_ZERO3.param_persistence_threshold == ds.param_persistence_threshold == 100_000


def test_accounting_against_an_independent_count():
    cfg = _tiny_model()
    counts = z3.param_counts(cfg)
    sizes = _llama_sizes(cfg)
    assert sorted(counts.sizes) == sorted(sizes) and sorted(counts.trainable) == sorted(sizes)
    for world in (2, 3, 8):
        assert z3.device_bytes(counts, world) == _expected_device(sizes, world)
        # a threshold under the MLP's 65,536 elements: those are partitioned only
        small = z3.Zero3(param_persistence_threshold=20_000)
        assert z3.device_bytes(counts, world, small) == _expected_device(sizes, world, 20_000)
        assert z3.host_bytes(counts, world) == (4 + 4 + 4 + 4 + 2) * sum(
            math.ceil(n / world) for n in sizes
        )
    # LoRA on q_proj and down_proj, rank 4: A [4, in] and B [out, 4] each, trained; the base frozen, on the GPU
    lora = z3.param_counts(cfg, (4, ("q_proj", "down_proj")))
    h, i, q = cfg["hidden_size"], cfg["intermediate_size"], 8 * cfg["head_dim"]
    adapters = [4 * h, q * 4, 4 * i, h * 4] * cfg["num_hidden_layers"]
    assert sorted(lora.trainable) == sorted(adapters)
    assert sorted(lora.sizes) == sorted(sizes + adapters)
    assert z3.host_bytes(lora, 2) == 18 * sum(math.ceil(n / 2) for n in adapters)
    assert z3.device_bytes(lora, 2) == _expected_device(sizes + adapters, 2)
    assert zero3_copy_bytes(8e9, 8) == (
        4e9,
        8e9,
    )  # 2 + 2 in the backward, 2 + 4 + 2 after it, per 1e9


def _estimator(cfg, world: int, lora=None) -> Estimator:
    """The planner's estimator of `cfg` at its depth, SP over the whole `world`, bf16."""
    depth = model_geometry(cfg)["layers"]
    case = StepCase(cfg, KW["seq_len"], world, depth, dtype=torch.bfloat16, lora=lora)
    return Estimator(case, world=world, exact=False)


@pytest.mark.slow
def test_the_planner_adds_exactly_zero3s_buffers():
    _require_deepspeed()
    cfg, world = _tiny_model(), 2
    est = _estimator(cfg, world)
    peer = dataclasses.replace(PEER, model_offload="cpu")
    n = KW["seq_len"]
    simulated, planned = est._simulated(peer, n), est(peer, n)
    extra = _expected_device(_llama_sizes(cfg), world)
    assert "optimizer" not in planned  # CPU Adam's states are on the host
    for c in ("parameters", "gradients"):
        assert planned[c] - simulated.get(c, 0) == extra[c]
    step = est._step(peer, n, 4)["reserved"]
    pages = sum(-(-b // (2 * MiB)) * 2 * MiB for b in extra.values())
    for mode in ("default", "expandable"):
        assert est.reserved(peer, n, mode) == step[mode] + pages
    assert est.host(peer, n) == 18 * sum(math.ceil(s / world) for s in _llama_sizes(cfg))
    # the peer without it: its model state as FSDP2's shards, and ZeRO-3's reduce bucket beside them
    on_gpu, simulated = est(PEER, n), est._simulated(PEER, n)
    assert on_gpu["gradients"] - simulated["gradients"] == extra["gradients"]
    assert {c: v for c, v in on_gpu.items() if c != "gradients"} == {
        c: v for c, v in simulated.items() if c != "gradients" and v
    }
    fused = StepSettings("fused", 1, tiled_mlp=True, offload="cpu")
    assert est(fused, n) == {c: v for c, v in est._simulated(fused, n).items() if v}


@pytest.mark.slow
def test_lora_keeps_the_frozen_base_on_the_gpu():
    """Under LoRA ZeRO-3's host optimizer moves the adapters' states only: the GPU holds what the peer holds
    without it (the base's shards, the bucket), the host 18 bytes per adapter parameter of a partition."""
    _require_deepspeed()
    cfg, world, n = _tiny_model(), 2, KW["seq_len"]
    lora = (4, ("q_proj", "down_proj"))
    est = _estimator(cfg, world, lora=lora)
    peer = dataclasses.replace(PEER, model_offload="cpu")
    assert est(peer, n) == est(PEER, n)
    assert est(peer, n)["gradients"] - est._simulated(PEER, n)["gradients"] == 2 * 500_000_000
    for mode in ("default", "expandable"):
        assert est.reserved(peer, n, mode) == est.reserved(PEER, n, mode)
    assert est.host(PEER, n) == 0
    assert est.host(peer, n) == 18 * sum(
        math.ceil(a / world) for a in z3.param_counts(cfg, lora).trainable
    )


@pytest.mark.slow
def test_the_peer_runs_it_by_default_and_a_short_host_does_not_fit():
    _require_deepspeed()
    cfg = _tiny_model()
    chosen = plan(cfg, settings=PEER, **KW)  # the fixed settings' own model_offload: "none"
    assert chosen.settings.model_offload == "none"
    default = plan(cfg, impl="deepspeed", **KW)  # the ladder: ALST's host optimizer
    assert default.settings.model_offload == "cpu" and default.fits
    assert "ZeRO-3 optimizer on the host" in default.table()
    assert "ZeRO-3's host optimizer" in default.table() and "offload_optimizer" in default.table()
    on_gpu = plan(cfg, impl="deepspeed", model_offload="none", **KW)
    assert on_gpu.settings.model_offload == "none" and on_gpu.model_host_bytes == 0
    host = default.model_host_bytes
    assert host == 18 * sum(math.ceil(s / 2) for s in _llama_sizes(cfg))
    node = (default.host_bytes_per_gpu + host) * 2
    fixed = dict(KW, settings=default.settings)
    assert plan(cfg, host_memory=node, **fixed).fits
    short = plan(cfg, host_memory=node - 1, **fixed)
    assert not short.fits and not short.host_fits and "DOES NOT FIT" in short.table()


@pytest.mark.slow
def test_cli_accepts_the_host_optimizer(tmp_path, capsys):
    _require_deepspeed()
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(_tiny_model(), model_type="llama")))
    args = [
        "plan",
        "--model",
        str(path),
        "--gpus",
        "2",
        "--seq-len",
        "16384",
        "--impl",
        "deepspeed",
    ]
    assert main([*args, "--model-offload", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 optimizer on the host" in out and "launch: none from hf_upipe" in out


def test_step_time_prices_cpu_adam_and_the_copies():
    """Llama3-8B at 4M tokens on 8 GPUs: CPU Adam over a GPU's eighth of the parameters at the host AdamW's
    seconds per parameter, and 8 bytes per parameter of the partition after the backward (the boundary's bf16 up
    and fp32 down, the weights' bf16 up) plus the root's 4 bytes of its backward copies, over the host link."""
    _, config = resolve("llama3-8b")
    kw = dict(seq_len=4 * 2**20, sp_size=8, world=8, gpus_per_node=8)
    on_gpu = step_time(config, PEER, **kw)
    off = step_time(config, dataclasses.replace(PEER, model_offload="cpu"), **kw)
    root = 2 * 4096 * 128256
    params = root + 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)  # norms left out
    expected = (
        params / 8 * HOST_ADAMW_SECONDS_PER_PARAM
        + (8 * params / 8 + 4 * root / 8) / HOST_LINK_BYTES_PER_S
    )
    assert off.parts["optimizer"] == pytest.approx(expected, rel=1e-6)
    # each layer's 4 bytes per parameter of the backward hide behind its compute
    assert off.parts["fsdp_offload_exposed"] == on_gpu.parts["fsdp_offload_exposed"]
    assert 0 < off.seconds / on_gpu.seconds - 1 < 0.02
