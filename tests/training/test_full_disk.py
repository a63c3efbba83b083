"""A checkpoint save that runs out of space on a real full filesystem, under `torchrun` with 2 gloo ranks
(`hf_upipe.training.save_errors`, `hf_upipe.training.peers`).

Nothing is imitated: each case mounts a tmpfs (in a private mount namespace, `unshare -m`, so nothing outlives the
test) sized from an uninterrupted run's files so that the save of `checkpoint-2` fills it inside one chosen file:
`optimizer.pt` (torch.save's `inline_container` error), `model.safetensors` (safetensors' `os error 28`) or
`rng_state_0.pth` (a random-state file, torch.save again). The ranks are `tests.training._disk_runs` (a tiny
UPipeTrainer, sp_size 2, a checkpoint after every step). Each case checks:
- the failing rank's error names the file, the bytes the checkpoint needs (the size of `checkpoint-1`, measured
  here) and the free space (as `df` sees it after the run);
- no staging folder is left, and `checkpoint-1` is the only checkpoint;
- the other rank prints one line naming rank 0's failure and `checkpoint-1`, and exits with status 1 (not
  stopped by the launcher), the launch ending within 60 s of the fault's start;
- `checkpoint-1`, copied out of the tmpfs, verifies against its manifest and resumes to the same losses and the
  same final weights as the uninterrupted run.
The other rank's end is checked to within 5 s of the failed rank's, as the launcher's summary records them.

`test_each_writer_on_a_real_full_tmpfs_is_recognised_by_its_cause`: one process (`tests.training._full_writes`)
fills a 2 MiB tmpfs with torch.save, safetensors and a Python write, and `out_of_space` calls each a full disk;
torch.save failing with space left (a missing folder) is not. About 5 s.

Cost: 1 uninterrupted launch + 2 launches per case (the fault, the resume), 25-70 s each on 2 shared cores:
2.5-6 minutes for the three cases. Skipped, with the reason, where tmpfs cannot be mounted in a private namespace
(not root, no `unshare`).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = 4096


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, UPIPE_PEER_TIMEOUT="30")
    env.pop("UPIPE_TRACEBACK", None)
    return env


def _torchrun(out: str, steps: int, resume: str | None = None) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    return command + [
        "-m",
        "tests.training._disk_runs",
        out,
        str(steps),
        *([resume] if resume else []),
    ]


def _can_mount() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=64k tmpfs /mnt",
        ],
        capture_output=True,
        text=True,
    )
    return (
        None
        if probe.returncode == 0
        else f"cannot mount a tmpfs in a private namespace: {probe.stderr}"
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run without a fault: its result and the files of its `checkpoint-2` (name, size, mtime)."""
    why = _can_mount()
    if why:
        pytest.skip(why)
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    start = time.monotonic()
    proc = subprocess.run(
        _torchrun(out, 3), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    folder = os.path.join(out, "checkpoint-2")
    files = [
        (n, os.path.getsize(os.path.join(folder, n)), os.stat(os.path.join(folder, n)).st_mtime_ns)
        for n in os.listdir(folder)
    ]
    return result, files, time.monotonic() - start


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _tmpfs_size(files, target: str) -> int:
    """Room for `checkpoint-1` (the same files as `checkpoint-2`), for the files of `checkpoint-2` written before
    `target` and for half of `target`."""
    when = {name: mtime for name, _, mtime in files}
    size = {name: n for name, n, _ in files}
    before = [name for name in size if when[name] < when[target]]
    return (
        sum(_pages(n) for n in size.values())
        + sum(_pages(size[n]) for n in before)
        + _pages(size[target]) // 2
    )


def _run_in_tmpfs(size: int, tmp_path) -> tuple[int, str, float, str, int]:
    """The 3-step run on a tmpfs of `size` bytes: (launcher status, its output, seconds, the folder's listing
    after the run, its free bytes as `df` sees them); `tmp_path/kept/checkpoint-1` is a copy of the checkpoint."""
    mount, kept = tmp_path / "disk", tmp_path / "kept"
    mount.mkdir()
    kept.mkdir()
    out = f"{mount}/run"
    command = " ".join(_torchrun(out, 3))
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {mount} && {command}; code=$?; "
        f"ls -A {out} > {kept}/listing; df -B1 --output=avail {mount} | tail -1 > {kept}/free; "
        f"cp -a {out}/checkpoint-1 {kept}/ 2>/dev/null; exit $code"
    )
    start = time.monotonic()
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - start
    listing = (kept / "listing").read_text()
    return (
        proc.returncode,
        proc.stdout + proc.stderr,
        seconds,
        listing,
        int((kept / "free").read_text()),
    )


@pytest.mark.slow
@pytest.mark.parametrize("target", ["optimizer.pt", "model.safetensors", "rng_state_0.pth"])
def test_a_real_full_disk_in_a_save_is_explained_named_and_resumes_exactly(
    uninterrupted, tmp_path, target
):
    """Rank 0 writes the weights, the optimizer and its random state after rank 1 wrote its own random state;
    the random-state case sizes the disk for rank 0's file, and takes rank 1's as the file that failed when
    rank 1's write came last (the ranks' order is not fixed)."""
    from hf_upipe.training.checkpoint import verify_checkpoint

    result, files, wall = uninterrupted
    size = _tmpfs_size(files, target)
    code, console, seconds, listing, free = _run_in_tmpfs(size, tmp_path)
    out = f"{tmp_path}/disk/run"
    first = f"{out}/checkpoint-1"
    kept = tmp_path / "kept" / "checkpoint-1"
    needed = sum(p.stat().st_size for p in kept.iterdir())
    own = [
        line for line in console.splitlines() if re.match(r"error \(rank \d\): Checkpoint", line)
    ]
    frames = re.findall(r'File "([^"]+)"', console)  # only the launcher's own traceback, no rank's
    assert len(own) == 1 and not [f for f in frames if f.startswith(ROOT)], console[-4000:]
    error, failed = own[0], int(own[0][len("error (rank ")])
    other = 1 - failed
    name = f"rng_state_{failed}.pth" if target.startswith("rng_state") else target
    assert failed == 0 or name != target, error
    assert error.startswith(
        f"error (rank {failed}): CheckpointSaveError: [Errno 28] Saving a checkpoint failed writing "
        f"{out}/.staging-checkpoint-2/checkpoint-2/{name} (the disk is full; "
    ), error
    assert (
        f"The checkpoint needs about {needed / 2**30:.3f} GiB ({needed} bytes, the size of {first})"
        in error
    )
    assert (
        f"free on that disk: {free / 2**30:.3f} GiB ({free} bytes) once the half-written save"
        in error
    ), (free, error)
    assert f"{first} is intact: resume from it" in error, error
    assert listing.split() == ["checkpoint-1"], listing  # no staging folder, no half checkpoint-2
    lines = [line for line in console.splitlines() if line.startswith(f"error (rank {other})")]
    assert len(lines) == 1, console[-4000:]
    assert lines[0].startswith(
        f"error (rank {other}): rank {failed} failed: CheckpointSaveError: [Errno 28] Saving a checkpoint "
        f"failed writing {out}/.staging-checkpoint-2/checkpoint-2/{name} (the disk is full; "
    ), lines
    assert lines[0].endswith(f"; resume from {first}"), lines[0]
    statuses = re.findall(r"^\s+exitcode\s+: (-?\d+)", console, re.M)
    # each rank ended itself (none stopped by the launcher), promptly: no wait for a timeout
    assert sorted(statuses) == ["1", "1"], console[-4000:]
    # the launcher's record of each rank's end (to the second): the other rank ended within 5 s of the failed one
    ends = [
        time.mktime(time.strptime(t, "%Y-%m-%d_%H:%M:%S"))
        for t in re.findall(r"time\s+: (\S+)", console)
    ]
    assert len(ends) == 2 and max(ends) - min(ends) <= 5, console[-4000:]
    assert code == 1 and seconds < wall + 60, (code, seconds, wall)
    verify_checkpoint(str(kept))
    resumed = tmp_path / "resumed"
    proc = subprocess.run(
        _torchrun(str(resumed), 3, str(kept)),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    again = json.loads((resumed / "result.json").read_text())
    assert again["weights"] == result["weights"], (again, result)
    assert {s: again["losses"][s] for s in ("2", "3")} == {
        s: result["losses"][s] for s in ("2", "3")
    }
    print(f"{target}: tmpfs {size} bytes, launch {seconds:.1f} s (uninterrupted {wall:.1f} s)")
    print(f"{error}\n{lines[0]}")


def test_each_writer_on_a_real_full_tmpfs_is_recognised_by_its_cause(tmp_path):
    why = _can_mount()
    if why:
        pytest.skip(why)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"mount -t tmpfs -o size=2m tmpfs {disk} && {sys.executable} -m tests.training._full_writes {disk}"
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "torch.save": [
            "RuntimeError",
            True,
        ],  # inline_container's "unexpected pos": no errno, no space left
        "safetensors": ["SafetensorError", True],  # "(os error 28)"
        "python write": ["OSError", True],  # ENOSPC
        "torch.save, no folder": [
            "RuntimeError",
            False,
        ],  # space left: a write error, not a full disk
    }, seen
