"""`hf-upipe selftest` passes on supported architectures (with and without a ring) and fails loudly on a broken
sharding.

The ranks start from the test suite's forkserver (`tests._dist`: torch and transformers imported once), not from
fresh interpreters, except in the vision-language test, which runs the command's own spawn as a user does
(its ranks import everything themselves: the rank function is importable in a fresh process).
"""

import functools

import pytest
import torch

import hf_upipe.tools.selftest
from hf_upipe.cli import main
from hf_upipe.tools.selftest import run_selftest
from tests import _dist  # noqa: F401  (sets the forkserver's preload)

FORKSERVER = dict(start_method="forkserver")


@pytest.fixture
def forkserver(monkeypatch):
    """`hf-upipe selftest` (the command) spawning its ranks from the suite's forkserver."""
    monkeypatch.setattr(
        hf_upipe.tools.selftest,
        "run_distributed",
        functools.partial(hf_upipe.tools.selftest.run_distributed, **FORKSERVER),
    )


@pytest.mark.slow
def test_selftest_passes_on_the_supported_architectures():
    checks = run_selftest(
        ["llama", "qwen3"], sp=2, **FORKSERVER
    )  # (every architecture: tests/integrations/test_architecture_matrix)
    assert (
        len(checks) == 2 * 2 * 4
    )  # models x batches (padded, packed) x (loss, gradients, logits, eval loss)
    failed = [c for c in checks if not c.passed]
    assert not failed, failed
    assert {c.batch for c in checks} == {"padded", "packed"}


def test_selftest_with_a_ring(capsys):
    """--ring: a ring of 2 (one rank per ring shard: its shard is two mirrored chunks), the padded batch exact;
    the packed row refused clearly (a check row that says so, not a silent skip); a ring that does not divide the
    ranks is refused before any spawn."""
    checks = run_selftest(["llama"], sp=2, ring=2, **FORKSERVER)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert [(c.batch, c.name) for c in checks if c.batch == "packed"] == [
        ("packed", "refused clearly")
    ]
    assert "Packed rows" in next(c.note for c in checks if c.batch == "packed")
    assert {c.name for c in checks if c.batch == "padded"} == {
        "train loss",
        "gradients",
        "logits",
        "eval loss",
    }
    assert main(["selftest", "--model", "llama", "--sp", "4", "--ring", "3"]) == 2
    assert "--ring 3 must divide --sp 4" in capsys.readouterr().err


@pytest.mark.slow
def test_selftest_fails_loudly_when_labels_are_shifted_inside_shards(capsys, forkserver):
    assert main(["selftest", "--model", "qwen3", "--lora", "--break", "shard-shift"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "| qwen3 | padded | train loss |" in out
    assert "failed" in out.splitlines()[-1] and not out.splitlines()[-1].endswith(" 0 failed")


def test_gradient_error_floors_noise_but_not_a_wrong_gradient():
    """A gradient that is zero in exact arithmetic differs between two summation orders by rounding noise only: it
    is measured against 1% of the model's largest gradient entry. A real gradient that is off still fails."""
    from hf_upipe.tools.selftest import GRADIENT_FLOOR, TOLERANCE, gradient_error

    gen = torch.Generator().manual_seed(0)
    scale = 0.3  # the model's largest gradient entry
    noise = torch.randn(16, generator=gen) * 1e-8  # a key bias' gradient: zero up to fp32 noise
    assert (
        gradient_error(noise + 5e-8, noise, scale) < TOLERANCE["gradients"]
    )  # noise over noise: not a failure
    real = torch.randn(16, generator=gen) * 1e-3  # a small but real gradient, below the floor
    assert float(real.abs().max()) < GRADIENT_FLOOR * scale
    assert (
        gradient_error(real * (1 + 1e-3), real, scale) > TOLERANCE["gradients"]
    )  # 0.1% off: fails all the same
    assert gradient_error(-real, real, scale) > 0.1  # the sign flipped: fails by far
    big = torch.randn(16, generator=gen) * scale
    assert (
        gradient_error(big * (1 + 2e-4), big, scale) > TOLERANCE["gradients"]
    )  # relative to itself above the floor


@pytest.mark.slow
def test_selftest_covers_a_vision_language_model(capsys):
    """A tiny Qwen2-VL with LoRA on images and text (hf_upipe.tools.vlm_check): every row passes, the vision tower's
    gradients among them; another SP size is refused before any spawn."""
    assert main(["selftest", "--model", "qwen2_vl", "--lora"]) == 0
    out = capsys.readouterr().out
    assert (
        "| qwen2_vl | images+video+text | vision-tower gradients |" in out
        and "4 passed, 0 failed" in out
    )
    assert main(["selftest", "--model", "qwen2_vl", "--sp", "4"]) == 2
    assert "qwen2_vl is checked at --sp 2" in capsys.readouterr().err
