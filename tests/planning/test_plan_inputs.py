"""The planner plans what will run: what a real config carries (its dtype, tied embeddings, quantization) is
honoured exactly or refused, checked against hand arithmetic (parameters x bytes / shards per category); and the
presets `--model` lists are real models' published shapes."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from hf_upipe.cli import main
from hf_upipe.models.presets import PRESETS, model_names, resolve
from hf_upipe.planning.planner import plan
from hf_upipe.planning.train_step import StepSettings

WORLD = 8  # FSDP2 shards over 8 GPUs
SETTINGS = StepSettings(impl="upipe")  # fixed: one candidate, no search

# Qwen/Qwen3-8B's config.json, as a Hub folder carries it (2 layers instead of 36: the same per-layer shapes)
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=2,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1000000,
)


def _params(c: dict, tied: bool = False) -> tuple[int, int]:
    """(parameters, parameter tensors) of a Qwen3 config, by hand: embeddings (+ lm_head unless tied), per layer
    q/k/v/o, q/k norms, gate/up/down and two norms, and the final norm."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = 2 * h * q + 2 * h * kv + 2 * d + 3 * h * i + 2 * h
    n = c["vocab_size"] * h * (1 if tied else 2) + c["num_hidden_layers"] * layer + h
    return n, (2 if tied else 3) + 11 * c["num_hidden_layers"]


def _plan(values: dict, **kw):
    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    return plan(config, gpus=WORLD, seq_len=8192, settings=SETTINGS, gpu_memory="80GiB", **kw)


def _folder(tmp_path, name: str, values: dict) -> str:
    """A model folder holding `values` as its config.json, as a Hub download has it."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return str(folder)


def test_the_configs_dtype_does_not_change_the_plan(tmp_path):
    """A model folder whose config.json says "dtype": "bfloat16" plans exactly as without it: fp32 master weights
    and AdamW states, as a run holds them (transformers' from_config would otherwise build bf16 ones and halve
    both rows)."""
    kw = dict(gpus=WORLD, seq_len=8192, settings=SETTINGS, gpu_memory="80GiB")
    without = plan(_folder(tmp_path, "fp32", QWEN3_8B), **kw)
    bf16 = plan(_folder(tmp_path, "bf16", dict(QWEN3_8B, dtype="bfloat16")), **kw)
    assert str(bf16.config.dtype).endswith("bfloat16")  # the key was read
    assert bf16.by_category == without.by_category and bf16.required == without.required
    n, tensors = _params(QWEN3_8B)
    # every dimension divides by 8: FSDP2's shards carry no padding. AdamW keeps m and v (fp32) per parameter and a
    # 4-byte step count per parameter tensor
    assert without.by_category["optimizer"] == 2 * 4 * n // WORLD + 4 * tensors
    assert (
        without.by_category["parameters"] == 4 * n // WORLD
    )  # the peak is in the backward: shards alone
    table = bf16.table()
    assert "AdamW m and v shards (fp32)" in table and "gathered layers and root (bfloat16)" in table


def test_tied_embeddings_are_counted_once():
    untied = _plan(QWEN3_8B)
    tied = _plan(dict(QWEN3_8B, tie_word_embeddings=True))
    head = QWEN3_8B["vocab_size"] * QWEN3_8B["hidden_size"]
    assert (
        untied.by_category["optimizer"] - tied.by_category["optimizer"] == 2 * 4 * head // WORLD + 4
    )
    assert (
        tied.by_category["optimizer"]
        == 2 * 4 * _params(QWEN3_8B, tied=True)[0] // WORLD + 4 * (_params(QWEN3_8B, tied=True)[1])
    )


def test_a_quantized_config_is_refused_for_a_full_fine_tune_and_noted_for_lora():
    quant = dict(quant_method="bitsandbytes", load_in_4bit=True)
    small = dict(QWEN3_8B, hidden_size=256, intermediate_size=512, head_dim=32, vocab_size=1024)
    with pytest.raises(
        ValueError, match=r"quantization_config \(bitsandbytes 4-bit\).*--lora-rank"
    ):
        _plan(dict(small, quantization_config=quant))
    p = _plan(dict(small, quantization_config=quant), lora=(8, ("q_proj", "v_proj")))
    assert any(
        "quantized (bitsandbytes 4-bit)" in note and "upper bound" in note for note in p.notes
    )
    table = p.table()
    assert "frozen base shards (bfloat16) + fp32 adapter shards" in table


# the published parameter counts of the model cards, exact or as the card rounds them (Gemma 3: Keras Hub's
# presets, whose vocabulary is the text model's 262,144; the Hub's 4B/12B/27B text_config has 262,208 rows, 64
# more per hidden unit)
PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen3-0.6b": "0.6B",
    "qwen3-1.7b": "1.7B",
    "qwen3-4b": "4.0B",
    "qwen3-8b": "8.2B",
    "qwen3-14b": "14.8B",
    "qwen3-32b": "32.8B",
    "qwen3-30b-a3b": "30.5B",
    "mistral-7b": "7.25B",
    "mixtral-8x7b": "46.7B",
    "gemma3-1b": 999_885_952,
    "gemma3-4b-text": 3_880_099_328 + 64 * 2560,
    "gemma3-12b-text": 11_765_788_416 + 64 * 3840,
    "gemma3-27b-text": "27.0B",
    "phi3-mini": "3.8B",
    "phi4": "14.7B",
}


def test_every_listed_name_is_a_published_shape():
    import torch
    from transformers import AutoModelForCausalLM

    assert model_names() == sorted(PRESETS) == sorted(PUBLISHED)
    for name in model_names():
        resolved, config = resolve(name)
        assert resolved == name and config.model_type == PRESETS[name]["model_type"]
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        want = PUBLISHED[name]
        if isinstance(want, str):  # a card's rounded figure ("8.2B"): within half its last digit
            digits = want[:-1].split(".")[1] if "." in want[:-1] else ""
            assert abs(n - float(want[:-1]) * 1e9) <= 0.5 * 10 ** (9 - len(digits)), (name, n, want)
        else:
            assert n == want, (name, n, want)


@pytest.mark.parametrize("name", ["qwen3", "llama", "mistral", "qwen3-9b"])
def test_a_bare_type_or_unknown_name_is_refused_with_the_closest_presets(name, capsys):
    assert main(["plan", "--model", name, "--gpus", "8", "--seq-len", "1M"]) == 2
    err = capsys.readouterr().err
    assert "is not a preset (closest presets: " in err
    prefix = name.split("-")[0][:5]
    assert f"{prefix}" in err.split("closest presets: ")[1].split(")")[0]
    assert len(err) < 600  # a few suggestions, not every name


def test_tiny_models_have_tiny_names():
    name, config = resolve("tiny-qwen3")
    assert name == "tiny-qwen3" and config.num_hidden_layers == 2 and config.hidden_size == 64
    assert resolve("Qwen3-8B")[0] == "qwen3-8b"
    with pytest.raises(ValueError, match="not a preset"):
        resolve("tiny-no_such_type")


def test_sliding_and_full_attention_layers_hold_the_same_bytes():
    """Gemma 3's first layers are all sliding-window ones (5 of every 6), so the 3- and 4-layer simulations see no
    full-attention layer: extrapolating them is exact only because both kinds hold the same bytes. (gemma3-4b-text's
    heads and head dim, narrower.)"""
    row = dict(PRESETS["gemma3-4b-text"], hidden_size=512, intermediate_size=1024, vocab_size=1024)
    row["num_hidden_layers"] = 4
    sliding = _plan(
        dict(row, layer_types=["sliding_attention"] * 4, sliding_window=512), exact=True
    )
    full = _plan(dict(row, layer_types=["full_attention"] * 4), exact=True)
    assert sliding.by_category == full.by_category and sliding.reserved == full.reserved


@pytest.mark.slow
def test_a_plan_that_does_not_fit_prints_no_launch_line_but_what_fits(capsys):
    """Ulysses mode: the settings still chosen by the planner (its ladder, the last rung for the advice), on a
    shorter ladder than the fused block's (21 simulations instead of 34)."""
    argv = ["plan", "--model", "tiny-llama", "--gpus", "2", "--gpu-memory", "48MiB", "--step", "8K"]
    argv += ["--margin", "0.1", "--reserved", "1MiB", "--impl", "ulysses"]
    assert main([*argv, "--seq-len", "64K"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "launch:" not in out and "UPipeConfig(" not in out
    assert "no launch line: this does not fit." in out
    assert "longest that fits on these GPUs: 49,152 tokens (48K)" in out
    assert "fits 64K with: --nodes 2 --ring 2 (required" in out
    # the advice is the planner's own answer: 48K fits, and 64K fits on twice the nodes with a ring, with the
    # settings the advice names (the ladder's last rung: fixed by flags, one candidate instead of the ladder; the
    # ladder holds that rung, so the planner's own choice fits too)
    assert "with Ulysses mode (our code), heads_per_chunk=all, tiled MLP" in out
    assert "checkpoints offloaded to host" in out
    assert main([*argv, "--seq-len", "48K"]) == 0
    ring = [*argv, "--seq-len", "64K", "--nodes", "2", "--ring", "2", "--offload", "cpu"]
    assert main(ring) == 0
