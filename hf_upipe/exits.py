"""A bad setting ends a launched run with one line from the first rank and exit status 2 on every rank.

hf_upipe raises the same error on every rank for a setting or an input it refuses (a `ValueError`, `TypeError` or
`NotImplementedError` raised by its own code: `is_setting_error`), before any collective. Under `accelerate launch` or
`torchrun`, left to Python, every rank would print its own traceback and exit with 1.

Entry points:
- `exit_with_error(err, code=2)`: print `error: <message>` once (from the first rank; from another rank only when the
  first one did not report an error of its own within `WAIT_S`), record the message in the launcher's error file
  (so its summary of the failed ranks shows it as the root cause), destroy the process groups and exit with `code`.
  The other ranks wait, through the launcher's own key-value store, until the first rank has printed, so that the
  launcher cannot stop the first rank before its line is out. The examples' `run()` calls it.
- `record_line(line)`: write `line` into this rank's launcher error file (torchrun's format), if there is one.
- `report_setting_errors()`: a `sys.excepthook` that does the same for an uncaught setting error (from the Trainer,
  the plugin, the runtime, `init_sequence_parallel`, `from_pretrained`, ...) and leaves any other error to Python.
  `import hf_upipe` installs it in processes started by a launcher (`TORCHELASTIC_RUN_ID` set); `UPIPE_TRACEBACK=1`
  keeps Python's tracebacks. An error marked `upipe_line` (`hf_upipe.training.peers.PeerStopped`: each rank's
  own line naming a rank that stopped) is printed as its line alone, and the rank exits with status 1; so is an
  explained fault of the rank's own marked `upipe_fault` (`hf_upipe.training.save_errors.CheckpointSaveError`,
  the out-of-memory error of `hf_upipe.training.oom`), as `error (rank N): <type>: <message>`, at once (a rank
  that tears its interpreter down after the launcher's SIGTERM can meet its SIGKILL first).

What the console then shows: the one line, then the launcher's own summary. torchrun's elastic agent reports any
rank that exits with a status other than 0 as failed, in a `ChildFailedError` block naming each rank's exit code
(2) and the root cause's message, and the launcher itself (`accelerate launch`, `torchrun`) exits with 1: no script
can change the launcher's own status. Run with one process (`python script.py`) and the shell sees status 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

__all__ = [
    "WAIT_S",
    "exit_with_error",
    "is_setting_error",
    "raised_in_hf_upipe",
    "record_line",
    "report_setting_errors",
]

WAIT_S = 10.0  # how long a rank other than the first waits for the first rank's line
# keys of the launcher's store, per attempt (a restarted run starts afresh)
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
_SAID = f"hf_upipe/{_ATTEMPT}/setting_error_said"  # the first rank printed its line
_EXITING = f"hf_upipe/{_ATTEMPT}/setting_error_exiting"  # how many ranks are about to exit


_PACKAGE = os.path.dirname(
    os.path.abspath(__file__)
)  # this package's folder, wherever it is installed or cloned


def raised_in_hf_upipe(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is in this package's own files (not a user's file in some
    folder that happens to be named hf_upipe, nor the tests or examples of a clone named so)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(
        _PACKAGE + os.sep
    )


def is_setting_error(err: BaseException) -> bool:
    """A ValueError, TypeError or NotImplementedError raised by hf_upipe's own code (its innermost frame)."""
    return isinstance(err, (ValueError, TypeError, NotImplementedError)) and raised_in_hf_upipe(err)


def _store():
    """The launcher's key-value store (torchrun's agent hosts it at MASTER_ADDR:MASTER_PORT), or None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=WAIT_S),
        )
    except Exception:  # noqa: BLE001  (no store: the ranks do not wait for each other)
        return None


def _first_rank_said(store) -> bool:
    """Whether the first rank printed its line within `WAIT_S` (polled: a timed-out wait would log warnings)."""
    deadline = time.monotonic() + WAIT_S
    while store is not None and time.monotonic() < deadline:
        if _store_call(store, "check", [_SAID]):
            return True
        time.sleep(0.01)
    return False


def record_line(line: str) -> None:
    """The launcher's error file of this rank (torchrun's format): its summary shows `line` as the traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            message = {"py_callstack": line, "timestamp": str(int(time.time()))}
            json.dump({"message": {"message": line, "extraInfo": message}}, f)
    except OSError:
        pass


def _say(err: BaseException, stream, store) -> tuple[str, bool]:
    """Print the line once (module docstring): (the line, whether the first rank printed it)."""
    rank = int(os.environ.get("RANK", "0"))
    line = f"error: {err}"
    if rank == 0:
        print(line, file=stream, flush=True)
        _store_call(store, "set", _SAID, "1")
    elif not _first_rank_said(store):
        line = f"error (rank {rank}): {err}"
        print(line, file=stream, flush=True)
        return line, False
    return line, True


def _gather(store) -> None:
    """Wait (bounded) until every rank is about to exit, so that the launcher stops none of them before it exits
    with status 2 of its own."""
    if _store_call(store, "add", _EXITING, 1) is None:
        return
    world, deadline = int(os.environ.get("WORLD_SIZE", "1")), time.monotonic() + WAIT_S
    while (_store_call(store, "add", _EXITING, 0) or 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def _store_call(store, name, *args):
    if store is None:
        return None
    try:
        return getattr(store, name)(*args)
    except Exception:  # noqa: BLE001  (the launcher's store went away: nothing to wait for)
        return None


def _destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # a gloo group left to the interpreter's exit can abort the process


def _end(err: BaseException, stream, code: int) -> None:
    """Say, record, destroy the groups; under a launcher, gather the ranks and exit at once (no interpreter
    teardown, which takes each rank its own time)."""
    store = _store()
    line, together = _say(err, stream, store)
    record_line(line)
    try:
        _destroy_groups()
    finally:
        if store is not None:
            if together:
                _gather(store)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def exit_with_error(err: BaseException, code: int = 2):
    """See the module docstring (without a launcher, raises SystemExit(code))."""
    _end(err, sys.stderr, code)
    raise SystemExit(code)


def _hook(previous):
    def upipe_excepthook(kind, err, tb):
        if os.environ.get("UPIPE_TRACEBACK") == "1":
            return previous(kind, err, tb)
        if getattr(
            err, "upipe_line", False
        ):  # a fault line of every rank's own (training.peers): no traceback
            line = str(err)
            print(line, file=sys.__stderr__ or sys.stderr, flush=True)
            record_line(line)
            sys.stdout.flush()
            os._exit(1)  # (no group teardown: a peer is gone)
        fault = getattr(err, "upipe_fault", False)
        # an explained fault of this rank (a failed save, an out-of-memory error): its line, then exit at once:
        # the launcher stops the other ranks, and would stop this one mid-teardown
        if fault:
            label = fault if isinstance(fault, str) else type(err).__name__
            line = f"error (rank {os.environ.get('RANK', '0')}): {label}: {err}"
            print(line, file=sys.__stderr__ or sys.stderr, flush=True)
            record_line(line)
            sys.stdout.flush()
            os._exit(1)
        if not is_setting_error(err):
            return previous(kind, err, tb)
        # the process's own stderr: torch.distributed's excepthook hands the hooks it wraps a buffer
        _end(err, sys.__stderr__ or sys.stderr, 2)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # (an excepthook cannot set the status: the interpreter would exit with 1)

    upipe_excepthook.upipe = True
    return upipe_excepthook


def report_setting_errors() -> None:
    """Install the excepthook (idempotent; see the module docstring)."""
    if not getattr(sys.excepthook, "upipe", False):
        sys.excepthook = _hook(sys.excepthook)
