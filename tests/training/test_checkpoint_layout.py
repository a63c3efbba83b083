"""Checkpoints resumed at another (SP, ring, DP) layout with the same global batch, against the uninterrupted run at
the new layout; other global batches and other models refused before any step. UPipeTrainer (DDP), FSDP2 through
torch distributed checkpoints, and the custom-loop example (`UPipePlugin`, accelerate's save_state).

A 2-rank run (SP 2, 2 rows x 2 accumulation steps) and a 4-rank run (SP 4; SP 2 x DP 2; SP 4 as U 2 x ring 2) train
a tiny Llama (fp32, no dropout) 4 steps, saving at step 2; the 4-rank run also resumes:
- full fine-tune SP 4 -> SP 2 x DP 2 (the same 4 processes) and SP 2 on 2 processes -> SP 2 x DP 2 on 4 (the ranks
  that have no random-state file of their own load rank 0's: every rank's generator is the same before each step);
- LoRA SP 2 x DP 2 -> SP 4 with a ring of 2.
Each resumed run logs the uninterrupted run's losses at steps 3 and 4 (relative 1e-5) and ends with its weights.
Controls that must break it: the same resume without the data skip (wrong data position), and without the
optimizer file (fresh AdamW moments and schedule). Refused, on every rank, naming both layouts: a global batch of 8
rows instead of 4, and the full checkpoint resumed as a LoRA model.
FSDP2 (`fully_shard` over all ranks, as accelerate's FSDP2 does on GPUs; saved with torch distributed checkpoints,
as accelerate's default SHARDED_STATE_DICT does): saved on 2 processes at SP 2, resumed on 4 at SP 2 x DP 2 (full)
and SP 4 (LoRA), each against the uninterrupted run there.
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
    """(2-rank specs, 4-rank specs) of the FSDP2 runs (`tests.training._layout_runs`): saved on 2 processes at
    SP 2 (4 rows), resumed on 4 at SP 2 x DP 2 (full) and SP 4 (LoRA), beside the uninterrupted runs there; 4 rows
    per replica on DP 2 (8) refused."""
    two = [
        dict(sp=2, lora=False, steps=2, save_at=2, save_to=f"{root}/fsdp_full"),
        dict(sp=2, lora=True, steps=2, save_at=2, save_to=f"{root}/fsdp_lora"),
    ]
    four = {
        "full": dict(sp=2, lora=False, steps=4),
        "full_resumed": dict(sp=2, lora=False, steps=4, resume=f"{root}/fsdp_full"),
        "lora": dict(sp=4, lora=True, steps=4),
        "lora_resumed": dict(sp=4, lora=True, steps=4, resume=f"{root}/fsdp_lora"),
        "other_batch": dict(sp=2, lora=False, steps=4, resume=f"{root}/fsdp_full", rows=4),
    }
    return two, four


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per rank: {case: result} for the Trainer cases and {"fsdp2": {case: result}}."""
    root = tmp_path_factory.mktemp("layout")
    two = dict(COMMON, lora=False, sp=2, batch=2, ga=2, save_steps=2, output_dir=f"{root}/sp2")
    fsdp2_two, fsdp2_four = _fsdp2_specs(root)
    run_distributed(layout_runs, 2, [two], fsdp2_two, timeout=600)
    specs = _specs4(root, f"{root}/sp2/checkpoint-2")
    outs = run_distributed(
        layout_runs, 4, list(specs.values()), list(fsdp2_four.values()), timeout=900
    )
    return [
        {**dict(zip(specs, r["trainer"])), "fsdp2": dict(zip(fsdp2_four, r["fsdp2"]))} for r in outs
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
        np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-6, err_msg=name)
    losses = max(_relative(r[resumed], r[uninterrupted], s) for r in runs for s in (3, 4))
    print(f"{resumed}: losses {losses:.1e} relative, weights {worst:.1e} absolute")


@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_resumes_on_more_processes_through_distributed_checkpoints(runs, lora):
    """FSDP2 shards saved on 2 processes (torch distributed checkpoint: model and AdamW states), resharded on load
    over 4 at another SP layout, continue with the uninterrupted run's losses."""
    name = "lora" if lora else "full"
    for rank in runs:
        got, want = rank["fsdp2"][f"{name}_resumed"]["losses"], rank["fsdp2"][name]["losses"]
        assert sorted(got) == [3, 4]
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in (3, 4))
        assert worst <= 1e-5, (got, want)
    print(f"fsdp2 {name}: losses {worst:.1e} relative")
    error = runs[0]["fsdp2"]["other_batch"]["error"]
    assert "the global batch differs (saved at SP 2 x DP 1 on 2 processes, global batch 4" in error
    assert "LlamaForCausalLM (" in error and "FSDPLlama" not in error, error


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
    assert sorted(resumed) == [3, 4]
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
