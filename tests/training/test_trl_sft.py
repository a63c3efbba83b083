"""UPipeSFTTrainer on 2 gloo ranks (SP 2) and 4 (SP 2 x DP 2) equals trl.SFTTrainer on one process, step by step.

Every run: a tiny random Llama (fp32), 40 rows of random words through a word-level tokenizer with a chat template
(TRL tokenizes them, builds the labels from `completion_only_loss` or the template's `{% generation %}` assistant
mask (`assistant_only_loss`), packs them with `packing=True` (bfd) into rows of at most 40 tokens, and its
collator flattens each batch of packed rows into one padding-free row whose documents restart `position_ids`),
gradient accumulation 2, 4 steps of AdamW with warmup, a linear schedule and clipping. The reference is
`trl.SFTTrainer` with "sdpa" on one process with the same global batch (TRL's own fused LM head loss). Checked:
the logged loss, grad norm, `entropy`, `mean_token_accuracy` and `num_tokens` of every step and the final
trainable parameters (relative 1e-4; 1e-3 for the k_proj biases, whose near-zero gradients Adam amplifies).
Cases: prompt-completion with `completion_only_loss`, full and LoRA (`peft_config`), and full with activation
checkpointing and the tiled MLP; packed conversations with `assistant_only_loss` and LoRA; plain text (loss on
every token); unpacked rows right-padded with an attention mask and truncated by `max_length`, or padding-free.
The 4-rank conversational case takes its SP degree from `SFTConfig(parallelism_config=ParallelismConfig(
sp_size=2, dp_replicate_size=2))`.
"""

import numpy as np
import pytest

pytest.importorskip("trl")

from tests._dist import run_distributed  # noqa: E402
from tests.training._trl_runs import EVAL_METRICS, sft_runs  # noqa: E402

RTOL = 1e-4
KPROJ_BIAS_RTOL = 1e-3
pytestmark = pytest.mark.slow  # multi-process runs of several steps: the full suite runs them

CONVERSATIONAL = dict(kind="conversational", assistant_only_loss=True, completion_only_loss=None)
CKPT_TILED_MLP = dict(lora=False, checkpointing=True, tiled_mlp=True)

# name: (world, spec); "batch" is per device, the one-process reference uses batch x dp (the same global batch)
CASES = {
    "sp2_packed_completion_only_full": (2, dict(lora=False)),
    "sp2_packed_completion_only_lora": (2, dict(lora=True)),
    "sp2_packed_text_full": (2, dict(lora=False, kind="text", completion_only_loss=False)),
    # right-padded rows with attention_mask, truncated by max_length (rows reach 25 tokens)
    "sp2_padded_truncated_completion_only_full": (
        2,
        dict(lora=False, packing=False, max_length=16),
    ),
    # unpacked rows flattened padding-free (TRL enforces no max_length there)
    "sp2_padding_free_full": (
        2,
        dict(lora=False, packing=False, padding_free=True, max_length=None),
    ),
    # also evaluated after training: 20 conversations, packed, in eval batches of 3 rows
    "sp2_packed_conversational_assistant_only_lora": (
        2,
        dict(lora=True, eval_rows=20, **CONVERSATIONAL),
    ),
    "sp2_packed_completion_only_full_ckpt_tiled_mlp": (2, CKPT_TILED_MLP),
    # 100 rows: the 4 steps stay inside the first epoch (accelerate fills a replica's last short batch with rows
    # from the start, where one process takes a shorter batch)
    "sp2dp2_packed_conversational_assistant_only_lora": (
        4,
        # the SP degree from SFTConfig(parallelism_config=ParallelismConfig(sp_size=2, dp_replicate_size=2)),
        # none in UPipeConfig (whose default would be all 4 processes)
        dict(dp=2, rows=100, eval_rows=30, lora=True, parallelism_config=True, **CONVERSATIONAL),
    ),
    "sp2dp2_packed_completion_only_full_ckpt_tiled_mlp": (
        4,
        dict(dp=2, rows=100, **CKPT_TILED_MLP),
    ),
}
METRICS = ("losses", "grad_norms", "entropy", "mean_token_accuracy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (reference run, [run of each rank]); the cases of one world size run together, when first asked."""
    root = tmp_path_factory.mktemp("trl")
    done: dict = {}

    def get(name):
        if name not in done:
            world = CASES[name][0]
            names = [n for n in CASES if CASES[n][0] == world]
            refs = run_distributed(
                sft_runs,
                1,
                [
                    dict(trainer="trl", output_dir=str(root / f"ref_{n}"), **CASES[n][1])
                    for n in names
                ],
                timeout=600,
            )[0]
            specs = [
                dict(trainer="upipe", sp=2, output_dir=str(root / n), **CASES[n][1]) for n in names
            ]
            got = run_distributed(sft_runs, world, specs, timeout=900)
            for i, n in enumerate(names):
                done[n] = (refs[i], [rank_out[i] for rank_out in got])
        return done[name]

    return get


def _close(got: dict, want: dict, what: str) -> float:
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]) + 1e-12, (
            f"{what} step {step}: {got[step]} vs {want[step]}"
        )
    return max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in want)


@pytest.mark.parametrize("name", list(CASES))
def test_upipe_sft_trainer_equals_single_process_sft_trainer(runs, name):
    ref, got = runs(name)
    assert len(ref["losses"]) == 4
    labelled, tokens = ref["n_label_tokens"]
    masked = CASES[name][1].get("kind") != "text"  # prompt or user tokens are left out of the loss
    assert 0 < labelled < tokens if masked else labelled == tokens, (labelled, tokens)
    assert got[0]["n_label_tokens"] == ref["n_label_tokens"]
    assert [out["sp_size"] for out in got] == [2] * len(got)
    if CASES[name][1].get("eval_rows"):  # TRL's eval metrics, from hf_upipe's exact eval loop
        assert sorted(ref["eval"]) == sorted(EVAL_METRICS), ref["eval"]
        for rank, out in enumerate(got):
            assert out["eval"].keys() == ref["eval"].keys(), (rank, out["eval"])
            for key, want in ref["eval"].items():
                assert abs(out["eval"][key] - want) <= RTOL * abs(want), (rank, key, out, ref)
    spec = CASES[name][1]
    assert got[0]["tiled_mlp"] == bool(spec.get("tiled_mlp"))
    assert got[0]["checkpointing"] == ref["checkpointing"] == bool(spec.get("checkpointing"))
    if CASES[name][1].get("dp"):
        assert ref["epoch"] < 1, ref["epoch"]
    assert all(v > 0 for v in ref["entropy"].values())
    errs = {}
    for rank, out in enumerate(got):  # every rank logs the same numbers
        for what in METRICS:
            errs[what] = max(
                errs.get(what, 0.0), _close(out[what], ref[what], f"{name} rank {rank} {what}")
            )
        assert out["num_tokens"] == ref["num_tokens"], (
            name,
            rank,
            out["num_tokens"],
            ref["num_tokens"],
        )
    want, have = ref["params"], got[0]["params"]
    assert want.keys() == have.keys()
    perr = 0.0
    for n, r in want.items():
        err = np.abs(have[n] - r).max() / max(np.abs(r).max(), 1e-12)
        # k_proj biases: gradients near zero (a bias added to every key cancels in the softmax up to RoPE), which
        # Adam divides by their own size, so fp32 noise in them reaches ~2e-4 (tests/training/test_trainer.py)
        bound = KPROJ_BIAS_RTOL if n.endswith("k_proj.bias") else RTOL
        assert err < bound, f"{name}: parameter {n} differs, max rel err {err:.2e}"
        perr = max(perr, err) if bound == RTOL else perr
    print(
        f"\n{name}: max rel err "
        + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        + f", final weights (but k_proj biases) {perr:.1e}"
    )
