"""`hf-upipe plan` where a run would not install the fused block (it fails its check on the installed transformers).

The planner then plans the registered path and says so: no candidate carries the fused block's settings (so no
error blames `overlap_comm`, which the user never set), the label reads "UPipe (registered)", not "fused UPipe",
a note names why, and only flags the user typed (--impl fused, --overlap, --fused-backward) are refused, by name.
"""

from __future__ import annotations

import collections
import json
import sys

import pytest

from hf_upipe.cli import main
from hf_upipe.planning import planner
from hf_upipe.planning.planner import default_impl
from hf_upipe.planning.train_step import StepSettings

TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=4,
    vocab_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
)


def _without_fused_block(monkeypatch) -> None:
    """Every hf_upipe module sees the fused block fail its check on the installed transformers (as on a release that
    changed Llama's attention arithmetic). The one place that knows the verdict: repoint it when it changes."""
    from hf_upipe import prepare  # noqa: F401 - bound before patching
    from hf_upipe.attention import fused
    from hf_upipe.models.verification import Verdict

    original = fused.fused_verdict

    def refuse_fused(arch):
        return Verdict(False, "failed", "the logits differ by 1.00e-02 (relative)")

    for module in list(sys.modules.values()):
        if (
            getattr(module, "__name__", "").startswith("hf_upipe")
            and getattr(module, "fused_verdict", None) is original
        ):
            monkeypatch.setattr(module, "fused_verdict", refuse_fused)


@pytest.fixture
def no_fused(monkeypatch, tmp_path):
    """The tiny Llama's config.json, with the fused block unavailable and the planner's simulation cache empty."""
    from transformers import LlamaConfig

    _without_fused_block(monkeypatch)
    monkeypatch.setattr(planner, "_SIMULATIONS", collections.OrderedDict())
    LlamaConfig(**TINY, tie_word_embeddings=False).save_pretrained(tmp_path)
    return [
        "plan",
        "--model",
        str(tmp_path / "config.json"),
        "--gpus",
        "2",
        "--seq-len",
        "4096",
        "--gpu-memory",
        "64GiB",
    ]


def test_the_default_plan_is_the_registered_path_and_says_why(no_fused, capsys):
    assert default_impl(TINY) == "upipe"
    assert main(no_fused) == 0
    out = capsys.readouterr()
    assert "settings: UPipe (registered)" in out.out, out.out
    assert (
        "note: the fused attention block is not planned: the fused block is not verified for LlamaAttention on "
        "transformers 5." in out.out
    )
    assert "the logits differ" in out.out and "pip install 'transformers>=" in out.out
    assert "fused UPipe" not in out.out and "UPIPE_FUSED_ATTENTION=false" in out.out
    assert "overlap_comm" not in out.out + out.err
    assert main(no_fused + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["impl"] == "upipe" and len(data["notes"]) == 1
    assert all(
        t["settings"]["impl"] == "upipe" and not t["settings"]["overlap"] for t in data["tried"]
    )


def test_no_overlap_plans_and_labels_the_registered_path(no_fused, capsys):
    assert main(no_fused + ["--no-overlap"]) == 0
    out = capsys.readouterr().out
    assert "settings: UPipe (registered)" in out and "fused UPipe" not in out


def test_only_the_flags_the_user_typed_are_refused(no_fused, capsys):
    assert main(no_fused + ["--overlap"]) == 2
    err = capsys.readouterr().err
    assert (
        "--overlap is a setting of the fused attention block, which this plan does not use" in err
    ), err
    assert "Leave --overlap out" in err and "overlap_comm" not in err
    assert main(no_fused + ["--fused-backward", "save", "--impl", "upipe"]) == 2
    err = capsys.readouterr().err
    assert "--fused-backward save is a setting of the fused attention block" in err, err
    assert "--impl upipe plans another" in err
    assert main(no_fused + ["--impl", "fused"]) == 2
    err = capsys.readouterr().err
    assert (
        "--impl fused: the fused block is not verified for LlamaAttention" in err
        and "--impl upipe" in err
    ), err


def test_fused_settings_are_refused_rather_than_mislabelled(no_fused):
    """The Python API with fixed fused settings: the simulation would measure the registered path (prepare_model
    keeps it), so the plan refuses instead of labelling those figures "fused UPipe"."""
    with pytest.raises(
        ValueError, match="fused attention block cannot be planned for this model: the fused block"
    ):
        planner.plan(TINY, gpus=2, seq_len=4096, settings=StepSettings("fused", 1))
