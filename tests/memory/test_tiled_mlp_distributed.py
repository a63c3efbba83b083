"""Tiled MLP under DDP and FSDP2 (gloo, 2 ranks, different data per rank): 3 SGD steps equal the untiled run,
full and LoRA, with and without activation checkpointing (one spawned run for all cases)."""

import pytest

from tests._dist import run_distributed
from tests.memory._dist_runs import CASES, compare_all


@pytest.fixture(scope="module")
def results():
    return run_distributed(compare_all, 2, timeout=300)


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{w}-lora{lo}-ckpt{c}" for w, lo, c in CASES]
)
def test_tiled_mlp_matches_untiled(results, case):
    for rank in results:
        got = rank[case]
        assert got["n"] > 0
        assert got["loss_rel"] < 1e-5, got
        assert got["param_rel"] < 1e-5, got
