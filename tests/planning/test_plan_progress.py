"""`hf-upipe plan` shows its work on stderr: a line for each candidate judged (k of n, the length) and each length
the longest-length search tries, each with the elapsed time; none under `--json` unless `--progress` asks for it,
none with `--no-progress`, and the table (or JSON) on stdout is the same either way. One small plan (fixed settings:
one candidate), run through the command's own `main`."""

import json
import re

import pytest

from hf_upipe.cli import main

PLAN = ["plan", "--model", "tiny-llama", "--gpus", "2", "--seq-len", "2K", "--heads-per-chunk", "1"]
LINE = re.compile(r"^\[plan +\d+\.\d s\] (.+)$")


def _timeless(text):
    """A plan's JSON without the seconds it took."""
    plan = json.loads(text)
    plan.pop("seconds")
    return plan


def _plan(capsys, *extra):
    code = main([*PLAN, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_progress_on_stderr_and_json_stays_quiet(capsys):
    code, table, err = _plan(capsys)
    assert code == 0 and "launch:" in table
    lines = err.splitlines()
    said = [LINE.match(line) for line in lines]
    assert lines and all(said), err  # every stderr line is a progress line, with the elapsed time
    texts = [m.group(1) for m in said]
    assert texts[0] == "planning tiny-llama on 1 x 2 GPUs: 1 candidate settings", texts
    assert "candidate 1 of 1 at 2K tokens: fused UPipe, heads_per_chunk=1" in " ".join(texts), texts
    elapsed = [float(line.split()[1]) for line in lines]
    assert elapsed == sorted(elapsed)

    code, as_json, err = _plan(capsys, "--json")
    assert code == 0 and err == "" and as_json.lstrip().startswith("{")
    code, again, err = _plan(capsys, "--json", "--progress")
    assert code == 0 and _timeless(again) == _timeless(as_json)
    assert [LINE.match(line).group(1) for line in err.splitlines()] == texts
    code, quiet_table, err = _plan(capsys, "--no-progress")
    assert code == 0 and err == "" and quiet_table.splitlines()[:-1] == table.splitlines()[:-1]


@pytest.mark.slow  # a --max search: several simulated lengths
def test_the_longest_length_search_names_each_length_it_tries(capsys):
    argv = [*PLAN[:5], "--heads-per-chunk", "1", "--max", "--step", "8K", "--gpu-memory", "1GiB"]
    main([*argv, "--json", "--progress"])
    err = capsys.readouterr().err
    tried = re.findall(r"longest length: trying (\S+) tokens", err)
    assert len(tried) >= 2 and len(set(tried)) == len(tried), err
