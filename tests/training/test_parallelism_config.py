"""UPipeTrainer honours accelerate's ParallelismConfig (TrainingArguments(parallelism_config=...)): its sp_size is
the SP degree, the training equals UPipeConfig(sp_size=2) exactly, and accelerate/transformers see no SP of their
own; what hf_upipe cannot honour is refused on every rank at construction, with the numbers and the fix."""

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._parallelism_runs import parallelism_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    return run_distributed(parallelism_runs, 2, str(tmp_path_factory.mktemp("pc")), timeout=300)


def test_sp_size_is_honoured_exactly(seen):
    for rank in seen:
        assert rank["pc"]["sp_size"] == 2 and rank["upipe"]["sp_size"] == 2
        assert (
            rank["default"]["sp_size"] == 1
        )  # LOCAL_WORLD_SIZE=1: without the parallelism config, no SP
        assert rank["pc"]["accelerate_sp"] == (1, 1)  # accelerate: no SP, its DP over every process
        assert rank["upipe"]["accelerate_sp"] is None
        assert rank["pc"]["losses"] == rank["upipe"]["losses"] and len(rank["pc"]["losses"]) == 3
    pc, upipe = seen[0]["pc"]["params"], seen[0]["upipe"]["params"]
    assert pc.keys() == upipe.keys()
    for name in pc:
        np.testing.assert_array_equal(pc[name], upipe[name], err_msg=name)


def test_refusals_on_every_rank(seen):
    for rank in seen:
        assert "ParallelismConfig(sp_size=2) with DeepSpeed" in rank["deepspeed"], rank["deepspeed"]
        assert "two sequence-parallel systems" in rank["deepspeed"]
        assert "ParallelismConfig(cp_size=2) asks for context parallelism" in rank["cp"], rank["cp"]
        assert "ParallelismConfig(cp_size=1, sp_size=2)" in rank["cp"]
        assert (
            "UPipeConfig(sp_size=1) and ParallelismConfig(sp_size=2) disagree" in rank["disagree"]
        ), rank["disagree"]
        assert "= 4 processes, but this launch has 2" in rank["world"], rank["world"]
        assert "ParallelismConfig(dp_replicate_size=1)" in rank["world"]
        for key in ("deepspeed", "cp", "disagree", "world"):
            assert "found on rank" not in rank[key]  # every rank found it itself
            assert not rank[key + "_dir"]  # before transformers' Trainer ran
