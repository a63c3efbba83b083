"""UPipeTrainer checkpoints: atomic, verified on resume, loadable by plain transformers / PEFT, and resumable to the
same losses.

One 2-rank run (SP 2) trains 4 steps saving every 2 (LoRA and full fine-tune); a second run resumes the LoRA run
from checkpoint-2; two more try to resume from corrupted copies of it (one bit flipped in the adapter weights; one
rank's RNG state deleted). Checked: the resumed run logs the same losses at steps 3 and 4 as the uninterrupted one;
the corrupted copies are refused on every rank with an error naming the file; the checkpoints are complete
`checkpoint-N` folders with a manifest and no staging leftovers; a fresh Python process that never imports hf_upipe
loads the saved adapter with `peft.PeftModel` (and the full model with `AutoModelForCausalLM`) and gets exactly the
trained weights.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.integrations._models import tiny_config
from tests.training._runs import train_runs

LOAD_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    from transformers import AutoModelForCausalLM
    kind, path, expected = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
    if kind == "lora":
        from peft import PeftModel
        from transformers import AutoConfig
        torch.manual_seed(11)  # the base model: same seed and config as the training run
        config = AutoConfig.from_pretrained(sys.argv[4])
        base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model = PeftModel.from_pretrained(base, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    assert "hf_upipe" not in sys.modules, "the checkpoint must load without hf_upipe"
    params = {n.replace(".default", ""): p for n, p in model.named_parameters()}
    worst = 0.0
    for name in expected.files:
        key = name.replace(".default", "")
        assert key in params, (name, sorted(params)[:5])
        worst = max(worst, float(np.abs(params[key].detach().numpy() - expected[name]).max()))
    print("max abs diff", worst, "over", len(expected.files), "tensors")
    assert worst == 0.0
""")

pytestmark = pytest.mark.slow  # multi-process runs of several steps: the full suite runs them


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    common = dict(trainer="upipe", sp=2, batch=2, steps=4, ga=2, save_steps=2)
    specs = [
        dict(common, lora=True, output_dir=str(root / "lora"), save_to=str(root / "lora_final")),
        dict(
            common,
            lora=True,
            output_dir=str(root / "lora_resumed"),
            resume=str(root / "lora" / "checkpoint-2"),
        ),
        dict(common, lora=False, output_dir=str(root / "full"), save_to=str(root / "full_final")),
        dict(
            common,
            lora=True,
            output_dir=str(root / "flipped_run"),
            resume=str(root / "flipped" / "checkpoint-2"),
            expect_error=True,
            corrupt=dict(
                src=str(root / "lora" / "checkpoint-2"),
                dst=str(root / "flipped" / "checkpoint-2"),
                flip="adapter_model.safetensors",
            ),
        ),
        dict(
            common,
            lora=True,
            output_dir=str(root / "no_rng_run"),
            resume=str(root / "no_rng" / "checkpoint-2"),
            expect_error=True,
            corrupt=dict(
                src=str(root / "lora" / "checkpoint-2"),
                dst=str(root / "no_rng" / "checkpoint-2"),
                delete="rng_state_1.pth",
            ),
        ),
    ]
    outs = run_distributed(train_runs, 2, specs, timeout=300)
    return root, outs[0], outs


def test_resume_continues_with_the_same_losses(runs):
    _, (first, resumed, *_), _ = runs
    assert sorted(resumed["losses"]) == [
        1,
        2,
        3,
        4,
    ]  # steps 1-2 come from the checkpoint's log history
    for step in (3, 4):
        assert abs(resumed["losses"][step] - first["losses"][step]) <= 1e-6 * abs(
            first["losses"][step]
        ), step
    for name, value in first["params"].items():
        np.testing.assert_allclose(resumed["params"][name], value, rtol=0, atol=1e-6, err_msg=name)


def test_checkpoints_are_complete_and_atomic(runs):
    root, _, _ = runs
    for run in ("lora", "full"):
        entries = sorted(os.listdir(root / run))
        assert entries == ["checkpoint-2", "checkpoint-4"], entries  # no staging folder left behind
        ckpt = root / run / "checkpoint-2"
        files = set(os.listdir(ckpt))
        weights = "adapter_model.safetensors" if run == "lora" else "model.safetensors"
        assert {
            weights,
            "optimizer.pt",
            "scheduler.pt",
            "trainer_state.json",
            "rng_state_0.pth",
            "rng_state_1.pth",
            "upipe_manifest.json",
        } <= files, files
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 2
        manifest = json.loads((ckpt / "upipe_manifest.json").read_text())["files"]
        assert set(manifest) == files - {
            "upipe_manifest.json"
        }  # every file, each with its size and SHA-256
        assert manifest["rng_state_1.pth"]["size"] == os.path.getsize(ckpt / "rng_state_1.pth")


@pytest.mark.parametrize(
    "case, named",
    [
        (3, "adapter_model.safetensors does not match its SHA-256"),
        (4, "rng_state_1.pth is missing"),
    ],
)
def test_corrupted_or_incomplete_checkpoint_is_refused_on_every_rank(runs, case, named):
    _, _, ranks = runs
    for rank in ranks:
        error = rank[case]["error"]
        assert error.startswith("CheckpointError: Cannot resume from") and named in error, error


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_saved_model_loads_without_hf_upipe(runs, kind, tmp_path):
    root, outs, _ = runs
    trained = outs[0 if kind == "lora" else 2]["params"]
    np.savez(tmp_path / "expected.npz", **trained)
    tiny_config("llama").save_pretrained(tmp_path)  # the base model's config, read without hf_upipe
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_SCRIPT,
            kind,
            str(root / f"{kind}_final"),
            str(tmp_path / "expected.npz"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "max abs diff 0.0" in proc.stdout
