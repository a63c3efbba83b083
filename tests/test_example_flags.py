"""The examples' command lines, in this process (no training): switches as --flag / --no-flag, choices in --help,
and input errors as one line naming the flag, exit status 2, before any process group or model exists."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _script(name):
    sys.path.insert(0, EXAMPLES)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(EXAMPLES)


@pytest.fixture(scope="module", params=["finetune_long_context", "finetune_with_trainer"])
def script(request):
    return _script(request.param)


def _exit_code(script, argv, capsys):
    common = sys.modules["_common"]
    with pytest.raises(SystemExit) as exit_:
        common.run(lambda: script.main(argv))
    return exit_.value.code, capsys.readouterr()


def test_help_lists_the_choices_and_the_switches(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--help"])
    out = capsys.readouterr().out
    for text in (
        "--tiled-mlp, --no-tiled-mlp",
        "--checkpointing, --no-checkpointing",
        "--full, --no-full",
        "{none,cpu,disk}",
        "{auto,",
        "'text' field",
        "examples/sample.jsonl",
    ):
        assert text in out, text


def test_switches_parse_with_and_without_no(script):
    common = sys.modules["_common"]
    import argparse

    parser = argparse.ArgumentParser()
    common.add_common_flags(parser)
    on = parser.parse_args(
        ["--tiled-mlp", "--checkpointing", "--offload", "cpu", "--heads-per-chunk", "all"]
    )
    assert common.upipe_settings(on) == {
        "tiled_mlp": True,
        "offload": "cpu",
        "heads_per_chunk": "all",
    }
    off = parser.parse_args(["--no-tiled-mlp", "--heads-per-chunk", "2"])
    assert common.upipe_settings(off) == {"tiled_mlp": False, "heads_per_chunk": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--heads-per-chunk", "two"])


def test_offload_without_checkpointing_names_the_flags(script, capsys):
    code, out = _exit_code(script, ["--offload", "cpu", "--steps", "1"], capsys)
    assert code == 2
    assert out.err.strip() == (
        "error: --offload cpu offloads what activation checkpointing keeps: add --checkpointing "
        "(or --offload none)"
    )


def test_data_without_a_text_field_is_one_line(script, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "hello"}) + "\n")
    code, out = _exit_code(script, ["--data", str(bad), "--steps", "1"], capsys)
    assert code == 2
    lines = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "no 'text' field (they have ['content'])" in lines[0]
    assert "Traceback" not in out.err


def test_the_sample_data_file_is_readable():
    common = _script("_common")
    data = common.text_dataset(os.path.join(EXAMPLES, "sample.jsonl"), common.ByteTokenizer(), 256)
    assert len(data) > 10 and len(data[0]["input_ids"]) == 256


def test_eval_example_help_and_its_input_errors(capsys, tmp_path):
    """`examples/eval_long_context.py`: --help, and a missing adapter or a too-short length as one line, exit 2."""
    script = _script("eval_long_context")
    with pytest.raises(SystemExit):
        script.main(["--help"])
    out = capsys.readouterr().out
    for text in (
        "--adapter",
        "--length",
        "--rows",
        "--new-tokens",
        "--output",
        "hf_upipe.generate",
    ):
        assert text in out, text
    code, out = _exit_code(script, ["--adapter", str(tmp_path)], capsys)
    assert code == 2
    assert out.err.strip() == (
        f"error: --adapter {tmp_path}: no adapter_config.json there; train first (the main example saves "
        "runs/long_context-lora/step-300/model) or pass the folder of a saved PEFT adapter"
    )
    code, out = _exit_code(script, ["--length", "8"], capsys)
    assert code == 2
    assert out.err.strip() == "error: --length 8: a passkey row needs at least 16 bytes"


def test_an_earlier_run_is_refused_without_overwrite(script, capsys, tmp_path):
    """A rerun into the same folder must not overwrite its checkpoints silently: one line, exit 2."""
    (tmp_path / "run" / "step-300").mkdir(parents=True)
    argv = ["--output-dir", str(tmp_path / "run"), "--rows", "2", "--seq-len", "64"]
    code, out = _exit_code(script, argv, capsys)
    assert code == 2
    assert out.err.strip() == (
        f"error: --output-dir {tmp_path / 'run'} holds an earlier run (step-300): pass --overwrite to replace "
        "it, --resume latest to continue it, or another --output-dir"
    )


def test_each_run_has_a_folder_of_its_own(tmp_path):
    """The default folders name the example and the mode: the Trainer and --trl runs keep their own `final`."""
    common = _script("_common")
    import argparse

    folders = []
    for example, extra in (
        ("long_context", []),
        ("long_context", ["--full"]),
        ("trainer", []),
        ("trl", []),
        ("trl", ["--full"]),
    ):
        parser = argparse.ArgumentParser()
        common.add_common_flags(parser)
        folders.append(common.run_dir(parser.parse_args(extra), example))
    assert folders == [
        os.path.join("runs", name)
        for name in (
            "long_context-lora",
            "long_context-full",
            "trainer-lora",
            "trl-lora",
            "trl-full",
        )
    ]


def test_report_to_reaches_the_trainer(monkeypatch, tmp_path):
    """`--report-to` is the Trainer's `report_to` (default none: CI needs no tracker installed)."""
    script = _script("finetune_with_trainer")
    seen = []

    class Stop(Exception):
        pass

    def fake_trainer(*, args, **kwargs):
        seen.append(args.report_to)
        raise Stop

    monkeypatch.setattr(script, "UPipeTrainer", fake_trainer)
    small = ["--rows", "2", "--seq-len", "64", "--steps", "1"]
    for i, extra in enumerate(([], ["--report-to", "tensorboard", "wandb"])):
        with pytest.raises(Stop):
            script.main(small + ["--output-dir", str(tmp_path / str(i))] + extra)
    assert seen == [[], ["tensorboard", "wandb"]]  # "none" is transformers' empty list
