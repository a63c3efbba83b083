"""The allocator mode in force (hf_upipe.allocator): PYTORCH_CUDA_ALLOC_CONF is set for the user before CUDA
initialises (simulated on CPU by patching torch.cuda), said once when CUDA was initialised otherwise, written on
the plan's launch line, and the planner plans for the mode the launch runs in."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers

import hf_upipe.allocator as allocator
from hf_upipe.allocator import arrange_allocator, conf_mode, launch_mode
from hf_upipe.config import UPipeConfig
from hf_upipe.planning.planner import plan
from hf_upipe.planning.train_step import StepSettings
from hf_upipe.training.plugin import UPipePlugin
from hf_upipe.training.trainer import UPipeTrainer
from tests.planning.test_train_step import TINY

CONF = "PYTORCH_CUDA_ALLOC_CONF"


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine whose CUDA is not initialised yet (flip `state["initialised"]` to say it is)."""
    state = {"initialised": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialised"])
    monkeypatch.delenv(CONF, raising=False)
    monkeypatch.delenv("UPIPE_ALLOCATOR", raising=False)
    monkeypatch.setattr(allocator, "_logged", set())
    return state


def test_conf_mode_and_settings():
    assert conf_mode("expandable_segments:True") == "expandable"
    assert conf_mode("max_split_size_mb:128, expandable_segments:true") == "expandable"
    assert conf_mode("expandable_segments:False") == conf_mode(None) == "default"
    assert UPipeConfig().allocator == "expandable"
    assert UPipeConfig(allocator="Keep").allocator == "keep"
    with pytest.raises(ValueError, match="allocator='big': use 'expandable'.*'default'.*'keep'"):
        UPipeConfig(allocator="big")


def test_set_before_cuda_initialises(gpu, monkeypatch):
    """The plugin sets expandable segments when built, keeping the user's other entries; 'default' turns them
    off again; 'keep' leaves the variable alone."""
    monkeypatch.setenv(CONF, "max_split_size_mb:256")
    assert UPipePlugin().allocator == "expandable"
    assert os.environ[CONF] == "max_split_size_mb:256,expandable_segments:True"
    assert arrange_allocator("default") == "default"
    assert os.environ[CONF] == "max_split_size_mb:256,expandable_segments:False"
    assert arrange_allocator("keep") == "default" and os.environ[CONF].endswith(":False")
    monkeypatch.setenv("UPIPE_ALLOCATOR", "default")
    monkeypatch.setenv(CONF, "expandable_segments:True")
    UPipePlugin()  # the environment variable UPIPE_ALLOCATOR is the setting
    assert os.environ[CONF] == "expandable_segments:False"


def test_trainer_sets_it_before_the_trainer_places_the_model(gpu, monkeypatch):
    """UPipeTrainer arranges the mode before transformers' Trainer.__init__ (which moves the model to the GPU)."""
    seen = {}

    class Stop(Exception):
        pass

    def trainer_init(self, *args, **kwargs):
        seen["conf"] = os.environ.get(CONF)
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the arguments place on the CPU
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.Trainer, "__init__", trainer_init)
    with pytest.raises(Stop):
        UPipeTrainer(model=None, args=args, upipe_config=UPipeConfig(sp_size=1))
    assert seen["conf"] == "expandable_segments:True"


def test_said_once_when_cuda_was_initialised_otherwise(gpu, caplog):
    """Already initialised: the variable is left as it was (it is read once, at initialisation), the mode in force
    is returned, and one warning names it, the plan that applies and the fix."""
    gpu["initialised"] = True
    with caplog.at_level(logging.WARNING, logger="hf_upipe.allocator"):
        UPipePlugin()
        assert arrange_allocator("expandable") == "default"
    assert CONF not in os.environ
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "CUDA was already initialised with the default allocator" in said[0]
    assert (
        "the plan for the default allocator applies (`hf-upipe plan --allocator default`)"
        in said[0]
    )
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before anything uses CUDA" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_upipe.allocator"):
        assert (
            arrange_allocator("default") == "default"
        )  # the mode asked for is in force: nothing to say
    assert not caplog.records


def test_no_cuda_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(CONF, raising=False)
    assert arrange_allocator("expandable") == "default"
    assert CONF not in os.environ


def test_the_planner_plans_for_the_launch_lines_mode(gpu, monkeypatch):
    """By default the planner predicts the reserve with expandable segments and the launch line sets them;
    UPIPE_ALLOCATOR=default plans the default segments and says so on both lines; 'keep' plans for
    PYTORCH_CUDA_ALLOC_CONF as it is."""
    model = dict(TINY, num_hidden_layers=2, vocab_size=128)
    kw = dict(gpus=2, seq_len=2048, gpu_memory="64GiB", settings=StepSettings("upipe", 1))
    assert launch_mode() == "expandable"
    p = plan(model, **kw)
    assert p.allocator == "expandable" and p.upipe_config().allocator == "expandable"
    launch, python = p.launch().splitlines()
    assert launch.startswith(
        "launch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True UPIPE_SP_SIZE=2"
    )
    assert "allocator" not in python and "UPIPE_ALLOCATOR" not in launch
    monkeypatch.setenv("UPIPE_ALLOCATOR", "default")
    d = plan(model, **kw)
    assert d.allocator == "default" and d.reserved >= p.reserved
    launch, python = d.launch().splitlines()
    assert "UPIPE_ALLOCATOR=default" in launch and CONF not in launch
    assert "allocator='default'" in python
    monkeypatch.setenv("UPIPE_ALLOCATOR", "keep")
    monkeypatch.setenv(CONF, "expandable_segments:True")
    assert launch_mode() == "expandable" and plan(model, **kw).reserved == p.reserved
    assert plan(model, allocator="default", **kw).reserved == d.reserved
