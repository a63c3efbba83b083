"""Adapters verified by behaviour (`hf_upipe.models.verification`) on a transformers source not seen before.

- A source that differs from the recorded ones only in its text (a renamed argument, a comment) passes the check:
  the fused block and the tiled MLP are installed, with one info line, and run exact.
- A source whose arithmetic differs (a monkeypatched attention scaling, a mixer that loses its state, RoPE that
  takes a shard's length) fails it: the model keeps transformers' own path, with one warning naming the
  architecture, what differed and by how much, the releases verified and the pin to install.
- Verdicts are cached per process and on disk (a second process does not check again), and `prepare_model`'s
  agreement compares them across ranks.
"""

import importlib
import logging

import pytest
import torch

import hf_upipe
from hf_upipe.adapters import mixers as mixer_sources
from hf_upipe.adapters import rope
from hf_upipe.attention import fused as fused_call
from hf_upipe.attention import fused as fused_module
from hf_upipe.models import architectures, verification
from hf_upipe.models.probe import case_config, model_pair
from hf_upipe.models.verification import VERIFIED_RELEASES, Verdict, verify

tiled_module = importlib.import_module(
    "hf_upipe.adapters.tiled_mlp"
)  # (hf_upipe.adapters.tiled_mlp is also a function)


@pytest.fixture
def unseen(monkeypatch, tmp_path):
    """A transformers release nobody verified: no recorded fingerprint matches, and empty caches."""
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verification, "_PROCESS", {})
    monkeypatch.setattr(verification, "_WARNED", set())
    for model_type in ("llama", "qwen3"):
        entry = architectures.ARCHITECTURES[model_type]
        monkeypatch.setitem(
            architectures.ARCHITECTURES,
            model_type,
            architectures.Architecture(
                **{
                    **entry.__dict__,
                    "fused_fingerprints": ("0" * 16,),
                    "tiled_fingerprints": ("0" * 16,),
                }
            ),
        )
    return tmp_path


def _fused_modules(model) -> int:
    return sum(fused_module._is_fused(m) for m in model.modules())


def test_a_changed_source_text_is_verified_by_behaviour(unseen, monkeypatch, caplog):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaAttention.forward

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs
    ):
        # the same arithmetic under a renamed argument, as 5.24 renamed past_key_values (and this comment): another
        # source, another fingerprint
        cache = kwargs.pop("past_key_values", cache)
        return original(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    _, model = model_pair(case_config("llama"), "upipe", seed=1)
    with caplog.at_level(logging.INFO):
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=True))
    assert _fused_modules(model) == 2
    assert sum(tiled_module._is_tiled(m) for m in model.modules()) == 7  # 2 MLPs, 2 x 2 + 1 norms
    verdict = verification.verdicts()[("fused", "llama")]
    assert verdict.ok and verdict.how == "behaviour"
    assert "the fused adapter of llama verified by behaviour on transformers" in caplog.text
    # hf_upipe warns of nothing (bitsandbytes, loaded by PEFT on the first import, may warn of its own kernels)
    assert not [
        r.message
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("hf_upipe")
    ]


def test_changed_attention_arithmetic_fails_and_keeps_the_registered_path(
    unseen, monkeypatch, caplog
):
    real = fused_call.fused_upipe_attention

    def scaled(*args, **kwargs):  # the fused block's attention scale 1% off
        return real(*args, **{**kwargs, "scale": kwargs["scale"] * 1.01})

    monkeypatch.setattr(fused_call, "fused_upipe_attention", scaled)
    _, model = model_pair(case_config("qwen3"), "upipe", seed=2)
    with caplog.at_level(logging.INFO):
        hf_upipe.prepare_model(model)
        hf_upipe.prepare_model(model)  # one warning per architecture, however often
    assert _fused_modules(model) == 0 and model.config._attn_implementation == "upipe"
    verdict = verification.verdicts()[("fused", "qwen3")]
    assert not verdict.ok and verdict.how == "failed"
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "adapter of" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "the fused adapter of qwen3 is not used" in warnings[0]
    assert "the logits differ by" in warnings[0] and "(relative)" in warnings[0]
    assert ", ".join(VERIFIED_RELEASES) in warnings[0] and verification.TESTED_RANGE in warnings[0]


def test_changed_mlp_arithmetic_fails_the_tiled_check(unseen, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(
        modeling_llama.LlamaMLP, "forward", lambda self, x: original(self, x) * 1.0
    )  # same
    assert tiled_module.tiled_verdict(architectures.ARCHITECTURES["llama"]).ok
    monkeypatch.setattr(verification, "_PROCESS", {})
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(unseen / "again"))
    real = tiled_module.tiled_mlp
    monkeypatch.setattr(
        tiled_module,
        "tiled_mlp",
        lambda x, fn, params, chunk_tokens: real(
            x[:, :, :] * 1.001, fn, params, chunk_tokens=chunk_tokens
        ),
    )  # the tiles see a changed input
    verdict = tiled_module.tiled_verdict(architectures.ARCHITECTURES["llama"])
    assert not verdict.ok and "differ" in verdict.detail


def test_the_verdict_is_cached_in_the_process_and_on_disk(unseen, monkeypatch):
    calls = []
    check = lambda: calls.append(1)  # noqa: E731 - passes (returns None)
    first = verify("fused", "x", "abc", (), check)
    assert first.ok and first.how == "behaviour" and calls == [1]
    assert verify("fused", "x", "abc", (), check) is first and calls == [1]  # this process
    monkeypatch.setattr(verification, "_PROCESS", {})  # a new process: the file answers
    again = verify("fused", "x", "abc", (), check)
    assert again.ok and again.how == "behaviour" and calls == [1]
    assert (unseen / "verified.json").exists()
    assert (
        verify("fused", "x", "def", (), lambda: "it differs").how == "failed"
    )  # another source: checked again
    assert verify("fused", "x", "abc", ("abc",), check).how == "fingerprint"


def test_a_check_that_raises_is_a_failure_and_an_unreadable_source_is_checked(unseen):
    def broken():
        raise TypeError("forward() got an unexpected keyword argument 'cache'")

    verdict = verify("mixer", "SomeMixer", "abc", (), broken)
    assert not verdict.ok and "TypeError" in verdict.detail and "'cache'" in verdict.detail
    # a source that cannot be read whole is not refused on sight: its check decides, either way
    assert verify("tiled", "moved", None, ("abc",), lambda: None).how == "behaviour"
    gone = verify("tiled", "gone", None, ("abc",), lambda: "the tiny model has no GoneMLP")
    assert not gone.ok and gone.how == "failed" and "GoneMLP" in gone.detail


@pytest.fixture
def fresh_verdicts(monkeypatch, tmp_path):
    """Empty verdict caches, the recorded fingerprints as they are."""
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verification, "_PROCESS", {})
    monkeypatch.setattr(verification, "_WARNED", set())


def _move_rope_helpers(monkeypatch):
    """transformers moves Llama's RoPE helpers to another module, and the attention's forward calls them there as
    `moved_rope.apply_rotary_pos_emb(...)`: the modeling module no longer holds either name."""
    import inspect
    import sys
    import textwrap
    import types

    from transformers.models.llama import modeling_llama

    moved = types.ModuleType("transformers.integrations.moved_rope")
    moved.torch = torch
    for helper in (modeling_llama.rotate_half, modeling_llama.apply_rotary_pos_emb):
        text = textwrap.dedent(inspect.getsource(verification.underlying(helper)))
        exec(
            text[text.index("def ") :], moved.__dict__
        )  # the same function, defined in the new module
    monkeypatch.setitem(sys.modules, moved.__name__, moved)
    forward = inspect.unwrap(modeling_llama.LlamaAttention.forward)
    source = textwrap.dedent(inspect.getsource(forward))
    source = source[source.index("def forward") :]  # its decorators are not needed to run it
    assert "apply_rotary_pos_emb(" in source
    scope = {**forward.__globals__, "moved_rope": moved}
    exec(source.replace("apply_rotary_pos_emb(", "moved_rope.apply_rotary_pos_emb("), scope)
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", scope["forward"])
    monkeypatch.delattr(modeling_llama, "apply_rotary_pos_emb")
    monkeypatch.delattr(modeling_llama, "rotate_half")


def test_a_helper_moved_to_another_module_keeps_the_fused_block(
    fresh_verdicts, monkeypatch, caplog
):
    """The rule of docs/models.md: an adapter depends on what the model computes, not on where transformers keeps a
    helper. A moved helper cannot be fingerprinted; the check on a tiny model decides, and it passes."""
    llama = architectures.ARCHITECTURES["llama"]
    assert architectures.source_fingerprint(llama, "fused") in llama.fused_fingerprints
    _move_rope_helpers(monkeypatch)
    assert architectures.source_fingerprint(llama, "fused") is None
    ref, model = model_pair(case_config("llama"), "upipe", seed=3)
    with caplog.at_level(logging.INFO):
        hf_upipe.prepare_model(model)
    assert _fused_modules(model) == 2
    verdict = verification.verdicts()[("fused", "llama")]
    assert verdict.ok and verdict.how == "behaviour"
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and "adapter" in r.getMessage()
    ]
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(11)[None]
    want = ref(input_ids=ids, position_ids=positions).logits
    got = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_moved_helper_whose_arithmetic_changed_fails_the_check(fresh_verdicts, monkeypatch):
    _move_rope_helpers(monkeypatch)
    moved = __import__("sys").modules["transformers.integrations.moved_rope"]
    real = moved.apply_rotary_pos_emb
    monkeypatch.setattr(  # the new module's RoPE rotates by 1% more: the fused block no longer matches
        moved,
        "apply_rotary_pos_emb",
        lambda q, k, cos, sin, *a, **kw: real(q, k, cos * 1.01, sin, *a, **kw),
    )
    verdict = fused_module.fused_verdict(architectures.ARCHITECTURES["llama"])
    assert not verdict.ok and "differ" in verdict.detail


def test_a_helper_wrapped_in_a_callable_object_is_read_through(fresh_verdicts, monkeypatch):
    """transformers 5.25 wraps Llama's `apply_rotary_pos_emb` in a Hub-kernel `Func` module (a class whose forward
    closes over the function): the fingerprint reads the function it runs, so a known source stays known."""
    from torch import nn
    from transformers.models.llama import modeling_llama

    def wrap(func):
        class Func(nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    llama = architectures.ARCHITECTURES["llama"]
    before = architectures.source_fingerprint(llama, "fused")
    monkeypatch.setattr(
        modeling_llama,
        "apply_rotary_pos_emb",
        wrap(verification.underlying(modeling_llama.apply_rotary_pos_emb)),
    )
    assert (
        verification.underlying(modeling_llama.apply_rotary_pos_emb).__name__
        == "apply_rotary_pos_emb"
    )
    assert architectures.source_fingerprint(llama, "fused") == before
    assert fused_module.fused_verdict(llama).how == "fingerprint"
    with pytest.raises(TypeError, match="wraps no single function"):
        verification.underlying(nn.Identity())


def test_the_release_report_names_each_family_and_why_an_adapter_is_off(fresh_verdicts):
    from hf_upipe.tools.adapter_status import adapter_status, format_report, release_report

    rows = adapter_status(check=False)
    report = release_report(rows)
    assert report["off"] == 0 and report["on"] == len(rows)
    assert set(report["families"]["llama"]) == {"fused", "tiled"}
    assert set(report["families"]["bamba"]) == {"mixer BambaMixer"}
    failed = [
        dict(r, ok=False, status="not verified: the logits differ by 1e-2")
        if r["subject"] == "qwen3" and r["adapter"] == "fused"
        else r
        for r in rows
    ]
    report = release_report(failed)
    assert report["off"] == 1 and report["families"]["qwen3"]["fused"]["on"] is False
    line = next(x for x in format_report(report, "9.9.9") if x.strip().startswith("qwen3 "))
    assert (
        "fused OFF (not verified: the logits differ by 1e-2)" in line
        and "tiled (by fingerprint)" in line
    )


def test_the_check_leaves_the_callers_random_state_and_threads(unseen):
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    want = torch.rand(3)
    torch.manual_seed(123)
    verify("fused", "seeded", "abc", (), lambda: torch.rand(5) and None)
    assert torch.equal(torch.rand(3), want) and torch.get_num_threads() == threads


def _mixer_class(name: str):
    module = {
        "BambaMixer": "bamba",
        "Lfm2ShortConv": "lfm2",
        "Qwen3NextGatedDeltaNet": "qwen3_next",
    }[name]
    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


@pytest.mark.parametrize("name", ["BambaMixer", "Lfm2ShortConv", "Qwen3NextGatedDeltaNet"])
def test_the_mixer_check_passes_and_fails_on_a_lost_state(name, monkeypatch):
    cls = _mixer_class(name)
    assert mixer_sources.mixer_check(cls) is None
    if (
        name == "Lfm2ShortConv"
    ):  # no state: a module whose reach the adapter cannot read gets no halo, and shows
        init = cls.__init__

        def without_reach(self, *args, **kwargs):
            init(self, *args, **kwargs)
            del self.conv_kernel_size

        monkeypatch.setattr(cls, "__init__", without_reach)
    else:
        monkeypatch.setattr(
            mixer_sources.ShardCache, "get_recurrent_state", lambda self, *a, **k: None
        )
    assert "differs" in (mixer_sources.mixer_check(cls) or "")


def test_the_rope_check_fails_when_a_shard_takes_its_own_length(monkeypatch):
    assert rope.rope_check() is None
    real = rope._shard_rope
    monkeypatch.setattr(
        rope,
        "_shard_rope",
        lambda self, x, pos, longest, *a, **k: real(self, x, pos, pos.max().reshape(1, 1), *a, **k),
    )
    assert "differs" in (rope.rope_check() or "")


def test_an_unseen_mixer_source_runs_its_state_in_sequence(unseen, monkeypatch):
    from hf_upipe.adapters import mixers

    cls = _mixer_class("Qwen3NextGatedDeltaNet")
    monkeypatch.setitem(mixer_sources.MIXERS, cls.__name__, ("0" * 16,))
    monkeypatch.setattr(
        mixer_sources, "mixer_check", lambda cls: None
    )  # checked (here: taken as passed)
    assert mixers.mixer_verdict(cls).how == "behaviour"
    assert mixers._delta_passing(cls, "parallel") == "sequential"
    assert mixers._delta_passing(cls, "sequential") == "sequential"


def test_the_agreement_names_verdicts_that_differ():
    from hf_upipe.config import settings_that_differ
    from hf_upipe.prepare import preparation

    _, model = model_pair(case_config("llama"), "upipe", seed=3)
    mine = preparation(model, None)
    row = next(r for r in mine if r[0] == "adapters verified")
    assert row[1] == (("fused", "llama", True),)
    other = tuple(
        r if r[0] != "adapters verified" else (r[0], (("fused", "llama", False),), "x")
        for r in mine
    )
    assert any("adapters verified" in line for line in settings_that_differ([mine, other]))


def test_verdict_describes_itself():
    assert "5.23" in Verdict(True, "fingerprint").describe()
    assert "verified by behaviour on transformers" in Verdict(True, "behaviour").describe()
    assert (
        Verdict(False, "failed", "the logits differ").describe()
        == "not verified: the logits differ"
    )


def test_the_checks_run_whole_on_real_tensors_inside_a_simulation_under_sp(unseen, monkeypatch):
    """The planner prepares models on fake bf16 tensors with a simulated SP state installed: the checks must still
    compute on real fp32 tensors, on whole sequences."""
    from hf_upipe.distributed import SequenceParallelState, set_sequence_parallel_state
    from hf_upipe.planning.simulate import fake_tensors

    monkeypatch.setitem(mixer_sources.MIXERS, "BambaMixer", ("0" * 16,))
    monkeypatch.setattr(rope, "ROPE_FINGERPRINTS", ("0" * 16,))
    state = SequenceParallelState(
        sp_group=None, sp_size=2, sp_rank=0, dp_group=None, dp_size=1, dp_rank=0
    )
    previous = set_sequence_parallel_state(state)
    try:
        with fake_tensors(torch.bfloat16):
            llama = architectures.ARCHITECTURES["llama"]
            verdicts = [
                fused_module.fused_verdict(llama),
                tiled_module.tiled_verdict(llama),
                rope.rope_verdict(),
            ]
            verdicts.append(mixer_sources.mixer_verdict(_mixer_class("BambaMixer")))
    finally:
        set_sequence_parallel_state(previous)
    assert all(v.ok and v.how == "behaviour" for v in verdicts), verdicts


def test_a_mixer_that_fails_its_check_is_refused_naming_the_version(unseen, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    from hf_upipe.adapters import support
    from hf_upipe.models.presets import tiny_config

    monkeypatch.setitem(mixer_sources.MIXERS, "BambaMixer", ("0" * 16,))
    monkeypatch.setattr(mixer_sources.ShardCache, "get_recurrent_state", lambda self, *a, **k: None)
    model = AutoModelForCausalLM.from_config(tiny_config("bamba"))
    with caplog.at_level(logging.WARNING):
        reason = support.model_refusal(model)
    assert (
        reason.startswith("BambaMixer: ")
        and "hf_upipe runs BambaMixer across shards, but it is not verified on "
        f"transformers {verification.installed_version()} (its output on two shards differs"
        in reason
    )
    assert f"pip install '{verification.TESTED_RANGE}'" in reason
    assert "models with this mixer are refused under sequence parallelism" in caplog.text
