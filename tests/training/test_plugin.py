"""UPipePlugin: FSDP2, exact evaluation and bad settings (spawned gloo ranks).

- FSDP2: accelerate runs FSDP on accelerators only, so on CPU the model is sharded with torch's `fully_shard`
  directly (what accelerate's FSDP2 does on GPUs); with the plugin's sharding, tiled MLP and token-weighted loss,
  3 AdamW steps at SP 2 and SP 2 x DP 2 (parameters sharded over all 4 ranks) equal one process, full and LoRA.
- Evaluation (`UPipeRuntime.evaluate`) of an eval set that does not divide into full batches, under FSDP2 at SP 2
  and SP 2 x DP 2, twice, equals the one-process token mean (no repeated examples, no hang when a replica runs
  out of batches).
- Bad settings fail on every rank with the fix in the message: unknown kernel, sp_size not dividing the
  processes, offload without checkpointing, a head chunk that does not divide the heads.
"""

import pytest

from tests._dist import run_distributed
from tests.training._plugin_runs import bad_settings, fsdp2_eval, fsdp2_steps


def _all(rank, world, cases):
    return [
        (fsdp2_steps(rank, world, lora, sp), fsdp2_eval(rank, world, lora, sp))
        for lora, sp in cases
    ]


CASES = [(False, 2), (True, 2)]


@pytest.fixture(scope="module")
def fsdp_runs():
    return {world: run_distributed(_all, world, CASES, timeout=300) for world in (2, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=["full", "lora"])
def test_fsdp2_with_sp_equals_one_process(fsdp_runs, case):
    lora, _ = CASES[case]
    ref = fsdp2_steps(0, 1, lora, 1)
    for world, ranks in fsdp_runs.items():
        for rank, out in enumerate(ranks):
            got = out[case][0]
            for a, b in zip(got, ref):
                assert abs(a - b) <= 2e-5 * abs(b), (world, rank, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=["full", "lora"])
def test_exact_evaluation_under_fsdp2(fsdp_runs, case):
    lora, _ = CASES[case]
    ref = fsdp2_eval(0, 1, lora, 1)
    for world, ranks in fsdp_runs.items():
        for rank, out in enumerate(ranks):
            for got in out[case][1]:
                assert abs(got - ref) <= 1e-5 * abs(ref), (world, rank, got, ref)


def test_bad_settings_fail_on_every_rank():
    for seen in run_distributed(bad_settings, 2, timeout=240):
        assert "Unknown attention kernel 'flash9'" in seen["kernel"]
        assert "sp_size=3 does not divide the 2 processes" in seen["sp"]
        assert "activation_checkpointing_enable" in seen["offload"]
        assert (
            "UPipePlugin(heads_per_chunk=3) does not fit 8 query / 2 key-value heads"
            in seen["heads"]
        )
        assert (
            "[1, 2, 4]" in seen["heads"]
            and "'all'" in seen["heads"]
            and "None" not in seen["heads"]
        )
        assert (
            "different hf_upipe settings (fused_backward: UPipePlugin(fused_backward='save') on rank 0, "
            "fused_backward='recompute' (the default) on rank 1; overlap_comm: UPipePlugin(overlap_comm=True) "
            "on rank 0, overlap_comm=False (the default) on rank 1)"
        ) in seen["differ"], seen["differ"]
