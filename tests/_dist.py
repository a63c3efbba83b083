"""Spawned gloo workers for distributed tests, with every rank's failure reported and no hangs.

`run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes joined
by a gloo process group (`dist.group.WORLD`), and returns the per-rank return values (plain picklable Python:
compute errors inside the worker, assert in the test). A rank that raises makes the call raise with that rank's
traceback; collectives time out after `timeout` seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, timeout, results, fn, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout, results, fn, args), daemon=True)
             for r in range(world_size)]
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
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
