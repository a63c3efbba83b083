"""UPipeTrainer equals transformers' Trainer on one process, step by step, for SP 2, SP 4 and SP 2 x DP 2.

Every run: a tiny random Llama (fp32, 8 query / 2 key-value heads), 32 random right-padded rows of 29 tokens (not a
multiple of 2 or 4: the SP padding path runs), gradient accumulation 2 (1 in one case), AdamW with warmup and a
linear schedule, gradient clipping. Eval after every step (4 times) on 9 rows, which never divide into full batches
(batches of 2 per device: 2,2,2,2,1 on one replica; rounds of 4,4,1 on two, where one replica runs out of batches
and runs a throw-away forward), then `evaluate()` twice more after training. The reference is
`transformers.Trainer` with "sdpa" on one process with the same global batch (per-device batch x data-parallel
replicas). Checked: the logged loss and grad norm of every step, every eval loss (1e-5 relative) and the final
trainable parameters, for a full fine-tune and for LoRA (PEFT), through the fused block and the registered
attention path, tiled and plain loss, with and without activation checkpointing (with the tiled MLP and checkpoint
inputs offloaded to disk), packed batches (`DataCollatorWithFlattening`), a streamed (iterable) eval set, and a
first step whose batches carry no label tokens (logged as 0 with grad norm 0, as the Trainer does), and two hybrids
(LFM2 with short-convolution layers, full; Bamba with Mamba2 layers, LoRA with checkpointing at SP 4) instead of the
Llama.
"""

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._runs import train_runs

RTOL = 2e-5  # fp32 training losses: reductions run in a different order across ranks
EVAL_RTOL = 1e-5  # the bar for eval_loss

pytestmark = pytest.mark.slow  # multi-process runs of several steps: the full suite runs them


def _close(got: dict, want: dict, what: str, rtol: float = RTOL) -> float:
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert abs(got[step] - want[step]) <= rtol * abs(want[step]) + 1e-12, (
            f"{what} step {step}: {got[step]} vs {want[step]}"
        )
    return max(abs(got[step] - want[step]) / max(abs(want[step]), 1e-12) for step in want)


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
    "sp2_no_label_step_ga1": (2, dict(sp=2, lora=False, unlabeled=2, ga=1)),  # step 1: rows 0-1
    "sp4_full_checkpointing_tiledmlp_offload": (
        4,
        dict(sp=4, lora=False, checkpointing=True, tiled_mlp=True, offload="disk"),
    ),
    "sp4_lora_ulysses_mode": (4, dict(sp=4, lora=True, heads_per_chunk="all")),
    # UPipe over 2 ranks x a ring of 2 (ring order sharding, padded to a multiple of 2 * sp_size)
    "sp4_ring2x2_lora_checkpointing_tiledmlp_offload": (
        4,
        dict(sp=4, ring=2, lora=True, checkpointing=True, tiled_mlp=True, offload="disk"),
    ),
    "sp2dp2_full": (4, dict(sp=2, lora=False)),
    "sp2dp2_lora": (4, dict(sp=2, lora=True)),
    "sp2dp2_no_label_step": (4, dict(sp=2, lora=True, unlabeled=8)),  # step 1: rows 0-7
    "sp2dp2_iterable_eval": (4, dict(sp=2, lora=False, iterable_eval=True)),
    "sp2_packed_full": (2, dict(sp=2, lora=False, packed=True)),
    "sp2dp2_packed_lora": (4, dict(sp=2, lora=True, packed=True)),
    # hybrids: Qwen3-Next's gated DeltaNet (all ranks at once), Bamba's Mamba2 (state passed rank to rank)
    "sp2_qwen3next_full_checkpointing": (
        2,
        dict(sp=2, lora=False, arch="qwen3_next", checkpointing=True),
    ),
    "sp4_bamba_lora_checkpointing": (4, dict(sp=4, lora=True, arch="bamba", checkpointing=True)),
}
BASE = dict(batch=2, eval_steps=2, steps=4, ga=2, evaluate_again=2)  # evaluation at steps 2 and 4
REF_KEYS = (
    "lora",
    "packed",
    "unlabeled",
    "ga",
    "arch",
)  # what the one-process reference run shares with a case


def _ref_key(world: int, spec: dict) -> tuple:
    return (world // spec["sp"],) + tuple(spec.get(k, BASE.get(k)) for k in REF_KEYS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    keys = sorted({_ref_key(w, spec) for w, spec in UPIPE_CASES.values()}, key=str)
    ref_specs = [
        dict(
            BASE,
            trainer="hf",
            batch=2 * key[0],
            **dict(zip(REF_KEYS, key[1:])),
            output_dir=str(root / f"ref_{i}"),
        )
        for i, key in enumerate(keys)
    ]
    refs = dict(zip(keys, run_distributed(train_runs, 1, ref_specs, timeout=300)[0]))
    got = {}
    for world in (2, 4):
        names = [n for n, (w, _) in UPIPE_CASES.items() if w == world]
        specs = [
            dict(BASE, trainer="upipe", output_dir=str(root / n), **UPIPE_CASES[n][1])
            for n in names
        ]
        outs = run_distributed(train_runs, world, specs, timeout=400)
        for i, name in enumerate(names):
            got[name] = [rank_out[i] for rank_out in outs]
    return refs, got


@pytest.mark.parametrize("name", list(UPIPE_CASES))
def test_upipe_trainer_equals_single_process_trainer(runs, name):
    refs, got = runs
    world, spec = UPIPE_CASES[name]
    ref = refs[_ref_key(world, spec)]
    assert len(ref["losses"]) == 4 and len(ref["evals"]) == 2 and len(ref["again"]) == 2
    errs = [0.0, 0.0]
    for rank, out in enumerate(got[name]):  # every rank logs the same numbers
        errs[0] = max(
            errs[0], _close(out["losses"], ref["losses"], f"{name} rank {rank} train loss")
        )
        _close(out["grad_norms"], ref["grad_norms"], f"{name} rank {rank} grad norm", rtol=1e-4)
        errs[1] = max(
            errs[1], _close(out["evals"], ref["evals"], f"{name} rank {rank} eval loss", EVAL_RTOL)
        )
        for i, (a, b) in enumerate(
            zip(out["again"], ref["again"])
        ):  # evaluate() after training, twice
            assert abs(a - b) <= EVAL_RTOL * abs(b), (
                f"{name} rank {rank}: evaluate() #{i + 1}: {a} vs {b}"
            )
        assert out["again"][0] == out["again"][1], (
            f"{name}: two evaluate() of the same weights differ"
        )
    perr = _params_close(got[name][0]["params"], ref["params"], name)
    print(
        f"\n{name}: max rel err train loss {errs[0]:.1e}, eval loss {errs[1]:.1e}, final weights {perr:.1e}"
    )


def test_a_step_without_label_tokens_logs_what_the_trainer_logs(runs):
    refs, got = runs
    for name in ("sp2_no_label_step_ga1", "sp2dp2_no_label_step"):
        world, spec = UPIPE_CASES[name]
        ref = refs[_ref_key(world, spec)]
        assert (
            ref["losses"][1] == 0.0 and ref["grad_norms"][1] == 0.0
        )  # the Trainer logs 0 for such a step
        for out in got[name]:
            assert out["losses"][1] == 0.0 and out["grad_norms"][1] == 0.0, (name, out["losses"])


def test_trainer_logs_throughput_and_peak_memory(runs):
    _, got = runs
    out = got["sp2_full_fused_tiled"][0]
    assert {"tokens_per_second", "peak_memory_gib"} <= set(out["keys"])
    for tokens_per_s, peak in out["stats"]:
        assert tokens_per_s > 0 and 0 < peak < 64
