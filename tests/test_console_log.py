"""hf_upipe's INFO lines reach the console by default, on rank 0 only, once, and a user's logging set-up wins
(`hf_upipe.console_log`). Each case is a fresh interpreter: logging's configuration is process-wide."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOG = "import logging\nlogging.getLogger('hf_upipe.trl.sft').info('the line the docs promise')\n"


def _stderr(code: str, **env) -> str:
    environ = {
        k: v for k, v in os.environ.items() if k != "RANK"
    }  # the launcher's rank, if any, is ours to set
    environ.update(PYTHONPATH=ROOT, **env)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.parametrize(
    "setup, env, expected",
    [
        ("import hf_upipe\n", {}, ["the line the docs promise"]),  # by default: INFO, once
        ("import hf_upipe\n", {"RANK": "1"}, []),  # not from the other ranks
        # a user's configuration: their format, their handler, one line (no duplicate from hf_upipe's handler)
        (
            "import logging\nlogging.basicConfig(level=logging.INFO, format='USER %(message)s')\nimport hf_upipe\n",
            {},
            ["USER the line the docs promise"],
        ),
        # configured after the import: still one line, theirs
        (
            "import hf_upipe, logging\nlogging.basicConfig(format='USER %(message)s')\n",
            {},
            ["USER the line the docs promise"],
        ),
        # a level the user set on the hf_upipe logger is kept
        (
            "import logging\nlogging.getLogger('hf_upipe').setLevel(logging.WARNING)\nimport hf_upipe\n",
            {},
            [],
        ),
    ],
    ids=["default", "rank-1", "basicConfig-first", "basicConfig-after", "user-level"],
)
def test_hf_upipe_info_lines_on_the_console(setup, env, expected):
    lines = [line for line in _stderr(setup + LOG, **env).splitlines() if "docs promise" in line]
    assert lines == expected


def test_debug_lines_stay_hidden():
    err = _stderr("import hf_upipe, logging\nlogging.getLogger('hf_upipe.x').debug('debug line')\n")
    assert "debug line" not in err


def test_the_planners_simulated_ranks_stay_silent():
    """The planner builds models on simulated ranks (a "fake" process group): their setup lines are not the run's."""
    code = (
        "import logging, hf_upipe\nfrom hf_upipe.planning.simulate import simulated_world\n"
        "with simulated_world(2):\n    logging.getLogger('hf_upipe.x').info('simulated line')\n"
        "logging.getLogger('hf_upipe.x').info('real line')\n"
    )
    err = _stderr(code)
    assert "simulated line" not in err and "real line" in err
