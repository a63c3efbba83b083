"""`hf-upipe calibrate`: refused without CUDA; its stored correction reaches `hf-upipe plan` (fake measurement)."""

import json

import pytest

from hf_upipe.cli import main
from hf_upipe.planning import calibrate, reserved
from hf_upipe.planning.planner import plan

TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    vocab_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1 << 20,
    rms_norm_eps=1e-5,
    model_type="llama",
)


@pytest.mark.parametrize("extra", [[], ["--hollow-attention"]])
def test_calibrate_without_cuda_exits_2(monkeypatch, capsys, extra):
    monkeypatch.setattr(calibrate, "_cuda_available", lambda: False)
    args = ["calibrate", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", *extra]
    assert main(args) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_correction_is_stored_and_applied(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY))
    seen = {}

    def fake_measure(spec):  # the GPU's answer
        seen.update(spec)
        return 100 * 2**20

    monkeypatch.setattr(calibrate, "_cuda_available", lambda: True)
    monkeypatch.setattr(calibrate, "_measure_in_fresh_process", fake_measure)
    before = plan(str(model), gpus=2, seq_len=4096, gpu_memory="80GiB")
    assert before.correction is None
    args = ["calibrate", "--model", str(model), "--gpus", "2", "--seq-len", "4096", "--layers", "2"]
    assert main(args) == 0
    assert seen["world"] == 2 and seen["seq_len"] == 4096 and seen["layers"] == 2
    stored = json.loads((tmp_path / "calibration.json").read_text())
    (entry,) = stored.values()
    assert entry["measured"] == 100 * 2**20 and entry["predicted"] > 0
    assert entry["factor"] == pytest.approx(entry["measured"] / entry["predicted"])
    after = plan(str(model), gpus=2, seq_len=4096, gpu_memory="80GiB")
    assert after.correction == entry and after.settings == before.settings
    assert after.predicted_reserved == int(before.reserved * entry["factor"])
    assert after.required - before.required == after.predicted_reserved - before.predicted_reserved
    capsys.readouterr()
    main(["plan", "--model", str(model), "--gpus", "2", "--seq-len", "4096"])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "tensors" in lines and "allowance" in lines
    assert f"calibrated x{entry['factor']:.3f}" in lines["reserved"]


def test_save_correction_refuses_nonsense(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="positive"):
        reserved.save_correction("k", 0, 10)


def test_hollow_attention_calibration(monkeypatch, tmp_path, capsys):
    """--hollow-attention: the child measures with the hollow twin of the planned kernel, the prediction leaves out
    the attention workspace (the hollow step has none), and the stored correction says so; `plan` names it."""
    monkeypatch.setenv("HF_UPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY))
    specs = []

    def fake_measure(spec):
        specs.append(spec)
        return 100 * 2**20

    monkeypatch.setattr(calibrate, "_cuda_available", lambda: True)
    monkeypatch.setattr(calibrate, "_measure_in_fresh_process", fake_measure)
    monkeypatch.setattr(calibrate, "_hollow_kernel", lambda dtype: "hollow-cudnn")
    args = ["calibrate", "--model", str(model), "--gpus", "2", "--seq-len", "64K", "--layers", "2"]
    assert main(args) == 0
    (plain,) = json.loads((tmp_path / "calibration.json").read_text()).values()
    assert main(args + ["--hollow-attention"]) == 0
    assert [s["kernel"] for s in specs] == ["auto", "hollow-cudnn"]
    assert {k: v for k, v in specs[0].items() if k != "kernel"} == {
        k: v for k, v in specs[1].items() if k != "kernel"
    }
    (entry,) = json.loads((tmp_path / "calibration.json").read_text()).values()
    assert entry["hollow_attention"] is True and entry["kernel"] == "hollow-cudnn"
    assert "hollow_attention" not in plain
    p = plan(str(model), gpus=2, seq_len=65536, gpu_memory="80GiB")
    workspace = reserved.Allowance().attention_workspace(TINY, p.settings, 65536, p.sp_size)
    assert workspace > 0 and plain["predicted"] - entry["predicted"] == workspace
    assert "hollow-cudnn" in capsys.readouterr().out
    main(["plan", "--model", str(model), "--gpus", "2", "--seq-len", "64K"])
    assert "hf-upipe calibrate --hollow-attention: measured" in capsys.readouterr().out


def test_measure_reserved_runs_the_hollow_kernel_in_scope(monkeypatch):
    """The child opens the measurement scope for a hollow kernel and hands the kernel to the step."""
    seen = {}

    def fake_step(case, settings, **kwargs):
        from hf_upipe.ops.kernels_hollow import measuring

        seen.update(kernel=case.kernel, measuring=measuring())
        return {}

    monkeypatch.setattr("hf_upipe.planning.train_step.measure_train_step", fake_step)
    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh", lambda *a: None)
    monkeypatch.setattr(calibrate.torch.cuda, "current_device", lambda: 0)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(calibrate.torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(calibrate.torch.cuda, "max_memory_reserved", lambda *a: 123)
    spec = dict(
        model="llama3-8b", world=2, sp_size=2, seq_len=1024, layers=1, settings={}, kernel=""
    )
    for kernel, scope in (("hollow-cudnn", True), ("auto", False)):
        assert calibrate.measure_reserved(dict(spec, kernel=kernel)) == 123
        assert seen == {"kernel": kernel, "measuring": scope}
