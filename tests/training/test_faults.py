"""Faults that explain themselves: a rank killed inside a step, or out of memory in one (`hf_upipe.training.peers`,
`hf_upipe.training.oom`).

Each case starts its ranks as plain processes (`tests.training._fault_runs`), hosting their store here as a
launcher's agent does, and checks that every survivor exits within `UPIPE_PEER_TIMEOUT` (+ a few seconds),
with one line naming the rank that stopped and the checkpoint to resume from.
"""

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_TIMEOUT = 10.0


def _launch(mode: str, world: int, fault_rank: int, out, timeout: float = 240.0):
    """Run the ranks; (per-rank (exit code, stderr, seconds from the fault to the exit), wall seconds)."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "UPIPE_PEER_TIMEOUT": str(PEER_TIMEOUT),
        "UPIPE_OOM_PLAN_TIMEOUT": "0.01",  # the multi-rank case checks the exits, not the planner's advice
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": "1",
    }
    procs, ended, start = [], {}, time.monotonic()
    for rank in range(world):
        err = open(out / f"stderr_{rank}", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.training._fault_runs", mode, str(fault_rank), out],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=ROOT,
            )
        )
    while len(ended) < world and time.monotonic() - start < timeout:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    fault_at = float((out / "fault_at").read_text()) if (out / "fault_at").exists() else None
    result = []
    for rank, proc in enumerate(procs):
        seconds = ended[rank] - fault_at if rank in ended and fault_at else None
        result.append((proc.wait(), (out / f"stderr_{rank}").read_text(), seconds))
    del store
    return result, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("mode, world", [("a2a", 2), ("rs", 4), ("a2a", 4)])
def test_survivors_name_the_dead_rank_within_the_bounded_wait(tmp_path, mode, world):
    fault_rank = world - 1
    ranks, _ = _launch(mode, world, fault_rank, tmp_path)
    assert ranks[fault_rank][0] == -9, ranks[fault_rank]
    for rank, (code, stderr, seconds) in enumerate(ranks):
        if rank == fault_rank:
            continue
        lines = [line for line in stderr.splitlines() if line.startswith("error (rank")]
        assert code == 1, (rank, code, stderr[-2000:])
        assert lines == [
            f"error (rank {rank}): rank {fault_rank} stopped (no heartbeat for 3 s); resume from "
            f"{tmp_path / 'checkpoint-1'}"
        ] or (len(lines) == 1 and f"rank {fault_rank} stopped" in lines[0]), stderr[-2000:]
        assert f"resume from {tmp_path / 'checkpoint-1'}" in lines[0]
        assert seconds is not None and seconds < PEER_TIMEOUT + 5, (rank, seconds)
        print(
            f"{mode} world {world}: rank {rank} exited {seconds:.1f} s after the kill: {lines[0]}"
        )


@pytest.mark.slow
def test_out_of_memory_on_one_rank_is_raised_there_and_named_by_the_others(tmp_path):
    ranks, _ = _launch("oom", 2, 1, tmp_path)
    code, stderr, _ = ranks[1]
    assert (
        code == 1
        and "torch.OutOfMemoryError: hf_upipe: out of memory in a training step (64 tokens"
        in (stderr)
    ), stderr[-3000:]
    assert stderr.count("OutOfMemoryError: hf_upipe: out of memory") == 1, stderr[-3000:]
    code, stderr, seconds = ranks[0]
    lines = [line for line in stderr.splitlines() if line.startswith("error (rank")]
    assert code == 1 and len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("error (rank 0): rank 1 failed: OutOfMemoryError: out of memory"), (
        lines
    )
    assert seconds < PEER_TIMEOUT + 5, seconds
    print(lines[0], f"({seconds:.1f} s)")
