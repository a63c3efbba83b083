"""UPipeTrainer and UPipePlugin under DeepSpeed ZeRO (stages 1, 2, 3) on DeepSpeed's CPU accelerator over gloo.

Every run trains a tiny random Llama (fp32, 8 query / 2 key-value heads) at SP 2 (SP 2 x DP 2 in one case) and is
compared with one process without DeepSpeed (`transformers.Trainer`, "sdpa", the same global batch): every logged
loss and grad norm (rel 2e-5) and the final trainable weights. Under ZeRO-3 every parameter is partitioned
(`stage3_param_persistence_threshold: 0`), so the fused block, the tiled MLP and the tiled loss, which read weights
outside their modules' forward, get them only through `hf_upipe.adapters.zero3`. Cases: full and LoRA fine-tunes,
the fused block and the registered path, tiled and plain loss, tiled MLP, activation checkpointing, a model loaded
with `from_pretrained` under `deepspeed.zero.Init`, optimizer states offloaded to the CPU; the plugin's loop under
accelerate's DeepSpeedPlugin, and its refusal of DeepSpeed gradient accumulation.
"""

import os

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._deepspeed_runs import ds_runs, plugin_steps, save_tiny_model

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported here or in the ranks
pytest.importorskip("deepspeed")

RTOL = 2e-5


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: steps {sorted(got)} vs {sorted(want)}"
    for step, ref in want.items():
        assert abs(got[step] - ref) <= RTOL * abs(ref), f"{what} step {step}: {got[step]} vs {ref}"


def _params_close(got: dict, want: dict, what: str) -> None:
    """Final weights after 3 AdamW steps: 1e-3 of each tensor's largest entry, for the reason of
    tests/training/test_trainer.py (Adam divides near-zero k_proj bias gradients by their own size); the other
    tensors agree to ~1e-6."""
    assert got.keys() == want.keys()
    for name, ref in want.items():
        err = np.abs(got[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert err < 1e-3, f"{what}: parameter {name} differs, max rel err {err:.2e}"


def _reference(spec: dict, out_dir: str, dp: int = 1) -> dict:
    """The one-process run of `spec` without DeepSpeed and with the same global batch."""
    keep = ("lora", "checkpointing", "pretrained", "steps")
    if spec.get(
        "ds_adam"
    ):  # DeepSpeed's CPU Adam in the reference too (another AdamW implementation)
        keep += ("stage", "offload", "ds_adam")
    ref = {k: spec[k] for k in keep if k in spec}
    return dict(ref, trainer="hf", output_dir=out_dir, batch=2 * dp)


def _check(got: dict, want: dict, name: str) -> None:
    _close(got["losses"], want["losses"], f"{name} loss")
    _close(got["grad_norms"], want["grad_norms"], f"{name} grad_norm")
    _params_close(got["params"], want["params"], name)
    assert got["fused"] == 2, got["fused"]  # both layers ran the fused block


def test_zero3_every_parameter_partitioned_fused_tiled(tmp_path):
    """ZeRO-3, full fine-tune, fused block + tiled MLP + tiled loss (fast tier)."""
    spec = dict(trainer="upipe", sp=2, stage=3, lora=False, tiled_mlp=True, steps=2)
    spec["output_dir"] = str(tmp_path / "run")
    got = run_distributed(ds_runs, 2, [spec], timeout=300)
    want = run_distributed(ds_runs, 1, [_reference(spec, str(tmp_path / "ref"))], timeout=300)[0][0]
    for rank_out in got:  # every rank logs the same losses
        _close(rank_out[0]["losses"], want["losses"], "loss")
    _check(got[0][0], want, "zero3")


SLOW_CASES = {
    # name: (world, spec)
    "zero1_full": (2, dict(stage=1, lora=False)),
    "zero2_full_checkpointing_tiledmlp": (
        2,
        dict(stage=2, lora=False, checkpointing=True, tiled_mlp=True),
    ),
    "zero3_lora_zero_init_checkpointing_tiledmlp": (
        2,
        dict(stage=3, lora=True, pretrained=True, checkpointing=True, tiled_mlp=True),
    ),
    "zero3_full_offload_optimizer": (2, dict(stage=3, lora=False, offload="cpu", tiled_mlp=True)),
    "zero3_lora_registered_plain_loss": (2, dict(stage=3, lora=True, fused=False, tiled=False)),
    "zero3_sp2dp2_full": (4, dict(stage=3, lora=False, tiled_mlp=True)),
}


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    save_tiny_model(str(root / "tiny"))
    specs = {}
    for name, (world, spec) in SLOW_CASES.items():
        spec = dict(spec, trainer="upipe", sp=2, output_dir=str(root / name))
        if spec.get("pretrained"):
            spec["pretrained"] = str(root / "tiny")
        specs.setdefault(world, []).append((name, spec))
    runs = {}
    for world, named in specs.items():
        outs = run_distributed(ds_runs, world, [s for _, s in named], timeout=600)
        runs.update({name: (spec, outs[0][i]) for i, (name, spec) in enumerate(named)})
    refs = [
        _reference(spec, str(root / f"{name}-ref"), dp=SLOW_CASES[name][0] // 2)
        for name, (spec, _) in runs.items()
    ]
    wants = run_distributed(ds_runs, 1, refs, timeout=600)[0]
    return {name: (spec, got, want) for (name, (spec, got)), want in zip(runs.items(), wants)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_trainer_under_zero_equals_one_process(slow_runs, name):
    spec, got, want = slow_runs[name]
    _close(got["losses"], want["losses"], f"{name} loss")
    _close(got["grad_norms"], want["grad_norms"], f"{name} grad_norm")
    _params_close(got["params"], want["params"], name)
    assert got["fused"] == (2 if spec.get("fused", True) else 0)
    if spec.get("pretrained"):
        assert got["loaded_partitioned"]  # from_pretrained built it under deepspeed.zero.Init


def _plugin_all(rank, world, cases):
    return [plugin_steps(rank, world, stage, lora, ga) for stage, lora, ga in cases]


def _plugin_references(rank, world, cases):
    """The one-process runs without DeepSpeed, in a process of their own (accelerate's state is process-wide)."""
    return [plugin_steps(rank, world, None, lora, ga) for _, lora, ga in cases]


PLUGIN_CASES = [(3, False, 1), (2, True, 1), (3, False, 2)]


@pytest.mark.slow
def test_plugin_under_zero_equals_one_process_or_refuses():
    outs = run_distributed(_plugin_all, 2, PLUGIN_CASES, timeout=600)
    refs = run_distributed(_plugin_references, 1, PLUGIN_CASES, timeout=600)[0]
    for i, (stage, lora, ga) in enumerate(PLUGIN_CASES):
        for rank_out in outs:
            got = rank_out[i]
            if ga > 1:  # refused on every rank, before any collective
                assert "gradient_accumulation_steps=2" in got["error"], got
                continue
            want = refs[i]
            for a, b in zip(got["losses"], want["losses"], strict=True):
                assert abs(a - b) <= RTOL * abs(b), (stage, lora, got["losses"], want["losses"])
            for a, b in zip(got["grad_norms"], want["grad_norms"], strict=True):
                assert abs(a - b) <= RTOL * abs(b), (stage, lora, got["grad_norms"])
            _params_close(got["params"], want["params"], f"plugin zero{stage}")


def _cpu_adam_built() -> bool:
    """Whether DeepSpeed's CPU Adam op is already compiled in torch's extension cache (building it takes minutes,
    more than the whole suite's budget on 2 cores)."""
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.exists(os.path.join(_get_build_directory("cpu_adam", False), "cpu_adam.so"))


@pytest.mark.slow
def test_zero3_offload_with_deepspeeds_cpu_adam(tmp_path):
    """DeepSpeed's CPU Adam (`"optimizer": {"type": "AdamW"}` with an offloaded optimizer), against one process
    with the same optimizer. Runs where the op is built (docs/deepspeed.md: build it once with
    `python -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"`)."""
    if not _cpu_adam_built():
        pytest.skip(
            "DeepSpeed's CPU Adam op is not built here (a JIT compile of minutes): docs/deepspeed.md"
        )
    spec = dict(
        trainer="upipe", sp=2, stage=3, lora=False, offload="cpu", ds_adam=True, tiled_mlp=True
    )
    spec["output_dir"] = str(tmp_path / "run")
    got = run_distributed(ds_runs, 2, [spec], timeout=600)
    want = run_distributed(ds_runs, 1, [_reference(spec, str(tmp_path / "ref"))], timeout=600)[0][0]
    for rank_out in got:
        _close(rank_out[0]["losses"], want["losses"], "loss")
    _check(got[0][0], want, "zero3_cpu_adam")
