"""UPipeGRPOTrainer on 2 gloo ranks (SP 2) and 4 (SP 2 x DP 2) equals trl.GRPOTrainer on one process, step by
step; its refusals and its sequence layout.

Every run: a tiny random Llama (fp32), 16 prompts of 3-9 random words (word-level tokenizer), 4 completions of at
most 6 tokens per prompt, two verifiable rewards (the share of words among w0..w29, the length), AdamW (SGD for the
full fine-tune, whose weight changes are compared) with clipping, 3 steps (2 for each loss type). The reference is
`trl.GRPOTrainer` with "sdpa" on one process with the global batch. Checked on every rank: every value TRL logs at
every step (loss, grad norm, rewards and their spreads, completion lengths, num_tokens, kl, entropy, the clip
ratios or the loss type's own statistic), relative 1e-4, and the final trainable parameters (relative 1e-4).

Completions on SP 2 are sampled on both sides (TRL: `model.generate`; hf_upipe: `hf_upipe.generate` with the
draws on SP rank 0, so the same seed draws the same tokens); on SP 2 x DP 2 both replay the same completions
through TRL's `rollout_func` (a data-parallel replica samples from another seed than one process), with one
micro-batch per step (a replica shuffles its own rows into micro-batches; TRL's per-micro-batch token means, kl and
entropy, then equal one process's).
"""

import numpy as np
import pytest

pytest.importorskip("trl")

from tests._dist import run_distributed  # noqa: E402
from tests.training._grpo_runs import grpo_runs  # noqa: E402

RTOL = 1e-4

# num_iterations 2 with no warmup, a large SGD step and a narrow clip range: the second pass over a generation
# batch sees a moved policy, so the ratios clip (the old policy's log-probabilities are scored too). SGD: the
# weight changes are the clipped gradients (AdamW divides fp32 noise in a near-cancelling second step by itself)
MOVED = dict(
    num_iterations=2, optim="sgd", lr=0.5, run=dict(warmup_steps=0), grpo=dict(epsilon=0.05)
)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

CASES = {  # world: ranks of the UPipeGRPOTrainer run (SP 2 x DP world/2); the reference takes the global batch
    "sp2_lora_beta": dict(world=2, lora=True, beta=0.1, loss_type="grpo", gen="sample", save=True),
    # a full fine-tune loaded from a folder, its reference model loaded by TRL from the same folder (beta > 0)
    "sp2_full_checkpointing_tiled_mlp": dict(
        world=2,
        from_path=True,
        beta=0.1,
        checkpointing=True,
        tiled_mlp=True,
        optim="sgd",
        lr=0.5,
        gen="sample",
    ),
    **{
        f"sp2_lora_{t}": dict(
            world=2, lora=True, beta=0.1, loss_type=t, gen="sample", steps=2, **MOVED
        )
        for t in LOSS_TYPES
    },
}
# more of TRL's options, one per loss-type run: each changes which tokens or sequences count, or how
CASES["sp2_lora_bnpo"]["grpo"] = dict(epsilon=0.05, mask_truncated_completions=True)
CASES["sp2_lora_dr_grpo"]["grpo"] = dict(epsilon=0.05, scale_rewards="batch")
CASES["sp2_lora_cispo"]["grpo"] = dict(
    epsilon=0.05, epsilon_high=1.05, off_policy_mask_threshold=0.05
)
CASES["sp2_lora_luspo"]["grpo"] = dict(
    epsilon=0.05, importance_sampling_level="sequence"
)  # as its paper
CASES["sp2_lora_sapo"]["grpo"] = dict(epsilon=0.05, top_entropy_quantile=0.6, entropy_coef=0.01)
CASES |= {
    "sp2_dp2_lora_beta": dict(world=4, lora=True, beta=0.1, gen="replay", ga=1, **MOVED),
}
# the entropy quantile gathers over the data-parallel replicas (the entropy bonus is a token mean per process
# in TRL: a data-parallel run averages the replicas' means, so it is compared on SP 2 above)
CASES["sp2_dp2_lora_beta"]["grpo"] = dict(epsilon=0.05, top_entropy_quantile=0.6)


def _spec(name: str, **extra) -> dict:
    return {k: v for k, v in CASES[name].items() if k != "world"} | extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    names = list(CASES)
    refs = run_distributed(
        grpo_runs,
        1,
        [
            _spec(n, trainer="trl", dp=CASES[n]["world"] // 2, output_dir=str(root / f"ref_{n}"))
            for n in names
        ],
        timeout=600,
    )[0]
    got = {}
    for world in sorted({c["world"] for c in CASES.values()}):
        mine = [n for n in names if CASES[n]["world"] == world]
        outs = run_distributed(
            grpo_runs,
            world,
            [
                _spec(n, trainer="upipe", sp=2, dp=world // 2, output_dir=str(root / n))
                for n in mine
            ],
            timeout=600,
        )
        got |= {n: [rank_out[i] for rank_out in outs] for i, n in enumerate(mine)}
    return {n: (refs[i], got[n]) for i, n in enumerate(names)}


def _err(have, want) -> float:
    return abs(have - want) / abs(want) if abs(want) > 1e-6 else abs(have - want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_upipe_grpo_trainer_equals_single_process_grpo_trainer(runs, name):
    ref, got = runs[name]
    case = CASES[name]
    steps = case.get("steps", 3)
    assert sorted(ref["logs"]["loss"]) == list(range(1, steps + 1))
    assert got[0]["attn"] == "upipe" and (got[0]["tiled"] > 0) == case.get("tiled_mlp", False)
    assert got[0]["checkpointing"] == case.get("checkpointing", False)
    if case.get("from_path"):  # the reference model runs under the same SP
        assert got[0]["ref_attn"] == "upipe" and ref["ref_attn"] is not None
    assert all(out["generation_batch_size"] == ref["generation_batch_size"] for out in got)
    if case.get("save"):  # UPipeTrainer's atomic checkpoint, through GRPOTrainer's (model card)
        assert got[0]["saved"] == ["README.md", "checkpoint-3"], got[0]["saved"]
    errs = {}
    for rank, out in enumerate(got):  # every rank logs the same numbers
        assert set(ref["logs"]) <= set(out["logs"]), set(ref["logs"]) - set(out["logs"])
        for key, want in ref["logs"].items():
            have = out["logs"][key]
            assert have.keys() == want.keys(), (name, key)
            for step in want:
                assert (want[step] is None) == (have[step] is None), (name, rank, key, step)
                if want[step] is None:
                    continue
                e = _err(have[step], want[step])
                assert e <= RTOL, (
                    f"{name} rank {rank} {key} step {step}: {have[step]} vs {want[step]}"
                )
                errs[key] = max(errs.get(key, 0.0), e)
    # the values compared are not trivially equal: the policy moves away from the reference, rewards spread
    assert any(v > 0 for v in ref["logs"]["reward_std"].values())
    if case.get("beta"):
        assert any(v > 1e-3 for v in ref["logs"]["kl"].values())
    if case.get("num_iterations", 1) > 1 and case.get("loss_type", "dapo") in LOSS_TYPES[:4]:
        assert any(v > 0 for v in ref["logs"]["clip_ratio/region_mean"].values()), ref["logs"]
    want, have = ref["params"], got[0]["params"]
    assert want.keys() == have.keys()
    if case.get("optim") == "sgd":  # compare the changes: (final - initial weights)
        want = {n: w - ref["initial"][n] for n, w in want.items()}
        have = {n: w - got[0]["initial"][n] for n, w in have.items()}
        assert all(np.array_equal(ref["initial"][n], got[0]["initial"][n]) for n in want)
    perr = 0.0
    for n, r in want.items():
        err = np.abs(have[n] - r).max() / max(np.abs(r).max(), 1e-12)
        assert err < RTOL, f"{name}: parameter {n} differs, max rel err {err:.2e}"
        perr = max(perr, err)
    worst = max(errs, key=errs.get)
    print(
        f"\n{name}: largest logged difference {errs[worst]:.1e} ({worst}); final weights {perr:.1e}"
    )
