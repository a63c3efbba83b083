"""What people type, read one way everywhere: sizes and lengths (`hf_upipe.units`), model names
(`hf_upipe.models.presets`)
shared by `hf-upipe plan` and `hf-upipe selftest`, input errors as exit 2 with the whole message, and advice that
names keys the model really has."""

import types

import pytest

from hf_upipe import UPipeConfig
from hf_upipe.cli import main
from hf_upipe.models.presets import model_names, resolve, runnable_config
from hf_upipe.units import format_tokens, parse_size, parse_tokens


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("80 gib", 80 * 2**30),
        ("75.5GiB", int(75.5 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("2TiB", 2 * 2**40),
        ("85899345920B", 85899345920),
        (1024, 1024),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("80", "'80' has no unit: write 80GiB"),
        ("85899345920", "has no unit"),
        ("eighty", "write e.g. 80GiB"),
        ("80XB", "unknown unit 'xb'"),
        ("-1GiB", "cannot read"),
    ],
)
def test_sizes_without_a_unit_or_unreadable_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_size(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1M", 2**20),
        ("512K", 512 * 2**10),
        ("1048576", 2**20),
        ("1.5M", 3 * 2**19),
        ("7m", 7 * 2**20),
        ("1_048_576", 2**20),
        (4096, 4096),
    ],
)
def test_lengths(text, expected):
    assert parse_tokens(text) == expected
    assert parse_tokens(format_tokens(expected)) == expected


@pytest.mark.parametrize("text", ["1.3K", "0", "one M", "3G"])
def test_bad_lengths(text):
    with pytest.raises(ValueError):
        parse_tokens(text)


def test_config_reads_lengths_and_sizes_the_same_way():
    cfg = UPipeConfig(auto=True, plan_seq_len="1M", gpu_memory="80GiB")
    assert cfg.plan_seq_len == 2**20
    with pytest.raises(ValueError, match="gpu_memory='80'.*no unit"):
        UPipeConfig(auto=True, plan_seq_len="1M", gpu_memory="80")


def test_plan_and_selftest_share_the_model_names():
    names = model_names()
    assert {"llama3-8b", "qwen3-8b", "qwen3-32b", "llama3-70b", "mixtral-8x7b"} <= set(names)
    # no tiny model under a real name
    assert not {"llama", "mistral", "qwen2", "qwen3"} & set(names)
    for name in names:
        assert resolve(name)[0] == name
        _, config = runnable_config(
            name
        )  # what the self-test builds: small, with the preset's type and head geometry
        assert config.hidden_size <= 512
    _, small = runnable_config("llama3-8b")
    assert (small.num_attention_heads, small.num_key_value_heads) == (32, 8)
    assert runnable_config("qwen3-30b-a3b")[1].model_type == "qwen3_moe"
    assert (
        runnable_config("tiny-qwen3")[1].hidden_size
        == runnable_config("qwen3")[1].hidden_size
        == 64
    )


def test_unknown_names_are_refused_without_the_network(monkeypatch):
    import transformers

    def no_network(*args, **kwargs):
        raise AssertionError("the Hub must not be tried for a name that cannot be a Hub id")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_network)
    with pytest.raises(ValueError, match="not a preset .closest presets: llama3-8b.*org/name"):
        resolve("llama3-8B-typo")


def test_plan_input_errors_exit_2_with_the_whole_message(capsys):
    assert (
        _exit(
            ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80", "--seq-len", "1M"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "'80' has no unit: write 80GiB (2**30 bytes each) or 80GB (10**9), or 80B for bytes" in err
    )
    assert main(["plan", "--model", "no-such-model", "--gpus", "8", "--seq-len", "1M"]) == 2
    assert "is not a preset" in capsys.readouterr().err
    assert _exit(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "1.3K"]) == 2
    assert "not a whole number" in capsys.readouterr().err


def test_plan_reads_lengths_and_states_its_assumptions(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny-llama",
                "--gpus",
                "2",
                "--seq-len",
                "4K",
                "--gpu-memory",
                "8GiB",
                "--host-memory",
                "64GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "sequence 4,096 tokens (4K)" in out
    assert "assumed: 5% of each GPU kept free, usable 7.60 of 8.00 GiB (--headroom)" in out
    assert "64.00 GiB of host memory per node" in out


def test_selftest_input_errors_exit_2_before_starting_anything(capsys):
    assert main(["selftest", "--model", "llama3-8b", "--sp", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "--sp 3 cannot split llama3-8b: num_attention_heads=32 is not divisible by sp_size=3" in err
    )
    assert "[2, 4, 8]" in err
    assert main(["selftest", "--model", "llama", "--sp", "2", "--heads-per-chunk", "3"]) == 2
    assert "--heads-per-chunk 3 does not fit llama" in capsys.readouterr().err


def test_dropout_advice_names_the_models_own_key():
    from hf_upipe.attention.state import check_call

    gpt2_like = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace(attn_pdrop=0.1))
    with pytest.raises(NotImplementedError, match=r"attn_pdrop=0.0"):
        check_call(gpt2_like, 0.1, {})
    llama_like = types.SimpleNamespace(
        is_causal=True, config=types.SimpleNamespace(attention_dropout=0.1)
    )
    with pytest.raises(NotImplementedError, match=r"attention_dropout=0.0"):
        check_call(llama_like, 0.1, {})


def _exit(argv) -> int:
    """main(argv), where argparse's own errors (SystemExit) count as the exit code."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code
