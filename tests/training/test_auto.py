"""`UPipeConfig(auto=True)`: the planner's choice reaches the Trainer on every rank, or the same error does.

(a) On 2 gloo ranks, UPipeTrainer with auto settings applies exactly what `hf_upipe.plan` chooses for the same
    model, GPUs and length (rank 0 plans in a child process and broadcasts), and trains with them; a GPU too small
    for the length raises the same "do not fit" error on both ranks.
(b) Every planner field lands in its UPipeConfig field (the planner's answer faked, so the mapping is checked for
    values no default has).
(c) Bad auto settings: no plan_seq_len; no GPU memory known; the planner failing.
"""

from __future__ import annotations

import os

import pytest

from hf_upipe import UPipeConfig
from hf_upipe.training import auto_settings as auto
from tests._dist import run_distributed

FIELDS = (
    "heads_per_chunk",
    "fused_attention",
    "tiled_mlp",
    "mlp_chunk_tokens",
    "tiled_loss",
    "loss_chunk_tokens",
    "offload",
    "fused_backward",
    "overlap_comm",
)


def _trainer_auto(rank, world, out_dir):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from transformers import TrainingArguments, default_data_collator

    from hf_upipe import UPipeTrainer
    from tests.training._runs import _dataset, _model

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="no",
        activation_checkpointing=True,
    )
    data = _dataset(8, 32, 96, seed=1)
    cfg = UPipeConfig(auto=True, plan_seq_len=32, gpu_memory="16GiB", offload_min_bytes=0)
    trainer = UPipeTrainer(
        model=_model(False, 1),
        args=args,
        train_dataset=data,
        data_collator=default_data_collator,
        upipe_config=cfg,
    )
    trainer.train()
    chosen = {f: getattr(trainer.upipe.config, f) for f in FIELDS}
    untouched = cfg == UPipeConfig(
        auto=True, plan_seq_len=32, gpu_memory="16GiB", offload_min_bytes=0
    )
    try:
        UPipeTrainer(
            model=_model(False, 1),
            args=args,
            train_dataset=data,
            upipe_config=UPipeConfig(auto=True, plan_seq_len=32, gpu_memory="1GiB"),
        )
        error = None
    except ValueError as err:
        error = str(err)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return chosen, error, losses, untouched


@pytest.mark.slow
def test_trainer_applies_the_plan_on_every_rank(tmp_path):
    from hf_upipe.planning.planner import plan
    from tests.integrations._models import tiny_config

    results = run_distributed(_trainer_auto, 2, str(tmp_path))
    expected = plan(tiny_config("llama"), gpus=2, seq_len=32, gpu_memory="16GiB").upipe_config()
    for chosen, error, losses, untouched in results:
        assert untouched  # the user's settings object is never changed
        assert chosen == {f: getattr(expected, f) for f in FIELDS}
        assert len(losses) == 2 and all(loss > 0 for loss in losses)
        assert "do not fit on 2 GPU(s) of 1.0 GiB" in error and "hf-upipe plan" in error
    assert results[0] == results[1]


def test_every_planned_setting_lands_in_the_config(monkeypatch):
    answer = {
        "fits": True,
        "required": 2**30,
        "gpu_memory": 2**31,
        "settings": {
            "impl": "fused",
            "heads_per_chunk": 2,
            "tiled_mlp": True,
            "mlp_chunk_tokens": 77,
            "tiled_loss": False,
            "loss_chunk_tokens": 99,
            "offload": "cpu",
            "fused_backward": "save",
            "overlap": True,
        },
    }
    monkeypatch.setattr(auto, "_run_planner", lambda *a: answer)
    given = UPipeConfig(auto=True, plan_seq_len=1024, gpu_memory="2GiB")
    cfg, plan = auto.apply_auto_settings(given, object(), world_size=1)
    assert plan is answer and given == UPipeConfig(auto=True, plan_seq_len=1024, gpu_memory="2GiB")
    assert cfg.describe("heads_per_chunk") == "heads_per_chunk=2 (chosen by auto=True)"
    assert {f: getattr(cfg, f) for f in FIELDS} == dict(
        heads_per_chunk=2,
        fused_attention=True,
        tiled_mlp=True,
        mlp_chunk_tokens=77,
        tiled_loss=False,
        loss_chunk_tokens=99,
        offload="cpu",
        fused_backward="save",
        overlap_comm=True,
    )
    answer["settings"]["heads_per_chunk"] = None
    cfg, _ = auto.apply_auto_settings(given, object(), world_size=1)
    assert cfg.heads_per_chunk == "all"
    untouched = UPipeConfig(heads_per_chunk=4)
    assert auto.apply_auto_settings(untouched, object(), world_size=1) == (untouched, None)


def test_bad_auto_settings(monkeypatch):
    with pytest.raises(ValueError, match="set plan_seq_len"):
        UPipeConfig(auto=True)
    monkeypatch.setenv("UPIPE_AUTO", "1")
    monkeypatch.setenv("UPIPE_PLAN_SEQ_LEN", "4096")
    cfg = UPipeConfig()
    assert cfg.auto and cfg.plan_seq_len == 4096 and cfg.gpu_memory is None
    if not auto.torch.cuda.is_available():
        with pytest.raises(ValueError, match="set gpu_memory"):
            auto._gpu_memory(cfg)
    monkeypatch.setattr(
        auto, "_run_planner", lambda *a: {"error": "hf-upipe plan: seq_len=4095 is not divisible"}
    )
    with pytest.raises(ValueError, match="the planner failed: hf-upipe plan: seq_len=4095"):
        auto.apply_auto_settings(cfg, object(), world_size=1)


def test_plugin_auto_needs_checkpointing():
    from types import SimpleNamespace

    from hf_upipe import UPipePlugin
    from tests.training._runs import _model

    plugin = UPipePlugin(auto=True, plan_seq_len=32, gpu_memory="16GiB")
    with pytest.raises(ValueError, match="activation_checkpointing_enable"):
        plugin.prepare(
            SimpleNamespace(num_processes=1, device="cpu", distributed_type="NO"), _model(False, 1)
        )


def test_a_peft_lora_model_is_planned_as_lora():
    from tests.training._runs import _model

    assert auto._lora_of(_model(False, 1)) is None
    assert auto._lora_of(_model(True, 1)) == (
        4,
        ["k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    )
