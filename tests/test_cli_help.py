"""`hf-upipe <command> --help`: every default shown, no sentence said twice, and the help of a command loads no
other command's modules nor transformers (the planner's `plan --help` excepted: its --model list reads
transformers' registry of model types). `import hf_upipe` imports no torch (docs/architecture.md): `hf-upipe --help`
loads none, and takes well under 2 s of CPU."""

import argparse
import re
import subprocess
import sys

import pytest

from hf_upipe.cli import _COMMANDS, build_parser

LIGHT = ["", "env", "fingerprints", "selftest", "calibrate"]  # "": `hf-upipe --help`
HEAVY = (
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "trl",
    "hf_upipe.planning.planner",
)

_PROBE = """
import runpy, sys
sys.argv = ["hf-upipe", *sys.argv[1:], "--help"]
try:
    runpy.run_module("hf_upipe.cli", run_name="__main__")
except SystemExit as done:
    assert done.code in (0, None), done.code
print("LOADED", sorted(m for m in %r if m in sys.modules))
""" % (HEAVY,)


def test_help_loads_neither_transformers_nor_the_other_commands():
    runs = {
        c: subprocess.Popen(
            [sys.executable, "-c", _PROBE, *([c] if c else [])], stdout=subprocess.PIPE, text=True
        )
        for c in LIGHT
    }
    for command, proc in runs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "usage: hf-upipe" in out, (command, out[-500:])
        loaded = out.rsplit("LOADED", 1)[1].strip()
        assert loaded == "[]", (command, loaded)


def test_the_top_help_loads_no_torch_and_takes_under_2_s_of_cpu():
    """`hf-upipe --help` (and `import hf_upipe`) imports neither torch nor transformers."""
    import resource

    probe = _PROBE.replace("%r" % (HEAVY,), repr(("torch", *HEAVY)))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert out.returncode == 0 and "usage: hf-upipe" in out.stdout, out.stderr[-2000:]
    assert out.stdout.rsplit("LOADED", 1)[1].strip() == "[]", out.stdout[-500:]
    assert cpu < 2, cpu


def _child(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        command
    ]


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_every_default_is_shown_once_and_no_sentence_repeats(command):
    child = _child(command)
    formatter = child.formatter_class(command)
    for action in child._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        said = (formatter._get_help_string(action) or "") % {**vars(action), "prog": command}
        flag = action.option_strings[0]
        if action.default not in (None, False) and not action.required:
            assert said.lower().count("default") == 1, (command, flag, said)
        sentences = [s.strip().lower() for s in re.split(r"[.;]\s", said) if len(s.strip()) > 20]
        assert len(sentences) == len(set(sentences)), (command, flag, said)
    text = " ".join(child.format_help().split())
    sentences = [s for s in re.split(r"(?<=[.;])\s+", text) if len(s) > 30]
    assert len(sentences) == len(set(sentences)), (command, text)


def test_the_kernel_setting_describes_every_kernel_name():
    from hf_upipe.config import UPipeConfig
    from hf_upipe.ops.kernels import available_kernels

    said = UPipeConfig.__dataclass_fields__["kernel"].metadata["help"]
    assert all(f"'{name}'" in said for name in ["auto", *available_kernels()]), said
