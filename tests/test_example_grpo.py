"""`examples/grpo_passkey.py` (GRPO on the passkey task through UPipeGRPOTrainer), briefly and at small sizes.

One process: it trains, prints the reward summary, writes the reward curve, the PEFT adapter (naming the base saved
beside it) and the per-step rewards. Two processes (SP 2, slow): the same rewards at every step as one process
(the SP group samples the same answers; each step's reward is a count of right answers, so equal means equal).
The one-process run is made once (`one_process`) and read by both tests.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "grpo_passkey.py")
SMALL = ["--steps", "3", "--prompt-len", "16", "--prompts-per-step", "2", "--num-generations", "4"]
SMALL += ["--format-steps", "3", "--format-batch", "4", "--lora-rank", "4"]


def _run(tmp_path, name, processes):
    out_dir, log = tmp_path / name, tmp_path / f"{name}.json"
    args = [SCRIPT, *SMALL, "--output-dir", str(out_dir), "--log-json", str(log)]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        config = os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
        cmd += ["--main_process_port", "0", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(log) as f:
        return out_dir, proc.stdout, json.load(f)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run: (output folder, its output, its log), which neither test changes."""
    return _run(tmp_path_factory.mktemp("grpo"), "one", 1)


def test_grpo_example_one_process(one_process):
    run, out, log = one_process
    assert out.count("reward: first 3 steps") == 1, out
    assert "{'loss'" not in out  # the Trainer's per-step lines are replaced by the bar
    if (
        importlib.util.find_spec("matplotlib") is None
    ):  # (CI's newest-releases environment has none)
        assert (
            f"saved {run}/final (plain PEFT files) (pip install matplotlib: a reward curve)" in out
        )
        assert not (run / "reward.png").exists()
    else:
        assert f"saved {run}/final (plain PEFT files), curve {run}/reward.png" in out
        assert (run / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "final" / "adapter_model.safetensors").stat().st_size > 0
    with open(run / "final" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == str(run / "base")
    assert (run / "base" / "config.json").exists()
    assert (log["sp_size"], log["dp_size"]) == (1, 1)
    assert sorted(log["rewards"], key=int) == ["1", "2", "3"]
    # each step's reward is the share of 2 x 4 sampled answers that are right
    assert all(abs(8 * r - round(8 * r)) < 1e-6 for r in log["rewards"].values()), log
    assert log["format_loss"] > 0


@pytest.mark.slow  # two processes
def test_grpo_example_two_processes_equal_one(tmp_path, one_process):
    _, out, two = _run(tmp_path, "two", 2)
    assert out.count("reward: first 3 steps") == 1, out  # printed once, by the first rank
    _, _, one = one_process
    assert (two["sp_size"], two["dp_size"]) == (2, 1)
    assert two["rewards"] == one["rewards"]
    assert two["format_loss"] == one["format_loss"]
