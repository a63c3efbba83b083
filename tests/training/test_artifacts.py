"""What UPipeTrainer, UPipeSFTTrainer and UPipeDPOTrainer save loads with plain transformers / PEFT, in a process
that never imports hf_upipe, and gives the trained model's logits.

One 2-rank job (`tests.training._artifact_runs`): a full fine-tune with `UPipeTrainer` (its final model and its
`checkpoint-2`), a LoRA run with `UPipeSFTTrainer` on a saved base and a LoRA run with `UPipeDPOTrainer` on that
base. One fresh Python then loads each folder in turn (each with its own checks) with `AutoModelForCausalLM` /
`AutoPeftModelForCausalLM` and `AutoTokenizer`, asserts `hf_upipe` was never imported, that no saved config names
"upipe", an `auto_map` or an hf_upipe key, and compares the logits on fixed tokens with the trained model's (fp32,
1e-5); for an adapter, also that the logits without it differ.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._artifact_runs import TOKENS, artifact_runs

pytestmark = pytest.mark.slow  # a 2-rank job of three short runs

LOAD = textwrap.dedent("""
    import json, sys, traceback, numpy as np, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokens, results = json.loads(sys.argv[1]), {}
    def check(folder, expected, lora):
        if lora:
            from peft import AutoPeftModelForCausalLM
            model = AutoPeftModelForCausalLM.from_pretrained(folder)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok("w3 w4").input_ids, "the tokenizer did not load"
        assert "hf_upipe" not in sys.modules, "loading imported hf_upipe"
        model.eval()
        with torch.no_grad():
            got = model(torch.tensor(tokens)).logits.numpy()
        said = f"attn {model.config._attn_implementation} max abs diff {float(np.abs(got - expected).max())}"
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        if lora:  # the adapter is in the loaded model: without it the logits differ
            with model.disable_adapter(), torch.no_grad():
                base = model(torch.tensor(tokens)).logits.numpy()
            assert np.abs(base - expected).max() > 1e-3, "the adapter does not change the logits"
        return said
    for folder, expected, lora in json.loads(sys.argv[2]):
        try:
            results[folder] = ["ok", check(folder, np.load(expected), lora)]
        except Exception:
            results[folder] = ["failed", traceback.format_exc()]
    print(json.dumps(results))
""")


def _saved_configs_are_plain(folder: str) -> None:
    for name in ("config.json", "adapter_config.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            text = open(path).read()
            assert "upipe" not in text.lower() and "auto_map" not in json.loads(text), (path, text)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    return root, run_distributed(artifact_runs, 2, str(root), timeout=400)[0]


CASES = [
    ("full_final", "full", False),
    ("full/checkpoint-2", "full", False),
    ("sft_final", "sft_lora", True),
    ("dpo_final", "dpo_lora", True),
]


@pytest.fixture(scope="module")
def loaded(trained, tmp_path_factory):
    """Every saved folder loaded, one after the other, by one fresh Python that never imports hf_upipe (a Python
    that imports torch and transformers costs seconds; every folder's check is its own, as below): folder ->
    ("ok", what it measured) or ("failed", the traceback)."""
    root, logits = trained
    where = tmp_path_factory.mktemp(
        "load"
    )  # not the repository: nothing of hf_upipe on the path by accident
    jobs = []
    for folder, run, lora in CASES:
        expected = where / f"{run}.npy"
        np.save(expected, np.array(logits[run], dtype=np.float32))
        jobs.append((str(root / folder), str(expected), lora))
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, json.dumps(TOKENS), json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(where),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("folder, run, lora", CASES)
def test_saved_artifact_loads_without_hf_upipe_with_the_same_logits(
    trained, loaded, folder, run, lora
):
    root, _ = trained
    _saved_configs_are_plain(str(root / folder))
    outcome, said = loaded[str(root / folder)]
    assert outcome == "ok", said
    print(folder, said)
