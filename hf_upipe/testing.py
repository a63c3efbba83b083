"""Spawned process groups for checks that need several ranks on one machine: the one harness the self-test and the
test suite share.

Entry point:
- `run_distributed(fn, world_size, *args, timeout=120.0, backend=None, start_method="spawn")`: runs
  `fn(rank, world_size, *args)` in `world_size` fresh processes joined by one process group (gloo on CPU; NCCL when
  there is a GPU per rank, or `backend`), and returns the per-rank return values, ordered by rank (plain picklable
  Python: compute errors inside the worker, judge them in the caller). A rank that raises makes the call raise
  `DistributedFailure` with that rank's traceback; collectives time out after `timeout` seconds, and the call gives
  up `timeout` + 60 s after the start, instead of hanging. Each worker runs torch with one thread (ranks share the
  machine's cores), in the caller's environment variables and working directory.

`start_method="forkserver"` (what the test suite uses, with torch and transformers preloaded in the server) forks
every worker from one clean server process that imported the heavy modules once, instead of starting a Python
that imports them again for each rank of each call; the workers are still fresh processes.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from multiprocessing.reduction import ForkingPickler

__all__ = ["DistributedFailure", "run_distributed"]


class DistributedFailure(AssertionError):
    """A spawned rank raised (its traceback is in the message) or did not answer in time."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
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
    port = _free_port()
    call = (results, fn, args, dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, timeout, backend, *call), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout + 60)
            (out.__setitem__(rank, value) if ok else errors.append(f"--- rank {rank} ---\n{value}"))
    except queue.Empty:
        errors.append(f"timed out waiting for ranks {sorted(set(range(world_size)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    if errors:
        raise DistributedFailure("distributed worker failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
