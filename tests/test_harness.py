"""The multi-process harness (`hf_upipe.tools.testing.run_distributed`): a rank that dies or raises ends the call
within a
bounded wait, naming the rank and the cause, instead of after the collectives' timeout; the rendezvous port is
bound by the caller (no free-port race)."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from hf_upipe.tools.testing import DistributedFailure, death_cause
from tests._dist import run_distributed


def _sum_of_ranks(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def _one_rank_dies(rank, world, how):
    if rank == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            os._exit(3)
        raise RuntimeError("rank 1's own error")
    dist.barrier()  # waits for rank 1 forever (up to the collectives' timeout)
    return "unreachable"


def test_death_cause_names_the_signal_and_out_of_memory():
    assert death_cause(-9).startswith("killed by signal 9 (SIGKILL): likely out of memory")
    assert death_cause(-15) == "killed by signal 15 (SIGTERM)"
    assert death_cause(1) == "exited with status 1 before reporting a result"


@pytest.mark.slow
def test_two_calls_at_once_each_get_their_own_rendezvous():
    """Three groups started at the same time from three threads (each binds its own store port): every one sums
    its own ranks."""
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(run_distributed, _sum_of_ranks, w) for w in (2, 3, 2)]
        assert [r.result() for r in runs] == [[3.0] * 2, [6.0] * 3, [3.0] * 2]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "exit", "raise"])
def test_a_rank_that_dies_ends_the_call_quickly_naming_it(how):
    """Rank 1 dies (SIGKILL, as the out-of-memory killer does; an exit; an exception) while rank 0 waits for it in
    a collective whose timeout is 10 minutes: the call ends within seconds, naming rank 1 and the cause."""
    start = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_one_rank_dies, 2, how, timeout=600)
    took = time.monotonic() - start
    err = info.value
    assert took < 60, took
    assert 1 in err.ranks and "--- rank 1 ---" in str(err)
    if how == "sigkill":
        assert err.died == {1: -9} and "killed by signal 9 (SIGKILL): likely out of memory" in str(
            err
        )
    elif how == "exit":
        assert err.died == {1: 3} and "rank 1 exited with status 3 before reporting" in str(err)
    else:
        assert err.died == {} and "RuntimeError: rank 1's own error" in str(err)
    # the waiting rank is stopped, or reports gloo's own error on the closed connection, and never waits 10 minutes
    assert "stopped ranks [0]" in str(err) or "--- rank 0 ---" in str(err)
