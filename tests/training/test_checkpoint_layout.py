"""Checkpoints resumed at another (SP, ring, DP) layout with the same global batch, against the uninterrupted run at
the new layout; other global batches and other models refused before any step. UPipeTrainer (DDP and accelerate's
FSDP2), the custom loop of the example (`UPipePlugin`, accelerate's save_state) under DDP and accelerate's FSDP2.

A 2-rank run (SP 2, 2 rows x 2 accumulation steps) and a 4-rank run (SP 4; SP 2 x DP 2; SP 4 as U 2 x ring 2) train
a tiny Llama (fp32, no dropout) 4 steps, saving at step 2; the 4-rank run also resumes:
- full fine-tune SP 4 -> SP 2 x DP 2 (the same 4 processes) and SP 2 on 2 processes -> SP 2 x DP 2 on 4 (the ranks
  that have no random-state file of their own load rank 0's: every rank's generator is the same before each step);
- LoRA SP 2 x DP 2 -> SP 4 with a ring of 2.
Each resumed run logs the uninterrupted run's losses at steps 3 and 4 (relative 1e-5) and ends with its weights.
Controls that must break it: the same resume without the data skip (wrong data position), and without the
optimizer file (fresh AdamW moments and schedule). Refused, on every rank, naming both layouts: a global batch of 8
rows instead of 4, and the full checkpoint resumed as a LoRA model.
FSDP2: accelerate's own (`tests.training._layout_runs.accelerate_fsdp2_on_cpu` lets it run over gloo), in the same
two process groups (`_fsdp2_specs`): UPipeTrainer (sharded and full state dicts) and the example's loop (its
save_checkpoint and resume sequence), full and LoRA, saved on 2 processes at SP 2 and resumed on 4 at SP 2 x DP 2,
SP 4 or SP 4 with a ring of 2, each against the uninterrupted run there (losses, weights, the generator after
loading); the uninterrupted loop runs against one process without hf_upipe; 8 rows per step refused; an lm_head
that FSDP2 reshards after its forward refused by the tiled loss.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._layout_runs import layout_runs

pytestmark = pytest.mark.slow  # multi-process runs of several steps: the full suite runs them

COMMON = dict(trainer="upipe", steps=4, record_rng=True)


def _specs4(root, two_rank_ckpt):
    full = dict(COMMON, lora=False)
    lora = dict(COMMON, lora=True)
    sp4_ckpt = f"{root}/sp4/checkpoint-2"
    sp2dp2 = dict(full, sp=2, batch=2, ga=1)  # 2 rows x DP 2 x 1 = 4
    return {
        "sp4": dict(full, sp=4, batch=2, ga=2, save_steps=2, output_dir=f"{root}/sp4"),
        "sp2dp2": dict(sp2dp2, output_dir=f"{root}/sp2dp2"),
        "sp4_to_sp2dp2": dict(sp2dp2, output_dir=f"{root}/a", resume=sp4_ckpt),
        "sp2_to_sp2dp2": dict(sp2dp2, output_dir=f"{root}/b", resume=two_rank_ckpt),
        "lora_sp2dp2": dict(lora, sp=2, batch=1, ga=2, save_steps=2, output_dir=f"{root}/l"),
        "lora_ring": dict(lora, sp=4, ring=2, batch=1, ga=4, output_dir=f"{root}/lr"),
        "lora_sp2dp2_to_ring": dict(
            lora,
            sp=4,
            ring=2,
            batch=1,
            ga=4,
            output_dir=f"{root}/c",
            resume=f"{root}/l/checkpoint-2",
        ),
        "no_data_skip": dict(
            sp2dp2, output_dir=f"{root}/d", resume=sp4_ckpt, ignore_data_skip=True
        ),
        "no_optimizer": dict(
            sp2dp2,
            output_dir=f"{root}/e",
            resume=f"{root}/noopt/checkpoint-2",
            corrupt=dict(
                src=sp4_ckpt,
                dst=f"{root}/noopt/checkpoint-2",
                delete="optimizer.pt",
                remanifest=True,
            ),
        ),
        "other_batch": dict(
            sp2dp2, ga=2, output_dir=f"{root}/f", resume=sp4_ckpt, expect_error=True
        ),
        "other_model": dict(
            sp2dp2, lora=True, output_dir=f"{root}/g", resume=sp4_ckpt, expect_error=True
        ),
    }


def _fsdp2_specs(root):
    """(2-rank specs, 4-rank specs) of the accelerate FSDP2 runs (`tests.training._layout_runs`: ("trainer" |
    "plugin", spec)), each global batch 4 rows. Saved on 2 processes at SP 2 (the Trainer after step 2 of 4, the
    custom loop after 2 steps), resumed on 4 beside the uninterrupted run there:
    - UPipeTrainer, full, SHARDED_STATE_DICT (torch distributed checkpoints, resharded): SP 2 -> SP 2 x DP 2;
    - UPipeTrainer, LoRA, FULL_STATE_DICT (transformers' default for FSDP): SP 2 -> SP 4;
    - the custom loop, full, SHARDED_STATE_DICT (accelerate's default): SP 2 -> SP 4 with a ring of 2;
    - the custom loop, LoRA: SP 2 -> SP 2 x DP 2; resumed with 8 rows per step: refused."""
    t = dict(trainer="upipe", steps=4, record_rng=True)
    t_full = dict(t, lora=False, state_dict_type="SHARDED_STATE_DICT")
    t_lora = dict(t, lora=True)
    p_full, p_lora = dict(lora=False), dict(lora=True)
    two = [
        ("trainer", dict(t_full, sp=2, batch=2, ga=2, save_steps=2, output_dir=f"{root}/tf")),
        ("trainer", dict(t_lora, sp=2, batch=2, ga=2, save_steps=2, output_dir=f"{root}/tl")),
        ("plugin", dict(p_full, sp=2, rows=2, ga=2, steps=2, save_at=2, save_to=f"{root}/pf")),
        ("plugin", dict(p_lora, sp=2, rows=1, ga=4, steps=2, save_at=2, save_to=f"{root}/pl")),
    ]
    t_full4 = dict(t_full, sp=2, batch=2, ga=1)
    t_lora4 = dict(t_lora, sp=4, batch=2, ga=2)
    p_full4 = dict(p_full, sp=4, ring=2, rows=2, ga=2, steps=4)
    p_lora4 = dict(p_lora, sp=2, rows=1, ga=2, steps=4)
    four = {
        "trainer_full": ("trainer", dict(t_full4, output_dir=f"{root}/tf4")),
        "trainer_full_resumed": (
            "trainer",
            dict(t_full4, output_dir=f"{root}/tf4r", resume=f"{root}/tf/checkpoint-2"),
        ),
        "trainer_lora": ("trainer", dict(t_lora4, output_dir=f"{root}/tl4")),
        "trainer_lora_resumed": (
            "trainer",
            dict(t_lora4, output_dir=f"{root}/tl4r", resume=f"{root}/tl/checkpoint-2"),
        ),
        "plugin_full": ("plugin", p_full4),
        "plugin_full_resumed": ("plugin", dict(p_full4, resume=f"{root}/pf")),
        "plugin_lora": ("plugin", p_lora4),
        "plugin_lora_resumed": ("plugin", dict(p_lora4, resume=f"{root}/pl")),
        "plugin_other_batch": ("plugin", dict(p_lora4, rows=2, resume=f"{root}/pl")),
    }
    return two, four


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per rank: {case: result} for the Trainer cases and {"fsdp2": {case: result}}."""
    root = tmp_path_factory.mktemp("layout")
    two = dict(COMMON, lora=False, sp=2, batch=2, ga=2, save_steps=2, output_dir=f"{root}/sp2")
    fsdp2_two, fsdp2_four = _fsdp2_specs(root)
    saved = run_distributed(layout_runs, 2, [two], fsdp2_two, timeout=600)
    specs = _specs4(root, f"{root}/sp2/checkpoint-2")
    outs = run_distributed(
        layout_runs, 4, list(specs.values()), list(fsdp2_four.values()), timeout=900
    )
    saved_fsdp2 = [dict(zip(_SAVED.values(), r["fsdp2"])) for r in saved]
    return [
        {
            **dict(zip(specs, r["trainer"])),
            "fsdp2": dict(zip(fsdp2_four, r["fsdp2"])),
            "fsdp2_saved": saved_fsdp2[0],
            "resharded_head": [r["resharded_head"] for r in saved + outs],
        }
        for r in outs
    ]


def _relative(a: dict, b: dict, step: int) -> float:
    return abs(a["losses"][step] - b["losses"][step]) / abs(b["losses"][step])


@pytest.mark.parametrize(
    "resumed, uninterrupted",
    [
        ("sp4_to_sp2dp2", "sp2dp2"),
        ("sp2_to_sp2dp2", "sp2dp2"),
        ("lora_sp2dp2_to_ring", "lora_ring"),
    ],
)
def test_resume_at_another_layout_continues_exactly(runs, resumed, uninterrupted):
    for rank in runs:
        got, want = rank[resumed], rank[uninterrupted]
        assert sorted(got["losses"]) == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's log history
        for step in (3, 4):
            assert _relative(got, want, step) <= 1e-5, (step, got["losses"], want["losses"])
        # every rank's generator is the same before each step, as in the uninterrupted run
        assert len(set(r[resumed]["rng"][0] for r in runs)) == 1
    # the weights: the checkpoint's first 2 steps ran at the other layout, whose rounding AdamW amplifies in the
    # near-zero k_proj bias gradients (docs/trainer.md); everything else agrees to 1e-5
    first, worst = runs[0], 0.0
    for name, value in first[uninterrupted]["params"].items():
        got = first[resumed]["params"][name]
        worst = max(worst, float(np.abs(got - value).max()))
        # the k_proj biases: 1e-3 of the tensor's largest entry, the rule of tests/training/test_trainer.py
        atol = 1e-3 * float(np.abs(value).max()) if name.endswith("k_proj.bias") else 1e-6
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=atol, err_msg=name)
    losses = max(_relative(r[resumed], r[uninterrupted], s) for r in runs for s in (3, 4))
    print(f"{resumed}: losses {losses:.1e} relative, weights {worst:.1e} absolute")


_SAVED = {"trainer_full": "tf", "trainer_lora": "tl", "plugin_full": "pf", "plugin_lora": "pl"}


@pytest.mark.parametrize("case", list(_SAVED))
def test_accelerate_fsdp2_checkpoint_resumes_at_another_layout(runs, case):
    """What UPipeTrainer and the custom loop save under accelerate's FSDP2 on 2 processes (sharded: distributed
    checkpoints, resharded on load; full: whole tensors), resumed on 4 at another SP layout: the uninterrupted run's
    losses at steps 3 and 4 on every rank, its weights, every rank's generator alike."""
    worst, weights = 0.0, 0.0
    for rank in runs:
        got, want = rank["fsdp2"][f"{case}_resumed"], rank["fsdp2"][case]
        assert sorted(got["losses"]) == ([1, 2, 3, 4] if case.startswith("trainer") else [3, 4])
        for step in (3, 4):
            worst = max(worst, _relative(got, want, step))
        assert worst <= 1e-5, (got["losses"], want["losses"])
    # the generator carried, on every rank (ranks 2 and 3 have no file of their own: rank 0's): the saved run's
    # state after step 2 (the Trainer: before its step 3; the loop: at its save)
    saved = runs[0]["fsdp2_saved"][_SAVED[case]]
    for rank in runs:
        resumed = rank["fsdp2"][f"{case}_resumed"]
        if case.startswith("trainer"):
            assert resumed["rng"][0] == saved["rng"][2], (resumed["rng"], saved["rng"])
        else:
            assert resumed["rng_loaded"] == saved["rng"][-1], (resumed, saved["rng"])
    first = runs[0]["fsdp2"]
    for name, value in first[case]["params"].items():
        got = first[f"{case}_resumed"]["params"][name]
        weights = max(weights, float(np.abs(got - value).max()))
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=name)
    print(f"fsdp2 {case}: losses {worst:.1e} relative, weights {weights:.1e} absolute")


@pytest.mark.parametrize("lora", [False, True])
def test_accelerate_fsdp2_custom_loop_equals_one_process(runs, lora):
    """The uninterrupted custom-loop runs under accelerate's FSDP2 (its [final norm, lm_head] group read by the
    tiled loss), against one process without hf_upipe: losses and final weights."""
    from tests.training._layout_runs import plugin_reference

    ref = plugin_reference(lora)
    case = "plugin_lora" if lora else "plugin_full"
    worst = 0.0
    for rank in runs:
        got = rank["fsdp2"][case]["losses"]
        worst = max(
            worst, *(abs(got[s] - ref["losses"][s]) / ref["losses"][s] for s in ref["losses"])
        )
        assert worst <= 2e-5, (got, ref["losses"])
    weights = 0.0
    for name, value in runs[0]["fsdp2"][case]["params"].items():
        want = ref["params"][name]
        weights = max(weights, float(np.abs(value - want).max()))
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-6, err_msg=name)
    print(f"fsdp2 {case} vs one process: losses {worst:.1e} relative, weights {weights:.1e}")


def test_accelerate_fsdp2_other_global_batch_is_refused_on_every_rank(runs):
    for rank in runs:
        error = rank["fsdp2"]["plugin_other_batch"]["error"]
        assert (
            error.startswith("CheckpointError: Cannot resume from")
            and "global batch differs" in error
        )
        assert "saved at SP 2 x DP 1 on 2 processes, global batch 4 = 1 rows x DP 1 x 4" in error, (
            error
        )
        assert (
            "resuming at SP 2 x DP 2 on 4 processes, global batch 8 = 2 rows x DP 2 x 2" in error
        ), error
        assert "model PeftModel (" in error and "FSDP" not in error, error


def test_an_lm_head_resharded_after_its_forward_is_refused(runs):
    """FSDP2 with reshard_after_forward=True on the lm_head leaves only a shard of its weight for the tiled loss."""
    for error in runs[0]["resharded_head"]:
        assert "holds only this rank's shard of its weight" in error, error
        assert "reshard_after_forward=False" in error and "tiled_loss=False" in error, error


@pytest.mark.parametrize("control", ["no_data_skip", "no_optimizer"])
def test_a_wrong_data_position_or_optimizer_state_breaks_it(runs, control):
    got, want = runs[0][control], runs[0]["sp2dp2"]
    print(control, max(_relative(got, want, step) for step in (3, 4)))
    assert max(_relative(got, want, step) for step in (3, 4)) > 1e-3, (
        got["losses"],
        want["losses"],
    )


@pytest.mark.parametrize(
    "case, named",
    [
        ("other_batch", "the global batch differs"),
        ("other_model", "it holds another model"),
    ],
)
def test_another_global_batch_or_model_is_refused_on_every_rank(runs, case, named):
    for rank in runs:
        error = rank[case]["error"]
        assert error.startswith("CheckpointError: Cannot resume from") and named in error, error
        assert "saved at SP 4 x DP 1 on 4 processes, global batch 4" in error, error
        assert "resuming at SP 2 x DP 2 on 4 processes" in error, error


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = ["--steps", "4", "--seq-len", "64", "--rows", "16", "--lr", "1e-3", "--eval-rows", "0"]


def _example(processes: int, flags: list, cwd) -> str:
    """The custom-loop example under `accelerate launch` with `processes` gloo processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"), "--num_processes"]
    cmd += [str(processes), "--main_process_port", "0"]
    cmd += [os.path.join(ROOT, "examples", "finetune_long_context.py"), *EXAMPLE, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _example_losses(path) -> dict[int, float]:
    with open(path) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


def test_example_resumes_on_more_processes_at_another_layout(tmp_path):
    """The plugin example (LoRA, DDP): SP 2 on 2 processes, 1 row x 2 accumulation steps, saved at step 2; resumed
    on 4 processes at SP 2 x DP 2, 1 row x 1 step (the ranks 2 and 3 load rank 0's random states), it logs the
    uninterrupted SP 2 x DP 2 run's steps 3 and 4. A global batch of 4 rows is refused, naming both layouts."""
    _example(
        2,
        ["--sp-size", "2", "--grad-accum", "2", "--save-every", "2", "--output-dir", "a"],
        tmp_path,
    )
    at = ["--sp-size", "2", "--grad-accum", "1"]
    _example(4, at + ["--output-dir", "b", "--log-json", "b.json"], tmp_path)
    out = _example(
        4, at + ["--output-dir", "c", "--resume", "a/step-2", "--log-json", "c.json"], tmp_path
    )
    assert "resumed from a/step-2 at step 2" in out and "4 processes: SP 2 x DP 2" in out
    resumed, uninterrupted = (
        _example_losses(tmp_path / "c.json"),
        _example_losses(tmp_path / "b.json"),
    )
    assert sorted(resumed) == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's record (losses.json)
    for step in (3, 4):
        assert abs(resumed[step] - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step])
    print("example SP 2 -> SP 2 x DP 2:", {s: resumed[s] - uninterrupted[s] for s in (3, 4)})
    saved = json.loads((tmp_path / "a" / "step-2" / "upipe_layout.json").read_text())
    assert (saved["sp_size"], saved["dp_size"], saved["global_batch"]) == (2, 1, 2)
    # another global batch: check_resume_layout as the example calls it on every rank, before load_state
    from hf_upipe.training.checkpoint import CheckpointError
    from hf_upipe.training.checkpoint_layout import TrainingLayout, check_resume_layout

    four = TrainingLayout(2, 1, 2, 4, 1, 2, saved["model"])
    with pytest.raises(
        CheckpointError, match="global batch 2 = 1 rows x DP 1 x 2 accumulation steps"
    ):
        check_resume_layout(str(tmp_path / "a" / "step-2"), four)
