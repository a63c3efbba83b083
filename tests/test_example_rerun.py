"""The examples' second run, as a user makes it: a mistyped flag, a rerun into the same folder, a resume.

Fast (each a real `python examples/<script>.py` process that stops at its flags): impossible values are refused
with one `error:` line naming the flag, exit status 2, in well under 5 s of CPU, without importing torch, and with
no folder written; a `--resume` of a run already at `--steps` (an imitated run: checkpoint records only) is one line,
exit status 0, every file's bytes and mtime unchanged; each refused flag combination's advice, followed, lets the
run go on (checked at the flags, in this process).
Slow (`test_every_advice_an_example_prints_works`: short one-process runs of each example): the advice that a
refused rerun prints is followed, flag by flag, and each works: `--resume latest` of the finished run changes
nothing, with `--steps` raised it trains on and its record (losses, rewards) covers every step, `--overwrite`
replaces the run, another `--output-dir` starts one (also with `--resume latest`, which finds no checkpoint there).
"""

import json
import os
import re
import resource
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    "long_context": "finetune_long_context.py",
    "trainer": "finetune_with_trainer.py",
    "grpo_passkey": "grpo_passkey.py",
}


def _run(example, argv, cwd, importtime=False, timeout=600):
    """The example as a user runs it (one process); (exit status, stdout, stderr, CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else [])]
    cmd += [os.path.join(ROOT, "examples", SCRIPTS[example]), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("RANK", None)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return proc.returncode, proc.stdout, proc.stderr, cpu


BAD = [
    ("long_context", ["--steps", "0"], "error: --steps 0: optimizer steps, at least 1"),
    (
        "long_context",
        ["--lr", "-1"],
        "error: --lr -1.0: the learning rate must be a positive number",
    ),
    ("long_context", ["--offload", "cpu"], "error: --offload cpu offloads what activation"),
    ("long_context", ["--seq-len", "4"], "error: --seq-len 4: tokens per row"),
    ("long_context", ["--grad-accum", "0"], "error: --grad-accum 0:"),
    (
        "long_context",
        ["--resume", "no/such/step-9"],
        "error: --resume no/such/step-9: no such folder",
    ),
    ("trainer", ["--steps", "0"], "error: --steps 0: optimizer steps, at least 1"),
    ("trainer", ["--lr", "-1"], "error: --lr -1.0: the learning rate must be a positive number"),
    ("trainer", ["--offload", "cpu", "--trl"], "error: --offload cpu offloads what activation"),
    ("trainer", ["--max-grad-norm", "-1"], "error: --max-grad-norm -1.0:"),
    ("grpo_passkey", ["--steps", "0"], "error: --steps 0: optimizer steps, at least 1"),
    (
        "grpo_passkey",
        ["--lr", "-1"],
        "error: --lr -1.0: the learning rate must be a positive number",
    ),
    ("grpo_passkey", ["--num-generations", "1"], "error: --num-generations 1: answers per prompt"),
]


@pytest.mark.parametrize("example, argv, line", BAD, ids=[f"{e} {' '.join(a)}" for e, a, _ in BAD])
def test_an_impossible_value_is_refused_before_torch_is_imported(example, argv, line, tmp_path):
    run = tmp_path / "run"
    code, out, err, cpu = _run(
        example, [*argv, "--output-dir", str(run)], tmp_path, importtime=True
    )
    imported = [x.split("|")[-1].strip() for x in err.splitlines() if x.startswith("import time:")]
    said = [x for x in err.splitlines() if not x.startswith("import time:")]
    assert code == 2 and len(said) == 1 and said[0].startswith(line), (code, said, out)
    assert not [m for m in imported if m.split(".")[0] in ("torch", "transformers", "hf_upipe")]
    assert cpu < 5, cpu
    assert os.listdir(tmp_path) == []  # nothing written: no run folder, no log


def _imitate_finished(run, example, step):
    """The records of a run's last checkpoint, without the weights (what the examples read to decide a resume)."""
    if example == "long_context":
        (run / f"step-{step}").mkdir(parents=True)
        (run / f"step-{step}" / "step.json").write_text(json.dumps({"step": step}))
    else:
        (run / f"checkpoint-{step}").mkdir(parents=True)
        state = {"global_step": step, "log_history": []}
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    (run / "loss.png").write_bytes(b"\x89PNG imitated")


def _files(run):
    """Every file under `run`: its bytes and its mtime (ns)."""
    return {
        os.path.join(d, n): (
            open(os.path.join(d, n), "rb").read(),
            os.stat(os.path.join(d, n)).st_mtime_ns,
        )
        for d, _, names in os.walk(run)
        for n in names
    }


@pytest.mark.parametrize("example", sorted(SCRIPTS))
def test_resuming_an_imitated_finished_run_is_one_line_and_changes_nothing(example, tmp_path):
    run = tmp_path / "run"
    _imitate_finished(run, example, 4)
    before = _files(run)
    for resume in (
        "latest",
        str(run / ("step-4" if example == "long_context" else "checkpoint-4")),
    ):
        argv = ["--output-dir", str(run), "--steps", "4", "--resume", resume]
        code, out, err, cpu = _run(example, argv, tmp_path)
        assert code == 0 and err == "", (code, err)
        assert out.splitlines() == [out.strip()] and out.startswith("already at step 4 of 4 ("), out
        assert "pass a larger --steps to continue it" in out
        assert cpu < 5, cpu
    assert _files(run) == before


def test_resume_latest_without_a_checkpoint_is_refused(tmp_path):
    """A folder with files but no checkpoint: --resume latest is refused, not a fresh run over the old files."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "loss.png").write_bytes(b"\x89PNG imitated")
    code, _, err, _ = _run(
        "long_context", ["--output-dir", str(run), "--resume", "latest"], tmp_path
    )
    assert code == 2 and err.strip() == (
        f"error: --resume latest: {run} holds no checkpoint to continue from; pass --overwrite instead to start "
        "again, or another --output-dir"
    )


def _preflight(argv, example, capsys):
    """`_flags.preflight` in this process: (exit status, the line it printed); status None when it let the run go
    on (the flags are fine, the folder may be written, there are steps to train)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import _flags
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    try:
        _flags.preflight(argv, example)
        code = None
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


def test_the_advice_of_each_refused_flag_combination_works(tmp_path, capsys, monkeypatch):
    """Each refusal that names a way on, followed as it says (flags only: nothing trains here): the run goes on."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "loss.png").write_bytes(b"\x89PNG imitated")
    cases = [
        # (refused argv, its line starts, [each way on the line names])
        (
            ["--offload", "cpu"],
            "error: --offload cpu offloads what activation checkpointing keeps: add --checkpointing "
            "(or --offload none)",
            [["--offload", "cpu", "--checkpointing"], ["--offload", "none"]],
        ),
        (
            ["--output-dir", str(run), "--resume", "latest"],
            f"error: --resume latest: {run} holds no checkpoint to continue from; pass --overwrite instead",
            [["--output-dir", str(run), "--overwrite"], ["--output-dir", str(tmp_path / "other")]],
        ),
        (
            ["--output-dir", str(run), "--resume", "latest", "--overwrite"],
            "error: --overwrite with --resume latest: --overwrite deletes the run that --resume continues; "
            "pass one of them",
            [["--output-dir", str(run), "--overwrite"]],
        ),
        (
            ["--resume", str(tmp_path / "nowhere")],
            f"error: --resume {tmp_path / 'nowhere'}: no such folder; pass a checkpoint folder of the run, "
            "or 'latest'",
            [["--resume", "latest"]],
        ),
    ]
    for example in ("long_context", "trainer"):
        for refused, line, ways in cases:
            code, said = _preflight(refused, example, capsys)
            assert code == 2 and said.startswith(line), (example, refused, said)
            for way in ways:
                assert _preflight(way, example, capsys) == (None, ""), (example, way)


# ---- slow: short one-process runs, and the advice they print followed ----------------------------------------
SMALL = {
    "long_context": ["--seq-len", "64", "--rows", "8", "--eval-rows", "0", "--save-every", "2"],
    "trainer": ["--seq-len", "64", "--rows", "8", "--eval-rows", "0", "--save-every", "2"],
    "grpo_passkey": [
        *("--prompt-len", "16", "--prompts-per-step", "2", "--num-generations", "4"),
        *("--format-steps", "3", "--format-batch", "4", "--lora-rank", "4", "--save-every", "2"),
    ],
}
RECORD = {"long_context": "losses", "trainer": "losses", "grpo_passkey": "rewards"}


def _train(example, run, steps, tmp_path, extra=()):
    log = tmp_path / f"{run.name}-{steps}.json"
    argv = [
        *SMALL[example],
        "--steps",
        str(steps),
        "--output-dir",
        str(run),
        "--log-json",
        str(log),
        *extra,
    ]
    code, out, err, _ = _run(example, argv, tmp_path)
    assert code == 0, (out[-2000:], err[-3000:])
    with open(log) as f:
        return {int(k): v for k, v in json.load(f)[RECORD[example]].items()}, out


def _advice(line):
    """The flags an advice line names: 'pass --overwrite to replace it, --resume latest to continue it, ...'."""
    return re.findall(r"(--[a-z][a-z-]*)(?: (latest))?", line.split("pass ", 1)[1])


@pytest.mark.slow  # several one-process runs of each example (about a minute each on 2 cores)
@pytest.mark.parametrize("example", sorted(SCRIPTS))
def test_every_advice_an_example_prints_works(example, tmp_path):
    run = tmp_path / "run"
    first, _ = _train(example, run, 4, tmp_path)
    assert sorted(first) == [1, 2, 3, 4]
    code, _, err, _ = _run(example, [*SMALL[example], "--output-dir", str(run)], tmp_path)
    assert code == 2, err
    advice = _advice(err.strip().splitlines()[-1])
    assert advice == [("--overwrite", ""), ("--resume", "latest"), ("--output-dir", "")], err
    # --resume latest: the finished run is left as it is, and its one line names the way on (a larger --steps)
    before = _files(run)
    code, out, err, _ = _run(
        example,
        [*SMALL[example], "--steps", "4", "--output-dir", str(run), "--resume", "latest"],
        tmp_path,
    )
    assert (
        code == 0 and out.startswith("already at step 4 of 4") and _advice(out) == [("--steps", "")]
    )
    assert _files(run) == before
    # ... with --steps raised it trains on; the record covers every step, the first ones as first trained
    resumed, out = _train(example, run, 6, tmp_path, ["--resume", "latest"])
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] and {s: resumed[s] for s in first} == first
    summary = "loss: first 6 steps" if example == "long_context" else None
    assert summary is None or summary in out, out
    # --overwrite replaces the run; another --output-dir starts one (with --resume latest too: a job that always
    # passes it starts where there is no checkpoint yet)
    again, _ = _train(example, run, 2, tmp_path, ["--overwrite"])
    assert sorted(again) == [1, 2] and again[1] == first[1]
    other, _ = _train(example, tmp_path / "other", 2, tmp_path, ["--resume", "latest"])
    assert other == again


@pytest.mark.slow  # a launch of 2 processes
def test_an_impossible_value_under_accelerate_launch_is_one_line_from_every_rank(tmp_path):
    """Both ranks refuse --steps 0 before importing torch; the first prints the line, both exit with 2 together
    (none stopped by the launcher), the launcher's summary quotes the line for each, and nothing is written."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml"), "--main_process_port", "0"]
    cmd += [os.path.join(ROOT, "examples", SCRIPTS["long_context"]), "--steps", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    console = proc.stdout + proc.stderr
    line = "error: --steps 0: optimizer steps, at least 1"
    assert [x for x in console.splitlines() if x.startswith("error")] == [line], console
    assert re.findall(r"^\s+exitcode\s+: (-?\d+)", console, re.M) == ["2", "2"], console
    assert console.count(f"traceback : {line}") == 2, console
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # two launches of 2 processes, at once
def test_two_runs_launched_at_once_with_the_cpu_config_each_get_a_port(tmp_path):
    """accelerate_configs/cpu_2proc.yaml leaves the port to accelerate (0: a free one for each launch): two runs
    launched at the same moment on one machine both train, and neither finds its port taken."""
    config = os.path.join(ROOT, "accelerate_configs", "cpu_2proc.yaml")
    script = os.path.join(ROOT, "examples", SCRIPTS["long_context"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, script]
            + ["--steps", "2", "--seq-len", "64", "--rows", "4", "--eval-rows", "0"]
            + ["--output-dir", str(tmp_path / name)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    for run in runs:
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0 and "loss: first 2 steps" in out, out[-3000:]
        assert "already in use" not in out, out[-3000:]
