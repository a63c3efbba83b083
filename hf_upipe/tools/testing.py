"""Spawned process groups for checks that need several ranks on one machine: the one harness the self-test and the
test suite share.

Entry point:
- `run_distributed(fn, world_size, *args, timeout=120.0, backend=None, start_method="spawn")`: runs
  `fn(rank, world_size, *args)` in `world_size` fresh processes joined by one process group (gloo on CPU; NCCL when
  there is a GPU per rank, or `backend`), and returns the per-rank return values, ordered by rank (plain picklable
  Python: compute errors inside the worker, judge them in the caller). Each worker runs torch with one thread (ranks
  share the machine's cores), in the caller's environment variables and working directory.

Failures end the call with `DistributedFailure`, which names each failed rank (`.ranks`) and how it failed:
- a rank that raises: its traceback; the others get `REPORT_GRACE_S` seconds to report theirs (an error raised on
  every rank shows every rank's), then the rest are stopped;
- a rank that dies without a word (killed by a signal: SIGKILL is what the kernel's out-of-memory killer sends; or
  `exit()` inside `fn`): its exit status and the cause, seen within about `DEATH_GRACE_S` seconds, and the others,
  who would wait in a collective for it, are stopped at once (`.died`: rank -> exit code);
- no answer: collectives time out after `timeout` seconds, and the call gives up `timeout` + 60 s after the start.

The rendezvous store is a `torch.distributed.TCPStore` the caller creates on a port the operating system picks and
holds until the ranks are done, so two calls at the same time (two test workers, two self-tests) cannot meet on the
same port: there is no window between choosing a free port and binding it.

`start_method="forkserver"` (what the test suite uses, with torch and transformers preloaded in the server) forks
every worker from one clean server process that imported the heavy modules once, instead of starting a Python
that imports them again for each rank of each call; the workers are still fresh processes.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from multiprocessing.reduction import ForkingPickler

__all__ = ["DistributedFailure", "run_distributed"]


class DistributedFailure(AssertionError):
    """A spawned rank raised (its traceback is in the message), died, or did not answer in time.

    `ranks`: the ranks that failed, sorted; `died`: rank -> exit code of those that ended without a report (a
    negative code is the signal that killed it)."""

    def __init__(self, message: str, ranks=(), died=None):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.died = dict(died or {})


REPORT_GRACE_S = 20.0  # after a rank reported an error: how long the others get to report theirs
DEATH_GRACE_S = 3.0  # after a rank's process ended: how long its report may still be on its way


def death_cause(exitcode: int) -> str:
    """How a process that ended with `exitcode` (multiprocessing's: -N for signal N) died, in words."""
    if exitcode >= 0:
        return f"exited with status {exitcode} before reporting a result"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = "unknown signal"
    said = f"killed by signal {-exitcode} ({name})"
    if -exitcode == signal.SIGKILL:
        said += (
            ": likely out of memory (the kernel's out-of-memory killer sends SIGKILL; `dmesg` or the system log "
            "says so when it did)"
        )
    return said


def _parent_store(world_size: int, timeout: float):
    """The rendezvous store, on a port the operating system picked and bound (held by the caller)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,  # the ranks and this process
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _worker(rank, world_size, port, timeout, backend, results, fn, args, environ, cwd):
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(
        environ
    )  # the caller's, also where the process was forked from a server started earlier
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )  # what accelerate sets on CPU, saying so in a warning when it has to
    torch.set_num_threads(1)
    if backend is None:
        backend = (
            "nccl"
            if torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            else "gloo"
        )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        wait = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=wait)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=wait
        )
        result = fn(rank, world_size, *args)
        try:  # the queue pickles in a background thread, where a failure would be silent (the parent would wait)
            ForkingPickler.dumps(result)
        except Exception as err:  # noqa: BLE001
            raise TypeError(
                f"rank {rank}'s result cannot be sent to the parent ({err}); return plain values "
                "(detached tensors, numbers)"
            ) from None
        results.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str | None = None,
    start_method: str = "spawn",
) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` new ranks; return the results ordered by rank.

    `fn` must be importable by the workers (a module-level function). Raises `DistributedFailure`.
    """
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    store = _parent_store(world_size, timeout)  # held until the ranks are done
    call = (results, fn, args, dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, store.port, timeout, backend, *call),
            daemon=True,
            name=f"hf_upipe-rank-{r}",
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    errors = ["the caller was interrupted"]
    try:
        out, errors, died = _collect(procs, results, timeout + 60)
    finally:
        _stop(procs, failed=bool(errors))
        del store  # the port is free again once every rank is gone
    if errors:
        raise DistributedFailure(
            "distributed worker failed:\n" + "\n".join(errors), ranks=_ranks_of(errors), died=died
        )
    return [out[r] for r in range(len(procs))]


def _collect(procs, results, limit: float):
    """(results by rank, error texts, rank -> exit code of the ranks that died): until every rank has reported, a
    rank failed and the others had their grace, or `limit` seconds passed."""
    start = time.monotonic()
    out, errors, died, ended = {}, [], {}, {}
    failed_at = None  # when the first failure was seen
    grace = 0.0
    while len(out) + len(errors) < len(procs):
        now = time.monotonic()
        waiting = sorted(set(range(len(procs))) - set(out) - _ranks_of(errors))
        if failed_at is not None and now > failed_at + grace:
            errors.append(f"stopped ranks {waiting}: still running {grace:.0f} s after the failure")
            break
        if now > start + limit:
            errors.append(f"timed out waiting for ranks {waiting}")
            break
        try:
            rank, ok, value = results.get(timeout=0.5)
        except queue.Empty:
            for r in waiting:
                if procs[r].exitcode is not None:
                    ended.setdefault(r, now)
                    if now - ended[r] > DEATH_GRACE_S:  # no report on its way: it died
                        died[r] = procs[r].exitcode
                        errors.append(f"--- rank {r} ---\nrank {r} {death_cause(died[r])}")
                        failed_at, grace = now, 0.0  # the others wait for it in a collective
            continue
        if ok:
            out[rank] = value
        else:
            errors.append(f"--- rank {rank} ---\n{value}")
            if failed_at is None:
                failed_at, grace = now, REPORT_GRACE_S
    return out, errors, died


def _ranks_of(errors) -> set[int]:
    return {int(e.split()[2]) for e in errors if e.startswith("--- rank ")}


def _stop(procs, failed: bool) -> None:
    """Join every rank; one still running after 10 s (at once when a rank failed) is terminated, then killed."""
    for p in procs:
        p.join(timeout=0.1 if failed else 10)
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
