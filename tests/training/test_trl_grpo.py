"""UPipeGRPOTrainer on 2 gloo ranks (SP 2) and 4 (SP 2 x DP 2) equals trl.GRPOTrainer on one process, step by
step; its refusals and its sequence layout.

Every run: a tiny random Llama (fp32), 16 prompts of 3-9 random words (word-level tokenizer), 4 completions of at
most 6 tokens per prompt, two verifiable rewards (the share of words among w0..w29, the length), AdamW (SGD for the
full fine-tune and the loss types, whose weight changes are compared) with clipping, 3 steps (2 for each loss type
and on SP 2 x DP 2 for the full fine-tune). The reference is `trl.GRPOTrainer` with "sdpa" on one process with the
global batch. Checked on every rank: every value TRL logs at every step (loss, grad norm, rewards and their
spreads, completion lengths, num_tokens, kl, entropy, the clip ratios or the loss type's own statistic), relative
1e-4, and the final trainable parameters (relative 1e-4).

Completions on SP 2 are sampled on both sides (TRL: `model.generate`; hf_upipe: `hf_upipe.generate` with the
draws on SP rank 0, so the same seed draws the same tokens); on SP 2 x DP 2 both replay the same completions
through TRL's `rollout_func` (a data-parallel replica samples from another seed than one process), with one
micro-batch per step (a replica shuffles its own rows into micro-batches; TRL's per-micro-batch token means, kl and
entropy, then equal one process's).

What TRL itself computes per process (bnpo's token mean, the entropy bonus) is one process's on no number of
data-parallel processes: on SP 2 x DP 2 those cases (`per_process`) are compared with `trl.GRPOTrainer` on 2 gloo
processes (the same replayed completions): every logged value at every step and the final weights; and with one
process, every other value of the first step (later steps start from weights moved by a per-process loss). The
test also checks that TRL's 2-process values differ from one process's there.

Jobs (each a forkserver spawn): one process (every one-process reference, then the one-process case), 2 ranks
(TRL on 2 processes, then the SP 2 cases), 4 ranks (every SP 2 x DP 2 case).
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
# SP 2 x DP 2: both sides replay the same completions, one micro-batch per optimizer step (module docstring)
DP2 = dict(world=4, gen="replay", ga=1)
CASES |= {
    # 2 steps, no warmup: the second step's policy has moved away from the reference
    "sp2_dp2_full_checkpointing_tiled_mlp": CASES["sp2_full_checkpointing_tiled_mlp"]
    | DP2
    | dict(steps=2, run=dict(warmup_steps=0)),
    **{f"sp2_dp2_lora_{t}": CASES[f"sp2_lora_{t}"] | DP2 for t in LOSS_TYPES},
    # one process (sp_size 1): TRL's own generation and scoring, in the reference's job
    "one_process_lora_beta": dict(world=1, lora=True, beta=0.1, loss_type="grpo", gen="sample"),
}
# the entropy quantile's threshold gathers every replica's entropies: equal to one process (the entropy bonus of
# the SP 2 case is a token mean per process in TRL, below)
CASES["sp2_dp2_lora_dapo"]["grpo"] = dict(epsilon=0.05, top_entropy_quantile=0.6)
# What TRL computes per process: one process's value is not TRL's on 2 processes, by construction. These are
# compared with trl.GRPOTrainer on dp_size processes (the same replayed completions, the same micro-batches), and
# every other logged value with one process. bnpo: the loss is each micro-batch's token mean; the entropy bonus:
# the token mean of the (entropy-masked) entropies of each micro-batch; so the gradients and weights follow.
PER_PROCESS = ("loss", "grad_norm")
CASES["sp2_dp2_lora_bnpo"]["per_process"] = PER_PROCESS
CASES["sp2_dp2_lora_sapo"]["per_process"] = (
    PER_PROCESS  # entropy_coef 0.01: its policy_loss is exact
)
CASES["sp2_dp2_lora_sapo"]["grpo"] = dict(epsilon=0.05, top_entropy_quantile=0.6, entropy_coef=0.5)


def _spec(name: str, **extra) -> dict:
    return {k: v for k, v in CASES[name].items() if k not in ("world", "per_process")} | extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (one-process reference, TRL on dp_size processes or None, [each rank's UPipeGRPOTrainer run])}.

    Three jobs: one process (every reference, then the one-process cases), 2 ranks (TRL on 2 processes for the
    SP 2 x DP 2 cases with per-process values, then the SP 2 cases), 4 ranks (the SP 2 x DP 2 cases)."""
    root = tmp_path_factory.mktemp("grpo")
    names = list(CASES)
    ones = [n for n in names if CASES[n]["world"] == 1]  # run in the references' job, after them
    outs = run_distributed(
        grpo_runs,
        1,
        [
            _spec(
                n,
                trainer="trl",
                dp=max(CASES[n]["world"] // 2, 1),
                output_dir=str(root / f"ref_{n}"),
            )
            for n in names
        ]
        + [_spec(n, trainer="upipe", sp=1, output_dir=str(root / n)) for n in ones],
        timeout=600,
    )[0]
    refs = dict(zip(names, outs))
    got = {n: [outs[len(names) + i]] for i, n in enumerate(ones)}
    dp_refs = {}
    for world in sorted({c["world"] for c in CASES.values()} - {1}):
        # TRL on `world` processes (dp=1: each process holds its own 4 rows) for the cases at DP `world`
        trl = [n for n in names if "per_process" in CASES[n] and CASES[n]["world"] // 2 == world]
        mine = [n for n in names if CASES[n]["world"] == world]
        outs = run_distributed(
            grpo_runs,
            world,
            [_spec(n, trainer="trl", dp=1, output_dir=str(root / f"trl_dp_{n}")) for n in trl]
            + [
                _spec(n, trainer="upipe", sp=2, dp=world // 2, output_dir=str(root / n))
                for n in mine
            ],
            timeout=900,
        )
        dp_refs |= {n: outs[0][i] for i, n in enumerate(trl)}
        got |= {n: [rank_out[len(trl) + i] for rank_out in outs] for i, n in enumerate(mine)}
    return {n: (refs[n], dp_refs.get(n), got[n]) for n in names}


def _err(have, want) -> float:
    return abs(have - want) / abs(want) if abs(want) > 1e-6 else abs(have - want)


def _log_errors(name: str, got: list[dict], ref: dict, keys, steps=None) -> dict:
    """{key: (largest relative difference over `steps` (default all) and ranks, that value, the reference's)} of
    the logged `keys`; asserts each <= RTOL."""
    errs = {}
    for rank, out in enumerate(got):  # every rank logs the same numbers
        assert set(ref["logs"]) <= set(out["logs"]), set(ref["logs"]) - set(out["logs"])
        for key in keys:
            want, have = ref["logs"][key], out["logs"][key]
            assert have.keys() == want.keys(), (name, key)
            for step in want if steps is None else steps:
                assert (want[step] is None) == (have[step] is None), (name, rank, key, step)
                if want[step] is None:
                    continue
                e = _err(have[step], want[step])
                assert e <= RTOL, (
                    f"{name} rank {rank} {key} step {step}: {have[step]} vs {want[step]}"
                )
                if e >= errs.get(key, (-1.0,))[0]:
                    errs[key] = (e, have[step], want[step])
    return errs


def _weights_error(name: str, case: dict, out: dict, ref: dict) -> float:
    """The largest relative difference of the final trainable parameters (with SGD: of their changes)."""
    want, have = ref["params"], out["params"]
    assert want.keys() == have.keys()
    if case.get("optim") == "sgd":  # compare the changes: (final - initial weights)
        want = {n: w - ref["initial"][n] for n, w in want.items()}
        have = {n: w - out["initial"][n] for n, w in have.items()}
        assert all(np.array_equal(ref["initial"][n], out["initial"][n]) for n in want)
    perr = 0.0
    for n, r in want.items():
        err = np.abs(have[n] - r).max() / max(np.abs(r).max(), 1e-12)
        assert err < RTOL, f"{name}: parameter {n} differs, max rel err {err:.2e}"
        perr = max(perr, err)
    return perr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_upipe_grpo_trainer_equals_single_process_grpo_trainer(runs, name):
    """Every logged value and the final weights equal one process's, except what TRL computes per process
    (`per_process`: equal to TRL's on dp_size processes, as are the final weights)."""
    ref, dp_ref, got = runs[name]
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
    per_process = case.get("per_process", ())
    # with a per-process loss the weights after step 1 are TRL's on dp_size processes: then only step 1's other
    # values are one process's
    errs = _log_errors(
        name,
        got,
        ref,
        [k for k in ref["logs"] if k not in per_process],
        steps=[1] if per_process else None,
    )
    # the values compared are not trivially equal: the policy moves away from the reference, rewards spread
    assert any(v > 0 for v in ref["logs"]["reward_std"].values())
    if case.get("beta"):
        assert any(v > 1e-3 for v in ref["logs"]["kl"].values())
    if case.get("num_iterations", 1) > 1 and case.get("loss_type", "dapo") in LOSS_TYPES[:4]:
        assert any(v > 0 for v in ref["logs"]["clip_ratio/region_mean"].values()), ref["logs"]
    line = f"\n{name}: one process: largest logged difference {_worst(errs)}"
    if per_process:  # TRL's own 2-process run is not one process's here: compared with it instead
        assert dp_ref["generation_batch_size"] == ref["generation_batch_size"]
        dp_errs = _log_errors(name, got, dp_ref, list(dp_ref["logs"]))
        apart = max(  # how far TRL on dp_size processes is from one process (the reason for this reference)
            _err(dp_ref["logs"][k][s], ref["logs"][k][s])
            for k in per_process
            for s in ref["logs"][k]
        )
        assert apart > RTOL, (
            f"{name}: TRL on 2 processes gives one process's {per_process} ({apart:.1e})"
        )
        perr = _weights_error(name, case, got[0], dp_ref)
        line += (
            f"; TRL on {case['world'] // 2} processes: {_worst(dp_errs)}, final weights {perr:.1e} (TRL on "
            f"{case['world'] // 2} processes vs one: {apart:.1e} in {', '.join(per_process)})"
        )
    else:
        line += f"; final weights {_weights_error(name, case, got[0], ref):.1e}"
    print(line)


def _worst(errs: dict) -> str:
    worst = max(errs, key=lambda k: errs[k][0])
    e, have, want = errs[worst]
    return f"{e:.1e} ({worst}: {have:.7g} vs {want:.7g})"


# ---- fast: refusals, the sequence layout, the replica view (one process) -----------------------------------
REFUSED = {
    "vllm_server": (dict(use_vllm=True, vllm_mode="server"), "use_vllm"),
    "vllm_colocate": (dict(use_vllm=True, vllm_mode="colocate"), "use_vllm"),
    "continuous_batching": (
        dict(use_transformers_continuous_batching=True),
        "use_transformers_continuous_batching",
    ),
    "min_p": (dict(min_p=0.1), "min_p"),
    "repetition_penalty": (dict(repetition_penalty=1.2), "repetition_penalty"),
    "generation_kwargs": (dict(generation_kwargs={"do_sample": False}), "generation_kwargs"),
    "liger": (dict(use_liger_kernel=True), "use_liger_kernel"),
    "fsdp": (dict(fsdp="full_shard"), "fsdp"),
    "sync_ref": (dict(sync_ref_model=True, beta=0.1), "sync_ref_model"),
    "selective": (dict(gradient_checkpointing_kwargs={"selective": True}), "selective"),
    "eval": (dict(eval_strategy="steps", eval_steps=1), "eval_strategy"),
    "label_smoothing": (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
}


def _config(tmp_path, **kwargs):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        **kwargs,
    )


def test_grpo_config_errors_name_each_setting_and_the_fix(tmp_path):
    from hf_upipe.trl import grpo_config_errors
    from tests.training._trl_runs import tokenizer

    assert grpo_config_errors(_config(tmp_path), processing_class=tokenizer()) == []
    for name, (kwargs, setting) in REFUSED.items():
        errors = grpo_config_errors(_config(tmp_path, **kwargs))
        assert len(errors) == 1, (name, errors)
        assert isinstance(errors[0], NotImplementedError) and setting in str(errors[0]), (
            name,
            errors,
        )
        assert any(w in str(errors[0]).lower() for w in ("set ", "use ", "drop ")), errors[
            0
        ]  # the fix
    assert "tool" in str(grpo_config_errors(_config(tmp_path), tools=[len])[0])


def test_upipe_grpo_trainer_refuses_before_any_setup(tmp_path):
    from transformers import TrainingArguments

    from hf_upipe.trl import UPipeGRPOTrainer
    from tests.training._grpo_runs import length, prompts
    from tests.training._trl_runs import _model, tokenizer

    with pytest.raises(NotImplementedError, match="use_vllm"):
        UPipeGRPOTrainer(
            model=_model(seed=1),
            reward_funcs=length,
            args=_config(tmp_path, use_vllm=True, vllm_mode="server"),
            train_dataset=prompts(4, seed=1),
            processing_class=tokenizer(),
        )
    assert not any(tmp_path.iterdir())  # nothing was set up: not even the output folder
    with pytest.raises(TypeError, match="GRPOConfig"):
        UPipeGRPOTrainer(
            model=_model(seed=1), reward_funcs=length, args=TrainingArguments(str(tmp_path))
        )


def test_the_generation_batch_counts_the_launchs_replicas(tmp_path):
    """The generation batch is counted over the launch's data-parallel replicas (`Launch.dp`), read from the one
    launch `UPipeTrainer` resolved; a launch without SP, or whose SP degree does not resolve, leaves `args` as
    they are."""
    from hf_upipe.config import UPipeConfig
    from hf_upipe.training.parallelism import resolve_launch
    from hf_upipe.trl.grpo import _replica_args

    args = _config(tmp_path)  # 4 rows a process, 4 completions per prompt
    args.steps_per_generation = 1
    launch = resolve_launch(UPipeConfig(sp_size=2), None, 4)
    assert _replica_args(args, launch).generation_batch_size == 4 * launch.dp == 8
    assert _replica_args(args, resolve_launch(UPipeConfig(sp_size=1), None, 4)) is args
    assert _replica_args(args, resolve_launch(UPipeConfig(sp_size=3), None, 4)) is args
    args.num_generations = 16  # as TRL checked it over all 4 processes: 4 x 4 x 1
    with pytest.raises(ValueError, match="over the 2 data-parallel replicas"):
        _replica_args(args, launch)


def test_completion_rows_score_what_trl_scores():
    """TRL's [B, P + C] layout (left-padded prompts, right-padded completions) rearranged into right-padded rows:
    the model scores every completion token as in TRL's layout (rotary embeddings see relative positions only),
    and the shards of `shard_batch` cover each scored token once."""
    import torch

    from hf_upipe.data import shard_batch
    from hf_upipe.trl.grpo_shards import completion_rows
    from tests.training._trl_runs import _model

    gen = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = (
        [3, 7, 1, 5],
        [6, 2, 4, 0],
    )  # a row with no completion token
    P, C = max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(4, 96, (4, P + C), generator=gen)
    prompt_mask = torch.stack([(torch.arange(P) >= P - n).long() for n in prompt_lengths])  # [4, P]
    completion_mask = torch.stack(
        [(torch.arange(C) < n).long() for n in completion_lengths]
    )  # [4, C]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [4, P + C]
    ids = ids.masked_fill(mask == 0, 0)
    model = _model(seed=3).eval()
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :P] = -100
    with torch.no_grad():
        trl = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        want = trl.log_probs[:, -C:]  # [4, C]: TRL's per-token log-probabilities
        rows = completion_rows(ids, mask, C, pad_token_id=0)
        assert rows.labels.shape[1] == max(
            p + c for p, c in zip(prompt_lengths, completion_lengths)
        )
        ours = model(
            input_ids=rows.input_ids,
            attention_mask=rows.attention_mask,
            labels=rows.labels,
            fused_lm_head=True,
        )
    got = rows.pick(ours.log_probs)  # [4, C]
    assert torch.equal(got == 0, want == 0) and (want != 0).sum() == sum(completion_lengths)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    got_entropy = rows.pick(ours.entropy)
    assert (got_entropy - trl.entropy[:, -C:]).abs().max() <= 1e-5 * got_entropy.abs().max()
    # the shards' shifted labels, concatenated, hold each completion token once, where `pick` reads it
    full = {
        "input_ids": rows.input_ids,
        "attention_mask": rows.attention_mask,
        "labels": rows.labels,
    }
    labels = torch.cat([shard_batch(full, r, 3)["shift_labels"] for r in range(3)], dim=1)
    picked = rows.pick(labels)
    assert torch.equal(picked, ids[:, P:] * completion_mask)
    assert (labels != -100).sum() == sum(completion_lengths)
    with pytest.raises(ValueError, match="no tokens"):
        completion_rows(ids, torch.cat([prompt_mask * 0, completion_mask], dim=1), C, 0)


def test_replica_accelerator_without_data_parallelism():
    """One SP group: TRL sees one process; its gathers and reductions return this rank's values."""
    import torch

    from hf_upipe.distributed import SequenceParallelState
    from hf_upipe.trl.grpo_replicas import ReplicaAccelerator

    class _Accelerator:
        process_index, num_processes, device = 3, 4, "cpu"

    state = SequenceParallelState(
        sp_group=None, sp_size=4, sp_rank=3, dp_group=None, dp_size=1, dp_rank=0
    )
    view = ReplicaAccelerator(_Accelerator(), state)
    assert (view.process_index, view.num_processes, view.device) == (0, 1, "cpu")
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(view.gather(x), x) and torch.equal(
        view.gather(torch.tensor(5)), torch.tensor([5])
    )
    assert torch.equal(view.reduce(x, reduction="sum"), x)
    assert view.pad_across_processes(x, pad_index=-1) is x


def test_grpo_trainer_internals_match_the_installed_trl():
    """The trl.GRPOTrainer methods the composition goes through still take the parameters written against."""
    import inspect

    from trl import GRPOTrainer

    from hf_upipe.trl.grpo import GRPO_TRAINER_INTERNALS

    for name, params in GRPO_TRAINER_INTERNALS.items():
        have = tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters)
        assert have[: len(params)] == params, (name, have, params)
    from trl.trainer import grpo_trainer  # the functions the replica view swaps

    assert callable(grpo_trainer.gather) and callable(grpo_trainer.gather_object)
