"""UPipeTrainer equals transformers' Trainer on one process, step by step, for SP 2, SP 4 and SP 2 x DP 2.

Every run: a tiny random Llama (fp32, 8 query / 2 key-value heads), 32 random right-padded rows of 29 tokens (not a
multiple of 2 or 4: the SP padding path runs), gradient accumulation 2, AdamW with warmup and a linear schedule,
gradient clipping, eval every 2 steps. The reference is `transformers.Trainer` with "sdpa" on one process with the
same global batch (per-device batch x data-parallel replicas). Checked: the logged loss of every step, every eval
loss and the final trainable parameters, for a full fine-tune and for LoRA (PEFT), through the fused block and the
registered attention path, tiled and plain loss, with and without activation checkpointing (with the tiled MLP
and checkpoint inputs offloaded to disk), and packed batches (`DataCollatorWithFlattening`: every micro-batch is one
row of documents with restarting position_ids; the reference is transformers' own packed-sequence masking).
"""

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._runs import train_runs

RTOL = 2e-5  # fp32: reductions run in a different order across ranks


def _close(got: dict, want: dict, what: str) -> float:
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]), f"{what} step {step}: {got[step]} vs {want[step]}"
    return max(abs(got[step] - want[step]) / abs(want[step]) for step in want)


def _params_close(got: dict, want: dict, what: str) -> float:
    """Final parameters after 4 AdamW steps. The k_proj biases get gradients near zero (a bias added to every key
    cancels in the softmax up to RoPE), which Adam divides by their own size, so fp32 noise in them becomes ~1e-4 of
    the parameter; everything else agrees to ~1e-6."""
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = np.abs(got[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert err < 1e-3, f"{what}: parameter {name} differs, max rel err {err:.2e}"
    return max(np.abs(got[n] - r).max() / max(np.abs(r).max(), 1e-12) for n, r in want.items())


UPIPE_CASES = {
    # name: (world, spec overrides); batch is per device; the reference uses batch * dp
    "sp2_full_fused_tiled": (2, dict(sp=2, lora=False)),
    "sp2_lora_registered_plainloss": (2, dict(sp=2, lora=True, fused=False, tiled=False)),
    "sp4_full_checkpointing_tiledmlp_offload": (4, dict(sp=4, lora=False, checkpointing=True, tiled_mlp=True,
                                                       offload="disk")),
    "sp4_lora_ulysses_mode": (4, dict(sp=4, lora=True, heads_per_chunk="all")),
    "sp2dp2_full": (4, dict(sp=2, lora=False)),
    "sp2dp2_lora": (4, dict(sp=2, lora=True)),
    "sp2_packed_full": (2, dict(sp=2, lora=False, packed=True)),
    "sp2dp2_packed_lora": (4, dict(sp=2, lora=True, packed=True)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    base = dict(batch=2, eval_steps=2, steps=4, ga=2)
    refs = {}
    ref_specs = [dict(base, trainer="hf", lora=lora, batch=2 * dp, packed=packed,
                      output_dir=str(root / f"ref_{lora}_{dp}_{packed}"))
                 for lora, dp, packed in [(False, 1, False), (True, 1, False), (False, 2, False), (True, 2, False),
                                          (False, 1, True), (True, 2, True)]]
    for spec, out in zip(ref_specs, run_distributed(train_runs, 1, ref_specs, timeout=300)[0]):
        refs[(spec["lora"], spec["batch"] // 2, spec["packed"])] = out
    got = {}
    for world in (2, 4):
        names = [n for n, (w, _) in UPIPE_CASES.items() if w == world]
        specs = [dict(base, trainer="upipe", output_dir=str(root / n), **UPIPE_CASES[n][1]) for n in names]
        outs = run_distributed(train_runs, world, specs, timeout=300)
        for i, name in enumerate(names):
            got[name] = [rank_out[i] for rank_out in outs]
    return refs, got


@pytest.mark.parametrize("name", list(UPIPE_CASES))
def test_upipe_trainer_equals_single_process_trainer(runs, name):
    refs, got = runs
    world, spec = UPIPE_CASES[name]
    ref = refs[(spec["lora"], world // spec["sp"], spec.get("packed", False))]
    assert len(ref["losses"]) == 4 and len(ref["evals"]) == 2
    errs = [0.0, 0.0]
    for rank, out in enumerate(got[name]):  # every rank logs the same numbers
        errs[0] = max(errs[0], _close(out["losses"], ref["losses"], f"{name} rank {rank} train loss"))
        errs[1] = max(errs[1], _close(out["evals"], ref["evals"], f"{name} rank {rank} eval loss"))
    perr = _params_close(got[name][0]["params"], ref["params"], name)
    print(f"\n{name}: max rel err train loss {errs[0]:.1e}, eval loss {errs[1]:.1e}, final weights {perr:.1e}")


def test_trainer_logs_throughput_and_peak_memory(runs):
    _, got = runs
    out = got["sp2_full_fused_tiled"][0]
    assert {"tokens_per_second", "peak_memory_gib"} <= set(out["keys"])
    for tokens_per_s, peak in out["stats"]:
        assert tokens_per_s > 0 and 0 < peak < 64
