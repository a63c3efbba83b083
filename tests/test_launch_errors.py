"""A setting error that nothing catches, under `torchrun` (2 CPU processes): one line from the first rank, every
rank exits with status 2, and no rank prints a traceback (`hf_upipe.exits`). The launcher then prints its own
summary of the failed ranks, which names each rank's status 2 and the same line as the root cause, and exits with
1 (its own status, which no script can set). The examples' flags under `accelerate launch`:
tests/test_examples.py::test_a_bad_setting_is_one_line_from_one_rank."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow  # a launch of 2 processes

# a user's script: the error is raised by hf_upipe and caught by nothing
USER_SCRIPT = """
import torch.distributed as dist
import hf_upipe
dist.init_process_group("gloo")
hf_upipe.init_sequence_parallel(sp_size=3)
"""


def _launch(cmd, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("UPIPE_TRACEBACK", None)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _check_console(code, console, line, tmp_path):
    said = [x for x in console.splitlines() if x.startswith("error")]
    assert said == [line], console  # once, from the first rank
    assert console.index(line) < console.index("ChildFailedError"), (
        console
    )  # before the launcher's summary
    # no rank's traceback: only the launcher's own frames
    frames = re.findall(r'File "([^"]+)"', console)
    assert not [f for f in frames if f.startswith((ROOT, str(tmp_path)))], console
    statuses = re.findall(r"^\s+exitcode\s+: (-?\d+)", console, re.M)
    assert statuses == ["2", "2"], console  # every rank exits with 2 (none killed by the launcher)
    assert console.count(f"traceback : {line}") == 2, console  # the launcher's summary names it
    assert code == 1  # the launcher's own status (torch's ChildFailedError)


def test_torchrun_uncaught_setting_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    code, console = _launch(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        tmp_path,
    )
    _check_console(
        code,
        console,
        "error: sp_size=3 does not divide the world size 2; use one of [1, 2].",
        tmp_path,
    )


# one rank's own error (the first rank raised none): that rank says it, naming itself, after a bounded wait
ALONE = """
import os, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(store.port), RANK="1", WORLD_SIZE="2")
from hf_upipe import exits
exits.WAIT_S = 0.5
exits.exit_with_error(ValueError("rank 1's batch has no labels"))
"""


def test_a_rank_alone_says_its_own_error(tmp_path):
    code, console = _launch([sys.executable, "-c", ALONE], tmp_path)
    assert code == 2
    assert console.strip() == "error (rank 1): rank 1's batch has no labels", console
