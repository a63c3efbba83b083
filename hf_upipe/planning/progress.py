"""What the planner is doing, as it does it: one line per length tried and per candidate judged, with the elapsed
time, so that a long search (`hf-upipe plan --max`) is seen to work.

Entry points:
- `reporting(stream)`: a context manager; inside it, `say` writes `[plan 12.3 s] <text>` lines to `stream` (the
  command line passes stderr, unless `--json` without `--progress`). Outside it `say` does nothing (the library's
  `plan()` is silent).
- `say(text)`: one progress line, if a report is open.
"""

from __future__ import annotations

import contextlib
import contextvars
import time

__all__ = ["reporting", "say"]

_OPEN: contextvars.ContextVar = contextvars.ContextVar("hf_upipe_plan_progress", default=None)


@contextlib.contextmanager
def reporting(stream):
    """Progress lines to `stream` while inside; the elapsed time counts from entering."""
    token = _OPEN.set((stream, time.perf_counter()))
    try:
        yield
    finally:
        _OPEN.reset(token)


def say(text: str) -> None:
    """`[plan <elapsed> s] text` on the open report's stream (flushed at once); nothing without one."""
    report = _OPEN.get()
    if report is None:
        return
    stream, started = report
    print(f"[plan {time.perf_counter() - started:6.1f} s] {text}", file=stream, flush=True)
