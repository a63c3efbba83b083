"""The planner with model offload (FSDP2's host offload of the parameter, gradient and optimizer shards).

- Fixed at one length: the per-GPU categories lose the optimizer and the fp32 shards, the host line reports the
  simulated host memory of the model's state, `--host-memory` checks it, and the launch line and `upipe_config()`
  carry `model_offload='cpu'`.
- Chosen: where nothing else fits it is chosen, with its predicted cost in a note; with `--max` it is kept where
  it lengthens the fit at under 2% of the step, and dropped (the longest fit without it) where it costs more.
- The step-time model prices it: the host AdamW over a GPU's shard and the root's copies, exposed; for Llama3-8B at
  4M tokens on 8 GPUs that is under 2% of the predicted step.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_upipe.cli import main
from hf_upipe.planning.planner import Margin, ladder, plan
from hf_upipe.planning.step_time import (
    HOST_ADAMW_SECONDS_PER_PARAM,
    HOST_LINK_BYTES_PER_S,
    step_time,
)
from hf_upipe.planning.train_step import StepSettings
from tests.planning.test_planner import _tiny_model

KW = dict(gpus=2, gpu_memory="64GiB", margin=Margin(0.1, 0))
SETTINGS = StepSettings("fused", 1)


def _pair(seq_len=16384):
    return {
        mo: plan(_tiny_model(), seq_len=seq_len, settings=SETTINGS, model_offload=mo, **KW)
        for mo in ("none", "cpu")
    }


def test_fixed_model_offload_moves_state_to_the_host(capsys):
    plain, off = _pair().values()
    assert off.settings.model_offload == "cpu" and plain.settings.model_offload == "none"
    assert plain.by_category["optimizer"] > 0 and "optimizer" not in off.by_category
    assert off.by_category["parameters"] < plain.by_category["parameters"]
    assert off.tensor_peak < plain.tensor_peak and plain.model_host_bytes == 0
    # at least the fp32 shards and AdamW's m and v of every parameter: 12 bytes per parameter over 2 GPUs
    assert off.model_host_bytes >= plain.by_category["optimizer"] // 2 * 3 * 0.9
    assert off.upipe_config().model_offload == "cpu"
    assert "UPIPE_MODEL_OFFLOAD=cpu" in off.launch() and "model_offload='cpu'" in off.launch()
    assert "--fsdp_offload_params true your_script.py" in off.launch()
    assert "MODEL_OFFLOAD" not in plain.launch()
    assert "host memory for the model's state" in off.table()
    node = (off.host_bytes_per_gpu + off.model_host_bytes) * 2
    kw = dict(KW, settings=SETTINGS, model_offload="cpu", seq_len=16384)
    assert plan(_tiny_model(), host_memory=node, **kw).fits
    short = plan(_tiny_model(), host_memory=node - 1, **kw)
    assert not short.fits and not short.host_fits and "DOES NOT FIT" in short.table()


def _last_rungs(**kw):
    """The plans of Ulysses mode's last rung (tiled MLP, offloaded checkpoints) without and with model offload."""
    last = ladder(_tiny_model(), 2, "ulysses")[-1]
    return [
        plan(_tiny_model(), settings=last, model_offload=mo, **KW, **kw) for mo in ("none", "cpu")
    ]


@pytest.mark.slow
def test_chosen_where_nothing_else_fits():
    plain, off = _last_rungs(seq_len=16384)
    memory = (plain.required + off.required) // 2  # between the two: only the model offload fits
    kw = dict(KW, gpu_memory=memory, headroom=0, impl="ulysses", seq_len=16384)
    assert not plan(_tiny_model(), model_offload="none", **kw).fits
    chosen = plan(_tiny_model(), **kw)
    assert chosen.fits and chosen.settings.model_offload == "cpu"
    assert any("model offload" in note and "of the step" in note for note in chosen.notes)


@pytest.mark.slow
def test_max_keeps_model_offload_only_under_two_percent(monkeypatch):
    import hf_upipe.planning.step_time as step_time_module

    model = dict(_tiny_model(), intermediate_size=4096)  # 3.2M parameters: 25 MiB of state per GPU
    kw = dict(KW, gpu_memory="300MiB", step=2048, impl="ulysses")
    without = plan(model, max_context=True, model_offload="none", **kw)
    monkeypatch.setattr(step_time_module, "HOST_ADAMW_SECONDS_PER_PARAM", 0.0)  # about free: kept
    cheap = plan(model, max_context=True, **kw)
    assert cheap.settings.model_offload == "cpu" and cheap.max_seq_len > without.max_seq_len
    monkeypatch.setattr(
        step_time_module, "HOST_ADAMW_SECONDS_PER_PARAM", 1e-3
    )  # seconds per parameter: dropped
    dear = plan(model, max_context=True, **kw)
    assert dear.settings.model_offload == "none" and dear.max_seq_len == without.max_seq_len
    assert any("not chosen (over 2%)" in note for note in dear.notes)


def test_step_time_prices_the_host_adamw_and_the_copies():
    from hf_upipe.models.presets import resolve

    _, config = resolve("llama3-8b")
    settings = StepSettings("fused", 1)
    kw = dict(seq_len=4 * 2**20, sp_size=8, world=8, gpus_per_node=8)
    plain = step_time(config, settings, **kw)
    off = step_time(config, dataclasses.replace(settings, model_offload="cpu"), **kw)
    params = sum(
        [
            2 * 4096 * 128256,  # embeddings and lm_head
            32
            * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336),  # q/k/v, o and the MLP of 32 layers
        ]
    )  # norms left out: 0.0003% of the parameters
    host_adam = params / 8 * HOST_ADAMW_SECONDS_PER_PARAM
    root_copies = 2 * 4096 * 128256 / 8 * 12 / HOST_LINK_BYTES_PER_S
    assert off.parts["optimizer"] == pytest.approx(host_adam + root_copies, rel=1e-3)
    assert (
        off.parts["fsdp_offload_exposed"] == plain.parts["fsdp_offload_exposed"]
    )  # layer copies hidden
    cost = off.seconds / plain.seconds - 1
    assert 0 < cost < 0.02, cost


def test_plan_flag_and_its_errors(capsys):
    # (with --impl deepspeed the flag is ZeRO-3's host optimizer: tests/planning/test_plan_zero3_offload.py)
    with pytest.raises(SystemExit):
        main(
            [
                "plan",
                "--model",
                "llama3-8b",
                "--gpus",
                "8",
                "--seq-len",
                "1M",
                "--model-offload",
                "gpu",
            ]
        )
