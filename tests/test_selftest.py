"""`hf-upipe selftest` passes on the four supported architectures and fails loudly on a broken sharding."""

import pytest

from hf_upipe.cli import main
from hf_upipe.selftest import run_selftest


@pytest.mark.slow
def test_selftest_passes_on_the_supported_architectures():
    checks = run_selftest(["llama", "qwen2", "mistral", "qwen3"], sp=2)
    assert len(checks) == 4 * 2 * 4  # models x batches (padded, packed) x (loss, gradients, logits, eval loss)
    failed = [c for c in checks if not c.passed]
    assert not failed, failed
    assert {c.batch for c in checks} == {"padded", "packed"}


def test_selftest_fails_loudly_when_labels_are_shifted_inside_shards(capsys):
    assert main(["selftest", "--model", "qwen3", "--lora", "--break", "shard-shift"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "| qwen3 | padded | train loss |" in out
    assert "failed" in out.splitlines()[-1] and not out.splitlines()[-1].endswith(" 0 failed")
