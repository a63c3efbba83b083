"""The examples under `accelerate launch` (2 gloo processes, SP 2) against one process, resume, and the Trainer one.

Custom loop (`examples/finetune_long_context.py`, the README's main command with fewer steps): the per-step losses
of 2 processes equal those of one process on the same data (full and LoRA); a run resumed from its step-2
checkpoint logs the same losses at steps 3 and 4 (and steps 1-2 from the checkpoint's record), and one missing a
rank's RNG state is refused; the saved model loads in plain transformers. Trainer example
(`examples/finetune_with_trainer.py`): trains, logs and saves a PEFT adapter; its `--trl` mode (TRL's SFTTrainer
through UPipeSFTTrainer) logs the same losses and TRL's metrics.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--steps", "4", "--seq-len", "256", "--rows", "16", "--lr", "1e-3"]

pytestmark = pytest.mark.slow  # multi-process runs of several steps: the full suite runs them


def _run(script, args, tmp_path, processes=2, fails=False):
    path = os.path.join(ROOT, "examples", script)
    if processes == 1:
        cmd = [sys.executable, path, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"),
            "--main_process_port",
            "0",
            path,
            *args,
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode != 0) == fails, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr if fails else proc.stdout


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    """One 2-process run of the main example (LoRA, SP 2, a checkpoint every 2 steps) that three tests read: the
    custom loop's LoRA case, the eval example and the adapter loaded without hf_upipe. (run folder, its output,
    its per-step losses)"""
    where = tmp_path_factory.mktemp("adapter_run")
    run = where / "sp2"
    flags = ["--output-dir", str(run), "--save-every", "2", "--log-json", str(where / "sp2.json")]
    out = _run("finetune_long_context.py", COMMON + flags, where)
    return run, out, _losses(where / "sp2.json")


def _losses(path):
    with open(path) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_custom_loop_two_processes_equal_one(tmp_path, mode, request):
    flags = COMMON + (["--full"] if mode == "full" else [])
    if mode == "full":
        out = _run(
            "finetune_long_context.py",
            flags
            + [
                "--output-dir",
                str(tmp_path / "sp2"),
                "--save-every",
                "2",
                "--log-json",
                str(tmp_path / "sp2.json"),
            ],
            tmp_path,
        )
        run, sp2 = tmp_path / "sp2", _losses(tmp_path / "sp2.json")
    else:  # the LoRA run is the one the adapter tests read (unchanged by them)
        run, out, sp2 = request.getfixturevalue("adapter_run")
    assert "2 processes: SP 2 x DP 1" in out and "loss: first 4 steps" in out
    assert sorted(sp2) == [1, 2, 3, 4]
    if (
        mode == "full"
    ):  # (LoRA under SP against one process: tests/training/test_plugin.py and test_trainer.py)
        _run(
            "finetune_long_context.py",
            flags
            + ["--output-dir", str(tmp_path / "one"), "--log-json", str(tmp_path / "one.json")],
            tmp_path,
            processes=1,
        )
        one = _losses(tmp_path / "one.json")
        assert sorted(one) == [1, 2, 3, 4]
        for step in one:
            assert abs(sp2[step] - one[step]) <= 1e-4 * abs(one[step]), (step, sp2, one)
        _full_model_loads_without_hf_upipe(
            tmp_path / "sp2" / "step-4" / "model", tmp_path / "one" / "step-4" / "model", tmp_path
        )
    # no staging folder left; the loss curve, and a LoRA run's base (saved for its adapters)
    expected = ["loss.png", "step-2", "step-4"] + (["base"] if mode == "lora" else [])
    assert sorted(os.listdir(run)) == sorted(expected)
    state = set(os.listdir(run / "step-2" / "accelerate_state"))
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= state, state  # every rank's part is in
    if mode == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "sp2" / "step-4" / "model")
        assert model.config.num_hidden_layers == 1
        _run(
            "finetune_long_context.py",
            flags
            + [
                "--output-dir",
                str(tmp_path / "resumed"),
                "--resume",
                str(tmp_path / "sp2" / "step-2"),
                "--log-json",
                str(tmp_path / "resumed.json"),
            ],
            tmp_path,
        )
        resumed = _losses(tmp_path / "resumed.json")
        # the record covers the whole run: steps 1-2 as the checkpoint kept them, 3-4 trained again
        assert sorted(resumed) == [1, 2, 3, 4] and all(resumed[s] == sp2[s] for s in (1, 2))
        for step in (3, 4):
            assert abs(resumed[step] - sp2[step]) <= 1e-5 * abs(sp2[step]), (step, resumed, sp2)
        # a checkpoint missing one rank's RNG state is refused (it used to resume silently): the example's resume
        # verifies it as this does (the trainer's refusal runs end to end in tests/training/test_checkpoints.py)
        from hf_upipe.training.checkpoint import CheckpointError, verify_checkpoint

        shutil.copytree(tmp_path / "sp2" / "step-2", tmp_path / "broken" / "step-2")
        os.remove(tmp_path / "broken" / "step-2" / "accelerate_state" / "random_states_1.pkl")
        with pytest.raises(
            CheckpointError, match="accelerate_state/random_states_1.pkl is missing"
        ):
            verify_checkpoint(str(tmp_path / "broken" / "step-2"))
    else:
        assert os.path.exists(run / "step-4" / "model" / "adapter_model.safetensors")


def test_trainer_example(tmp_path):
    """The Trainer example, and its `--trl` mode (UPipeSFTTrainer): the same losses, TRL's metrics logged."""
    runs = {}
    for mode in ("trainer", "trl"):
        out = _run(
            "finetune_with_trainer.py",
            COMMON
            + ["--output-dir", str(tmp_path / mode), "--log-json", str(tmp_path / f"{mode}.json")]
            + (["--trl"] if mode == "trl" else []),
            tmp_path,
        )
        assert "loss: first log" in out
        with open(tmp_path / f"{mode}.json") as f:
            runs[mode] = json.load(f)
        assert sorted(_losses(tmp_path / f"{mode}.json")) == [1, 2, 3, 4]
        assert os.path.exists(tmp_path / mode / "final" / "adapter_model.safetensors")
    for step, loss in runs["trainer"]["losses"].items():
        assert abs(runs["trl"]["losses"][step] - loss) <= 1e-5 * loss, (step, runs)
    trl = runs["trl"]
    assert sorted(trl["entropy"]) == sorted(trl["mean_token_accuracy"]) == ["1", "2", "3", "4"]
    assert all(v > 0 for v in trl["entropy"].values())
    assert trl["num_tokens"]["4"] == 4 * 256  # 4 steps of one 256-token row


def test_a_bad_setting_is_one_line_from_one_rank(tmp_path):
    """Both ranks raise the same error (agreed before any other collective); only the first prints it, and both exit
    with status 2 (`hf_upipe.exits`; the launcher itself exits with 1: tests/test_launch_errors.py)."""
    out = _run(
        "finetune_long_context.py",
        COMMON + ["--sp-size", "3", "--output-dir", str(tmp_path / "x")],
        tmp_path,
        fails=True,
    )
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: --sp-size 3: sp_size=3 does not divide the 2 processes of this launch; use one of "
        "[1, 2]."
    ], out[-2000:]
    # no traceback from the ranks (the launcher still reports, in its own words, that the processes exited with 2)
    assert not [
        line
        for line in out.splitlines()
        if line.strip().startswith("File") and "/examples/" in line
    ]
    # every rank exits with 2 together (none stopped by the launcher), and the launcher's summary quotes the line
    assert re.findall(r"^\s+exitcode\s+: (-?\d+)", out, re.M) == ["2", "2"], out[-2000:]
    assert out.count(f"traceback : {lines[0]}") == 2, out[-2000:]


def test_eval_example_two_processes_equal_one(tmp_path, adapter_run):
    """`examples/eval_long_context.py` on an adapter of a short main-example run, at a length other than the trained
    one (odd: the SP shards are padded): 2 processes (SP 2, `hf_upipe.generate`) give the generated tokens and the
    teacher-forced log-probabilities of one process (`model.generate`), and the generated first token is the
    teacher-forced argmax at the first answer (the same prefix)."""
    flags = ["--adapter", str(adapter_run[0] / "step-4" / "model"), "--length", "301"]
    flags += ["--rows", "4", "--new-tokens", "3"]
    runs = {}
    for processes in (1, 2):
        out = _run(
            "eval_long_context.py",
            flags + ["--output", str(tmp_path / f"eval{processes}.json")],
            tmp_path,
            processes=processes,
        )
        assert out.count("teacher-forced: first answer") == 1, (
            out
        )  # printed once, from the first rank
        with open(tmp_path / f"eval{processes}.json") as f:
            runs[processes] = json.load(f)
    one, two = runs[1], runs[2]
    assert (one["sp_size"], two["sp_size"]) == (1, 2)
    assert two["generated"]["tokens"] == one["generated"]["tokens"]
    assert [len(t) for t in one["generated"]["tokens"]] == [3] * 4
    assert two["generated"]["accuracy"] == one["generated"]["accuracy"]
    lp1, lp2 = one["teacher_forced"]["answer_logprobs"], two["teacher_forced"]["answer_logprobs"]
    assert (
        [len(r) for r in lp1] == [len(r) for r in lp2] == [25] * 4
    )  # the answers of 301-byte rows
    for a, b in zip(sum(lp1, []), sum(lp2, [])):
        assert abs(a - b) <= 1e-4 * abs(a) + 1e-7, (a, b)
    tf1, tf2 = one["teacher_forced"], two["teacher_forced"]
    assert (
        abs(tf1["answer_perplexity"] - tf2["answer_perplexity"]) <= 1e-4 * tf1["answer_perplexity"]
    )
    for key in ("first_answer_accuracy", "all_answers_accuracy"):
        assert tf1[key] == tf2[key], key
    assert one["generated"]["accuracy"] == tf1["first_answer_accuracy"]


LOAD_WITHOUT_HF_UPIPE = """
import sys, torch
from peft import AutoPeftModelForCausalLM
model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert "hf_upipe" not in sys.modules, "loading the adapter imported hf_upipe"
with torch.no_grad():
    torch.save(model(torch.arange(3, 259)[None]).logits, sys.argv[2])
"""


LOAD_FULL_WITHOUT_HF_UPIPE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert "hf_upipe" not in sys.modules, "loading the model imported hf_upipe"
with torch.no_grad():
    torch.save(model(torch.arange(3, 259)[None]).logits, sys.argv[2])
"""


def _run_elsewhere(script: str, saved, logits, elsewhere) -> None:
    """`script` (argv: the saved folder, where to write the logits) in a fresh Python without hf_upipe on its path,
    from another folder, offline."""
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(saved), str(logits)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _full_model_loads_without_hf_upipe(saved, reference, tmp_path):
    """The 2-process full fine-tune's model (the full state dict gathered from FSDP2, plain transformers files, no
    hf_upipe name in its config) loads with `AutoModelForCausalLM` in a process that never imports hf_upipe, from
    another folder, offline, with the logits of the 1-process run's trained model (relative 1e-4, as the losses),
    which differ from the untrained model's."""
    import torch
    from transformers import AutoModelForCausalLM

    config = (saved / "config.json").read_text()
    assert "upipe" not in config.lower() and "auto_map" not in json.loads(config), config
    logits = tmp_path / "full_logits.pt"
    _run_elsewhere(LOAD_FULL_WITHOUT_HF_UPIPE, saved, logits, tmp_path / "elsewhere_full")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from _common import build_model
    finally:
        sys.path.pop(0)
    ids = torch.arange(3, 259)[None]
    with torch.no_grad():
        trained = AutoModelForCausalLM.from_pretrained(reference).eval()(ids).logits
        untrained = build_model(None, 259, lora=False, lora_rank=0, seed=0).eval()(ids).logits
    loaded = torch.load(logits)
    err = ((loaded - trained).abs().max() / trained.abs().max()).item()
    print(f"full model loaded without hf_upipe: max rel logit diff to the 1-process run {err:.1e}")
    assert err <= 1e-4, err
    assert (trained - untrained).abs().max() > 1e-2  # the trained weights are in the saved model


def test_a_saved_adapter_loads_without_hf_upipe_and_runs_are_kept(tmp_path, adapter_run):
    """The main example's LoRA adapter names the base saved in its run's folder: `AutoPeftModelForCausalLM` loads
    it in a process that never imports hf_upipe, from another folder, offline, with the logits of the trained
    model (its seed-built base plus the adapter, as examples/eval_long_context.py rebuilt it). The loss curve is
    drawn beside it; a rerun into the folder is refused, and --overwrite replaces the run."""
    run, out, _ = adapter_run  # (shared with two other tests: the run is not changed here)
    adapter = run / "step-4" / "model"
    assert f"saved {run}/step-4/model (plain PEFT files), curve {run}/loss.png" in out
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(adapter / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(run / "base")

    _run_elsewhere(LOAD_WITHOUT_HF_UPIPE, adapter, tmp_path / "logits.pt", tmp_path / "elsewhere")

    import torch
    from peft import PeftModel

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from _common import build_model
    finally:
        sys.path.pop(0)
    base = build_model(None, 259, lora=False, lora_rank=0, seed=0)
    ids = torch.arange(3, 259)[None]
    with torch.no_grad():
        untrained = base(ids).logits
        trained = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
    loaded = torch.load(tmp_path / "logits.pt")
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)
    assert (trained - untrained).abs().max() > 1e-2  # the adapter is in the loaded model

    # a copy of the run for the rerun and the overwrite, which change it
    run = tmp_path / "run"
    shutil.copytree(adapter_run[0], run)
    flags = ["--steps", "2", "--seq-len", "64", "--rows", "4", "--lr", "1e-3"]
    flags += ["--output-dir", str(run), "--eval-rows", "0"]
    refused = _run("finetune_long_context.py", flags, tmp_path, processes=1, fails=True)
    assert (
        f"error: --output-dir {run} holds an earlier run (base, loss.png, step-2, ...)" in refused
    )
    _run("finetune_long_context.py", flags + ["--overwrite"], tmp_path, processes=1)
    assert sorted(os.listdir(run)) == ["base", "loss.png", "step-2"]
