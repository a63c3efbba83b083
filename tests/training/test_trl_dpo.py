"""UPipeDPOTrainer on 2 gloo ranks (SP 2) and 4 (SP 2 x DP 2) equals trl.DPOTrainer on one process, step by
step; its refusals.

Every run: a tiny random Llama (fp32), 24 preference rows of random words (prompt, chosen, rejected; every other
chosen completion is the initial model's greedy continuation) through a word-level tokenizer (TRL extracts the
prompt, tokenizes, adds EOS, truncates to 24 tokens and collates each batch of 2 pairs into 4 right-padded rows
[chosen, chosen, rejected, rejected] with a completion mask), beta 0.5, gradient
accumulation 2, 3 steps of AdamW with warmup, a linear schedule and clipping. The reference is `trl.DPOTrainer`
with "sdpa" on one process, with the global batch (2 pairs per SP group, times the DP degree). Checked: every
logged value of every step (loss, grad norm, rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected, logits/chosen, logits/rejected, entropy, mean_token_accuracy;
num_tokens exactly) on every rank, and the final trainable parameters (relative 1e-4), for LoRA through
`peft_config` (reference: the base model, adapters disabled; AdamW; a checkpoint saved), a full fine-tune with a
separate reference model, activation checkpointing and the tiled MLP (SGD: the weight changes, i.e. the clipped
gradients, are compared), LoRA with every loss type TRL 1.16 offers weighted and summed (label smoothing 0.1),
LoRA with `precompute_ref_log_probs=True` (the columns checked present on both sides) and `padding_free=True`
(which TRL 1.16 turns off itself), and LoRA on SP 2 x DP 2
(AdamW). Each loss type alone and each f-divergence: against TRL's `_compute_loss` in one
process (fast).
"""

import numpy as np
import pytest

pytest.importorskip("trl")

from hf_upipe.trl.dpo_losses import DPO_LOSS_TYPES  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests.training._dpo_runs import METRICS, dpo_runs  # noqa: E402

RTOL = 1e-4
KPROJ_BIAS_RTOL = 1e-3

CASES = {  # world: ranks of the UPipeDPOTrainer run (SP 2 x DP world/2); the reference takes the global batch
    "sp2_lora": dict(lora=True, world=2, save=True),  # also writes checkpoint-3
    # SGD: the weight changes are the clipped gradients themselves (AdamW turns fp32 noise in a near-zero
    # gradient entry into a full step, e.g. one embedding entry at 5e-4 relative)
    "sp2_full_checkpointing_tiled_mlp": dict(
        lora=False, world=2, checkpointing=True, tiled_mlp=True, optim="sgd", lr=1.0
    ),
    # every loss type TRL 1.16 offers, weighted and summed (each alone: the fast test against _compute_loss)
    "sp2_lora_all_loss_types": dict(
        lora=True,
        world=2,
        dpo=dict(
            loss_type=list(DPO_LOSS_TYPES),
            loss_weights=[0.5 + 0.1 * i for i in range(len(DPO_LOSS_TYPES))],
            label_smoothing=0.1,
        ),
    ),
    # the reference log-probabilities precomputed before training (sharded, after hf_upipe's setup)
    # and padding_free=True, which TRL 1.16 turns off itself (it warns and pads): the same on both sides
    "sp2_lora_precompute": dict(
        lora=True, world=2, dpo=dict(precompute_ref_log_probs=True, padding_free=True)
    ),
    # the SP degree from DPOConfig(parallelism_config=ParallelismConfig(sp_size=2, dp_replicate_size=2))
    "sp2_dp2_lora": dict(lora=True, world=4, parallelism_config=True),
}


def _spec(name: str, **extra) -> dict:
    return {k: v for k, v in CASES[name].items() if k != "world"} | extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    names = list(CASES)
    refs = run_distributed(
        dpo_runs,
        1,
        [
            _spec(n, trainer="trl", output_dir=str(root / f"ref_{n}"), batch=CASES[n]["world"])
            for n in names
        ],
        timeout=400,
    )[0]
    got = {}
    for world in sorted({c["world"] for c in CASES.values()}):
        mine = [n for n in names if CASES[n]["world"] == world]
        outs = run_distributed(
            dpo_runs,
            world,
            [_spec(n, trainer="upipe", sp=2, batch=2, output_dir=str(root / n)) for n in mine],
            timeout=600,
        )
        got |= {n: [rank_out[i] for rank_out in outs] for i, n in enumerate(mine)}
    return {n: (refs[i], got[n]) for i, n in enumerate(names)}


def _close(got: dict, want: dict, what: str) -> float:
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert want[step] is not None and got[step] is not None, (what, step, got, want)
        assert abs(got[step] - want[step]) <= RTOL * abs(want[step]) + 1e-7, (
            f"{what} step {step}: {got[step]} vs {want[step]}"
        )
    return max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_upipe_dpo_trainer_equals_single_process_dpo_trainer(runs, name):
    ref, got = runs[name]
    assert len(ref["logs"]["loss"]) == 3
    tiled = CASES[name].get("tiled_mlp", False)
    for model, (attn, n_tiled) in got[0][
        "prepared"
    ].items():  # the reference runs under the same SP
        assert attn == "upipe" and (n_tiled > 0) == tiled, (name, model, attn, n_tiled)
    assert all("does not evaluate" in (out["evaluate_refused"] or "") for out in got)
    precomputed = CASES[name].get("dpo", {}).get("precompute_ref_log_probs", False)
    assert (
        all(out["precomputed"] == precomputed for out in got) and ref["precomputed"] == precomputed
    )
    if CASES[name].get(
        "save"
    ):  # UPipeTrainer's atomic checkpoint, through DPOTrainer's (model card)
        assert got[0]["saved"] == ["README.md", "checkpoint-3"], got[0]["saved"]
    assert set(got[0]["prepared"]) == (
        {"policy"} if CASES[name]["lora"] else {"policy", "reference"}
    )
    errs = {}
    for rank, out in enumerate(got):  # every rank logs the same numbers
        assert set(METRICS) <= set(out["keys"]), out["keys"]
        for metric in METRICS:
            want, have = ref["logs"][metric], out["logs"][metric]
            if metric == "num_tokens":
                assert have == want, (name, rank, have, want)
                continue
            errs[metric] = max(
                errs.get(metric, 0.0), _close(have, want, f"{name} rank {rank} {metric}")
            )
    # the values compared are not trivially equal: the rewards move, some chosen tokens are the model's top 1
    assert any(abs(v) > 1e-4 for v in ref["logs"]["rewards/margins"].values())
    assert any(v > 0 for v in ref["logs"]["mean_token_accuracy"].values())
    want, have = ref["params"], got[0]["params"]
    assert want.keys() == have.keys()
    if CASES[name].get("optim") == "sgd":  # compare the changes: (final - initial weights)
        want = {n: w - ref["initial"][n] for n, w in want.items()}
        have = {n: w - got[0]["initial"][n] for n, w in have.items()}
        assert all(np.array_equal(ref["initial"][n], got[0]["initial"][n]) for n in want)
    perr = 0.0
    for n, r in want.items():
        err = np.abs(have[n] - r).max() / max(np.abs(r).max(), 1e-12)
        # k_proj biases: near-zero gradients that Adam divides by their own size (tests/training/test_trainer.py)
        bound = KPROJ_BIAS_RTOL if n.endswith("k_proj.bias") else RTOL
        assert err < bound, f"{name}: parameter {n} differs, max rel err {err:.2e}"
        perr = max(perr, err) if bound == RTOL else perr
    print(
        f"\n{name}: max rel err "
        + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        + f"; final weights {perr:.1e}"
    )


# ---- fast: refusals and sharding (one process) ---------------------------------------------------------------
REFUSED = {
    "loss_type": (dict(loss_type=["bogus"]), "loss_type"),
    "ld_alpha": (dict(ld_alpha=0.5), "ld_alpha"),
    "use_weighting": (dict(use_weighting=True), "use_weighting"),
    "liger": (dict(use_liger_kernel=True), "use_liger_kernel"),
    "offloading": (dict(activation_offloading=True), "activation_offloading"),
    "sync_ref": (dict(sync_ref_model=True), "sync_ref_model"),
    "eval": (dict(eval_strategy="steps", eval_steps=1), "eval_strategy"),
    "selective": (
        dict(gradient_checkpointing_kwargs={"selective": True}),
        "selective",
    ),
}


def _config(tmp_path, **kwargs):
    from trl import DPOConfig

    return DPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_dpo_config_errors_name_each_setting_and_the_fix(tmp_path):
    from hf_upipe.trl import dpo_config_errors

    assert dpo_config_errors(_config(tmp_path)) == []
    for name, (kwargs, setting) in REFUSED.items():
        errors = dpo_config_errors(_config(tmp_path, **kwargs))
        assert len(errors) == 1, (name, errors)
        assert isinstance(errors[0], NotImplementedError) and setting in str(errors[0]), (
            name,
            errors,
        )
    assert "compute_metrics" in str(
        dpo_config_errors(_config(tmp_path), compute_metrics=lambda p: {})[0]
    )


def test_upipe_dpo_trainer_refuses_before_any_setup(tmp_path):
    from hf_upipe.trl import UPipeDPOTrainer
    from tests.training._dpo_runs import preference_dataset
    from tests.training._trl_runs import _model, tokenizer

    with pytest.raises(NotImplementedError, match="ld_alpha"):
        UPipeDPOTrainer(
            model=_model(seed=1),
            args=_config(tmp_path, ld_alpha=0.5),
            train_dataset=preference_dataset(4, seed=1),
            processing_class=tokenizer(),
        )
    with pytest.raises(TypeError, match="DPOConfig"):
        from transformers import TrainingArguments

        UPipeDPOTrainer(model=_model(seed=1), args=TrainingArguments(output_dir=str(tmp_path)))


def test_shard_preference_batch_covers_each_completion_once():
    import torch
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from hf_upipe.trl.dpo import shard_preference_batch

    examples = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 3], "rejected_ids": [10, 3]},
        {"prompt_ids": [11, 12], "chosen_ids": [13, 3], "rejected_ids": [14, 15, 16, 3]},
    ]
    batch = DataCollatorForPreference(pad_token_id=0)(
        examples
    )  # [4, 7]: chosen, chosen, rejected, rejected
    P = 3
    shards = [shard_preference_batch(batch, _state(r, P)) for r in range(P)]
    labels = torch.cat([s["shift_labels"] for s in shards], dim=1)  # [4, 9]: padded to 3 x 3
    ids = batch["input_ids"]
    want = ids.masked_fill(batch["completion_mask"] == 0, -100)[
        :, 1:
    ]  # the next token, completions only
    assert torch.equal(labels[:, : want.shape[1]], want)
    assert (labels[:, want.shape[1] :] == -100).all()
    assert all(s["upipe_pairs"] == 2 for s in shards)
    with pytest.raises(ValueError, match="pixel_values"):
        shard_preference_batch({**batch, "pixel_values": torch.zeros(2)}, _state(0, P))
    # precomputed reference log-probabilities [B] each ride along whole, [chosen, rejected]
    ref = {
        "ref_chosen_logps": torch.tensor([1.0, 2.0]),
        "ref_rejected_logps": torch.tensor([3.0, 4.0]),
    }
    shard = shard_preference_batch({**batch, **ref}, _state(0, P))
    assert shard["upipe_ref_logps"].tolist() == [1.0, 2.0, 3.0, 4.0]


def _state(rank, P):
    from hf_upipe.distributed import SequenceParallelState

    return SequenceParallelState(
        sp_group=None, sp_size=P, sp_rank=rank, dp_group=None, dp_size=1, dp_rank=0
    )


def test_dpo_trainer_internals_match_the_installed_trl():
    """The trl.DPOTrainer methods the composition goes through still take the parameters written against."""
    import inspect

    from trl import DPOTrainer

    from hf_upipe.trl.dpo import DPO_TRAINER_INTERNALS

    for name, params in DPO_TRAINER_INTERNALS.items():
        have = tuple(inspect.signature(getattr(DPOTrainer, name)).parameters)
        assert have[: len(params)] == params, (name, have, params)
    from trl.trainer.utils import FusedCausalLMOutput  # what the fused LM head returns per token

    fields = set(FusedCausalLMOutput.__dataclass_fields__)
    assert {"log_probs", "entropy", "mean_logits", "is_top1"} <= fields, fields


# f-divergences and the loss types TRL 1.16 generalises to them
F_DIVERGENCE_LOSSES = [
    "sigmoid",
    "sigmoid_norm",
    "hinge",
    "ipo",
    "exo_pair",
    "robust",
    "discopop",
    "sft",
]


def test_each_loss_type_and_f_divergence_equals_trl_compute_loss(tmp_path):
    """`hf_upipe.trl.dpo_losses.dpo_loss` from per-sequence sums equals TRL's own `DPOTrainer._compute_loss` on a
    collated batch (random tiny Llama, a separate random reference): each loss type alone (reverse KL), each
    f-divergence with every loss type it allows, and a weighted mix of all types; the loss and its gradient with
    respect to the per-token log-probabilities. The models run once; both losses read the same outputs."""
    import torch
    from trl import DPOTrainer

    from hf_upipe.trl.dpo_losses import DPO_LOSS_TYPES, DPOLossSettings, PairLogps, dpo_loss
    from tests.training._dpo_runs import preference_dataset
    from tests.training._trl_runs import _model, tokenizer

    args = _config(
        tmp_path, beta=0.5, label_smoothing=0.1, max_length=24, gradient_checkpointing=False
    )
    trainer = DPOTrainer(
        model=_model(seed=1),
        ref_model=_model(seed=2),
        args=args,
        train_dataset=preference_dataset(8, seed=1),
        processing_class=tokenizer(),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # 4 pairs: [8, S]
    mask = batch["completion_mask"]
    labels = batch["input_ids"].masked_fill(mask == 0, -100)
    inputs = dict(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    )
    trainer.model.train()
    policy = trainer.model(
        **inputs, labels=labels, fused_lm_head=True
    )  # per-token log_probs [8, S]
    with torch.no_grad():
        reference = trainer.ref_model(**inputs, labels=labels, fused_lm_head=True)
    trainer.ref_model = lambda **kwargs: (
        reference
    )  # TRL's _compute_loss calls it with the same inputs
    (c, r), (rc, rr) = policy.log_probs.sum(1).chunk(2), reference.log_probs.sum(1).chunk(2)
    tokens, targets = mask.sum(1).chunk(2), mask[:, 1:].sum(1).chunk(2)
    pair = PairLogps(c, r, rc, rr, tokens[0], tokens[1], targets[0])
    scored = policy.log_probs.detach() != 0  # [8, S]: the completion tokens' log-probabilities

    settings = [("reverse_kl", [t]) for t in DPO_LOSS_TYPES]
    settings += [
        (f, F_DIVERGENCE_LOSSES) for f in ("forward_kl", "js_divergence", "alpha_divergence")
    ]
    settings += [("reverse_kl", list(DPO_LOSS_TYPES))]
    for f_divergence, loss_types in settings:
        trainer.f_divergence_type, trainer.f_alpha_divergence_coef = f_divergence, 0.5
        trainer.loss_types = loss_types
        trainer.loss_weights = [0.5 + 0.25 * i for i in range(len(loss_types))]
        want = trainer._compute_loss(lambda **kwargs: policy, batch, False)
        got = dpo_loss(DPOLossSettings.from_trainer(trainer), pair)
        what = (f_divergence, loss_types, got.item(), want.item())
        assert (
            abs(got.item() - want.item()) <= 1e-5 * abs(want.item()) + 1e-7
            and abs(want.item()) > 1e-3
        ), what
        (want_grad,) = torch.autograd.grad(want, policy.log_probs, retain_graph=True)  # [8, S]
        (got_grad,) = torch.autograd.grad(got, policy.log_probs, retain_graph=True)
        # the scored tokens (elsewhere the log-probabilities are the constant 0, of no gradient to the weights)
        got_grad, want_grad = got_grad * scored, want_grad * scored
        assert want_grad.abs().max() > 0, what
        assert (got_grad - want_grad).abs().max() <= 1e-5 * want_grad.abs().max(), what
