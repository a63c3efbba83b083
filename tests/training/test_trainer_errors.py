"""UPipeTrainer rejects bad settings at construction, on every rank, with the setting named as the user wrote it and
the fix in the message; a save that fails part-way leaves the previous checkpoint as the last complete one."""

import pytest

from tests._dist import run_distributed
from tests.training._runs import error_runs


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return run_distributed(error_runs, 2, str(tmp_path_factory.mktemp("errors")), timeout=240)


def test_bad_settings_fail_on_every_rank(seen):
    for rank in seen:
        assert (
            "sp_size=3 does not divide the 2 processes" in rank["sp3"] and "[1, 2]" in rank["sp3"]
        )
        assert "batch_eval_metrics=True and include_for_metrics=[]" in rank["metrics"]
        assert "set batch_eval_metrics=False" in rank["metrics"]
        assert (
            "hf_upipe needs 'labels'" in rank["labels"]
            and "DataCollatorForLanguageModeling" in rank["labels"]
        )


def test_model_and_setting_errors_at_construction(seen):
    """Each of these used to surface at the first forward (or the first save), after training had started."""
    for rank in seen:
        heads = rank["heads"]
        assert heads.startswith(
            "ValueError: UPipeConfig(heads_per_chunk=3) does not fit 8 query / 2 key-value heads "
            "on sp_size=2"
        ), heads
        assert (
            "[1, 2, 4]" in heads
            and "UPipeConfig(heads_per_chunk='all')" in heads
            and "None" not in heads
        )
        assert rank["heads_env"].startswith("ValueError: UPIPE_HEADS_PER_CHUNK=3 does not fit"), (
            rank["heads_env"]
        )
        assert (
            "UPipeConfig(kernel='flash_attn')" in rank["kernel"]
            and "cannot run on cpu" in rank["kernel"]
        )
        assert "UPipeConfig(offload='disk') needs activation checkpointing" in rank["offload"]
        assert "TrainingArguments(activation_checkpointing=True)" in rank["offload"]
        assert "UPipeConfig(sp_size=2) cannot split this model's attention" in rank["kv_heads"]
        assert "num_key_value_heads=3" in rank["kv_heads"] and "[1]" in rank["kv_heads"]
        assert "cannot be written" in rank["outdir"] and "a_file/run" in rank["outdir"]
        assert "found on rank" not in rank["outdir"]  # every rank found it
        assert (
            "cannot be written" in rank["outdir_rank1"]
            and "(found on rank 1)" in rank["outdir_rank1"]
        )


def test_an_imitated_error_inside_a_save_leaves_no_partial_checkpoint(seen):
    """Not a full disk (tests/training/test_full_disk.py makes one): any error raised inside the save."""
    for rank in seen:
        assert "an error inside the save (imitated)" in rank["save"]
        assert "checkpoint-2" not in rank["entries"] and "checkpoint-1" in rank["entries"], rank[
            "entries"
        ]
        assert rank["last"] == "checkpoint-1"
