"""The README's main command runs: `accelerate launch` with the CPU config, 2 gloo processes, a few steps."""

import os
import subprocess
import sys

from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_example_trains_under_accelerate_launch_and_saves_a_plain_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"), "--main_process_port", "0",
           os.path.join(ROOT, "examples", "finetune_long_context.py"), "--steps", "6", "--seq-len", "256",
           "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks x 128 tokens = 256-token sequences" in proc.stdout
    assert "passkey loss: first 6 steps" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, default attention
    assert model.config.num_hidden_layers == 1
