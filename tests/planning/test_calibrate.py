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


def test_calibrate_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "_cuda_available", lambda: False)
    assert main(["calibrate", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M"]) == 2
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
