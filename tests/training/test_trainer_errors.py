"""UPipeTrainer rejects bad settings on every rank with the fix in the message, and a save that fails part-way
leaves the previous checkpoint as the last complete one (no partial checkpoint-N)."""

import pytest

from tests._dist import run_distributed
from tests.training._runs import error_runs


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return run_distributed(error_runs, 2, str(tmp_path_factory.mktemp("errors")), timeout=240)


def test_bad_settings_fail_on_every_rank(seen):
    for rank in seen:
        assert "sp_size=3 does not divide the 2 processes" in rank["sp3"] and "[1, 2]" in rank["sp3"]
        assert "compute_metrics needs full-sequence logits" in rank["metrics"]
        assert "UPipeTrainer needs 'labels'" in rank["labels"] and "DataCollatorForLanguageModeling" in rank["labels"]


def test_failed_save_leaves_no_partial_checkpoint(seen):
    for rank in seen:
        assert "disk full (simulated)" in rank["save"]
        assert "checkpoint-2" not in rank["entries"] and "checkpoint-1" in rank["entries"], rank["entries"]
        assert rank["last"] == "checkpoint-1"
