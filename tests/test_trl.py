"""UPipeSFTTrainer refuses the SFTConfig settings it does not handle, at construction, with the reason and the fix;
and the trl.SFTTrainer methods its composition runs through keep the parameters it was written against."""

import ast
import inspect
import sys

import pytest

trl = pytest.importorskip("trl")

from hf_upipe.trl import SFT_TRAINER_INTERNALS, UPipeSFTTrainer, sft_config_errors  # noqa: E402

REFUSED = {
    # setting -> words the error must contain
    "loss_type": (dict(loss_type="dft"), "loss_type='dft'"),
    "use_liger_kernel": (dict(use_liger_kernel=True), "use_liger_kernel=True"),
    "activation_offloading": (dict(activation_offloading=True), "UPipeConfig(offload='cpu')"),
    "selective_checkpointing": (
        dict(gradient_checkpointing_kwargs={"selective": True}),
        "'selective'",
    ),
    "label_smoothing": (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
}


def _config(tmp_path, **overrides):
    return trl.SFTConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        **overrides,
    )


def test_supported_settings_raise_nothing(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    assert (
        sft_config_errors(
            _config(tmp_path, packing=True, completion_only_loss=True, padding_free=True)
        )
        == []
    )
    assert sft_config_errors(_config(tmp_path, assistant_only_loss=True, max_length=64)) == []
    # the SP degree is read by UPipeTrainer (hf_upipe.training.parallelism), not refused
    pc = ParallelismConfig(sp_size=2)
    assert sft_config_errors(_config(tmp_path, parallelism_config=pc)) == []


def test_context_parallelism_is_refused_before_trl_runs(tmp_path):
    """Through UPipeTrainer's checks: context parallelism is another SP system (the fix names sp_size)."""
    from accelerate.parallelism_config import ParallelismConfig

    args = _config(tmp_path, parallelism_config=ParallelismConfig(cp_size=2))
    with pytest.raises(
        ValueError, match=r"ParallelismConfig\(cp_size=2\) asks for context parallelism"
    ):
        UPipeSFTTrainer(model=None, args=args, train_dataset=None)


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_setting_is_refused_with_its_reason(tmp_path, name):
    overrides, words = REFUSED[name]
    errors = sft_config_errors(_config(tmp_path, **overrides))
    assert len(errors) == 1 and isinstance(errors[0], NotImplementedError)
    assert words in str(errors[0]), str(errors[0])


def test_compute_loss_func_is_refused(tmp_path):
    (err,) = sft_config_errors(_config(tmp_path), compute_loss_func=lambda *a, **k: 0)
    assert "compute_loss_func needs the full logits" in str(err)


def test_refused_before_trl_or_hf_upipe_run(tmp_path):
    """The trainer raises before it looks at the model or the data (no collective, no dataset preparation)."""
    with pytest.raises(NotImplementedError, match="loss_type='dft'"):
        UPipeSFTTrainer(model=None, args=_config(tmp_path, loss_type="dft"), train_dataset=None)
    with pytest.raises(TypeError, match="takes an SFTConfig"):
        from transformers import TrainingArguments

        UPipeSFTTrainer(
            model=None, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=None
        )


def test_composition_order():
    from transformers import Trainer

    from hf_upipe.training.trainer import UPipeTrainer

    mro = UPipeSFTTrainer.__mro__
    assert mro.index(UPipeTrainer) < mro.index(trl.SFTTrainer) < mro.index(Trainer)


@pytest.mark.parametrize("name", sorted(SFT_TRAINER_INTERNALS))
def test_sft_trainer_method_keeps_its_parameters(name):
    sig = inspect.signature(getattr(trl.SFTTrainer, name)).parameters
    params = tuple(
        p
        for p in sig
        if sig[p].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )
    assert params == SFT_TRAINER_INTERNALS[name], f"trl.SFTTrainer.{name} now takes {params}"
    assert name in vars(trl.SFTTrainer), f"trl.SFTTrainer no longer overrides {name}"


@pytest.mark.slow  # two training runs in a spawned process (about 30 s on 2 loaded cores)
def test_one_process_loss_and_metrics_equal_trl(tmp_path):
    """On one process UPipeSFTTrainer trains through hf_upipe's tiled loss (one log line says it replaces TRL's
    fused LM head) and logs the same loss, grad norm, entropy, mean_token_accuracy and num_tokens as TRL.
    (The multi-rank equivalence, SP 2 and SP 2 x DP 2: tests/training/test_trl_sft.py.)"""
    from tests._dist import run_distributed
    from tests.training._trl_runs import sft_runs

    spec = dict(steps=2, ga=1, lora=True, kind="conversational", completion_only_loss=None)
    spec["assistant_only_loss"] = True
    ref, got = run_distributed(
        sft_runs,
        1,
        [
            dict(trainer="trl", output_dir=str(tmp_path / "ref"), **spec),
            dict(trainer="upipe", sp=1, output_dir=str(tmp_path / "up"), **spec),
        ],
        timeout=300,
    )[0]
    assert "replaced by hf_upipe's tiled loss" in got["log"], got["log"]
    for what in ("losses", "grad_norms", "entropy", "mean_token_accuracy"):
        for step, want in ref[what].items():
            assert abs(got[what][step] - want) <= 1e-5 * abs(want) + 1e-12, (what, got, ref)
    assert got["num_tokens"] == ref["num_tokens"]


def test_deepspeed_is_refused_for_the_trl_trainers(tmp_path):
    """DeepSpeed is verified with UPipeTrainer and UPipePlugin (tests/training/test_deepspeed.py), not with the TRL
    trainers: their configs name it. (Set after construction: a real `deepspeed=` sets accelerate's process-wide
    DeepSpeed state.)"""
    from trl import DPOConfig

    from hf_upipe.trl import dpo_config_errors

    args = _config(tmp_path)
    args.deepspeed = {"zero_optimization": {"stage": 3}}
    (err,) = sft_config_errors(args)
    assert isinstance(err, NotImplementedError) and "SFTConfig(deepspeed=...)" in str(err)
    dpo = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    dpo.deepspeed = {"zero_optimization": {"stage": 3}}
    (err,) = dpo_config_errors(dpo)
    assert "deepspeed=..." in str(err) and "UPipeTrainer" in str(err)


def _after_setup(cls, **state):
    """A trainer of class `cls` that skipped construction, holding only what `_refuse_after_setup` reads."""
    import types

    trainer = object.__new__(cls)
    defaults = dict(
        _is_vision_dataset=False,
        _is_vlm=False,
        aux_loss_enabled=False,
        router_aux_loss_coef=0.001,
        padding_free=False,
        is_fsdp_enabled=False,
        is_deepspeed_enabled=False,
        accelerator=types.SimpleNamespace(parallelism_config=None),
        model=types.SimpleNamespace(peft_config={}),
        upipe=types.SimpleNamespace(state=types.SimpleNamespace(ring_size=1)),
    )
    for name, value in {**defaults, **state}.items():
        setattr(trainer, name, value)
    return trainer


def test_the_trainers_share_one_base_and_keep_their_refusals():
    """`hf_upipe.trl.base`: the three trainers are siblings on one base (none imports another); the refusals after
    TRL's setup that they share keep each trainer's words."""
    import types

    from hf_upipe.trl import UPipeDPOTrainer, UPipeGRPOTrainer
    from hf_upipe.trl.base import UPipeTRLTrainer

    trainers = (UPipeSFTTrainer, UPipeDPOTrainer, UPipeGRPOTrainer)
    assert all(UPipeTRLTrainer in t.__mro__ for t in trainers)
    modules = [sys.modules[t.__module__] for t in trainers]
    for module in modules:
        with open(module.__file__) as f:
            tree = ast.parse(f.read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {m.__name__ for m in modules}, module.__name__
    for cls in trainers:
        _after_setup(cls)._refuse_after_setup()  # nothing refused
    aux = {
        UPipeSFTTrainer: "hf_upipe's loss has no auxiliary term; set SFTConfig(router_aux_loss_coef=0.0).",
        UPipeDPOTrainer: "UPipeDPOTrainer's loss has no auxiliary term; set DPOConfig(router_aux_loss_coef=0.0).",
        UPipeGRPOTrainer: "UPipeGRPOTrainer does not shard it; set GRPOConfig(router_aux_loss_coef=0.0).",
    }
    sp = types.SimpleNamespace(parallelism_config=types.SimpleNamespace(sp_enabled=True))
    prompt = types.SimpleNamespace(
        peft_config={"default": types.SimpleNamespace(is_prompt_learning=True)}
    )
    for cls, words in aux.items():
        with pytest.raises(NotImplementedError) as err:
            _after_setup(cls, aux_loss_enabled=True)._refuse_after_setup()
        assert str(err.value) == (
            "The model returns router logits and the MoE auxiliary loss is weighted by 0.001: "
            + words
        )
        with pytest.raises(NotImplementedError, match="sequence a second time"):
            _after_setup(cls, accelerator=sp)._refuse_after_setup()
    for cls in (UPipeSFTTrainer, UPipeDPOTrainer):
        with pytest.raises(NotImplementedError) as err:
            _after_setup(cls, _is_vision_dataset=True)._refuse_after_setup()
        assert str(err.value) == (
            f"{cls.__name__} trains causal language models on text; vision datasets are not supported under "
            "hf_upipe's sequence parallelism."
        )
    for cls in (UPipeDPOTrainer, UPipeGRPOTrainer):
        with pytest.raises(NotImplementedError, match="Prompt-learning PEFT"):
            _after_setup(cls, model=prompt)._refuse_after_setup()
    # UPipeSFTTrainer does not refuse prompt-learning PEFT after the setup (as before the base)
    _after_setup(UPipeSFTTrainer, model=prompt)._refuse_after_setup()
