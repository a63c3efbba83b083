"""A rank that stopped, named: the surviving ranks of a launch exit within a bounded time with one line each.

When a rank dies inside a step (killed, crashed, out of host memory), the others wait for it in a collective. gloo
then fails at once with `Connection reset by peer` naming an address (and a survivor that exits makes the next
one fail the same way, naming the survivor), NCCL or an unresponsive peer wait for the process group's timeout
(30 minutes by default). Neither says which rank stopped. Here every rank beats a heartbeat counter in the launch's
key-value store, and watches its neighbour's (rank + 1); a rank that runs out of memory in a step, or fails to
write a checkpoint, posts its error there.

Entry points:
- `start_watch(world_size, resume_dir=None)`: start this process's watch (once; later calls only update
  `resume_dir`), when torch.distributed runs on a TCP store with more than one rank. Returns the watch or None.
- `guarded(runtime, model=None, inner=None)`: a context manager around a training step (`UPipeRuntime.step`).
  Inside it: a `torch.OutOfMemoryError` is posted for the others and replaced by
  `hf_upipe.training.oom.explain_oom`'s error (once); a collective that fails because a peer went away raises
  `PeerStopped`, whose message is the one line naming that peer (looked up for about three beats; the
  collective's own error when nothing is found).
- `post_failure(what)`: tell the other ranks this one failed outside a step (a checkpoint save).
- `saving()`: a context manager around a checkpoint save: a launcher's SIGTERM is held there as inside a step, so a
  rank waiting in the save's barrier for a rank whose save failed prints the line naming it.
- `posted_by_another()`: the `PeerStopped` naming a failure another rank posted, or None.
- `hold_for(seconds)`: a context manager around a rank's explanation of its own failure (the out-of-memory
  advice): a launcher's SIGTERM is held up to `seconds` from entry, so the explanation is printed.
- `named_peer(err)`: outside a step (a checkpoint save's barriers), the `PeerStopped` naming the rank whose loss
  made the collective fail with `err`, or `err` itself (not a lost peer, no watch, nothing found in time).
- `last_checkpoint(folder)`: the newest complete checkpoint under a run's folder.
- `peer_timeout()`: `UPIPE_PEER_TIMEOUT`, seconds (default 60).

The line: `error (rank 1): rank 0 stopped (no heartbeat for 3 s); resume from <checkpoint>` or `error (rank 1):
rank 0 failed: <its error's first line>; resume from <checkpoint>`. The watch thread itself prints it, records it
in the launcher's error file and ends the process (status 1) when a rank posted an error, or when, inside a step,
the neighbour's heartbeat has not moved for `UPIPE_PEER_TIMEOUT` seconds while no collective failed here (a hung
peer, NCCL). A rank that finished and exited normally is not waited for: it marks itself done. Under torchrun's
agent, which stops the other ranks with SIGTERM as soon as one dies, a SIGTERM inside a step or a checkpoint save
is held for up to `_HOLD_S` seconds so that the line still comes out (`_hold_launcher_stop`), and for up to the
`hold_for` bound while a rank explains its own failure.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from hf_upipe.agreement import env_seconds
from hf_upipe.exits import record_line

__all__ = [
    "PeerStopped",
    "guarded",
    "hold_for",
    "posted_by_another",
    "saving",
    "last_checkpoint",
    "named_peer",
    "peer_timeout",
    "post_failure",
    "start_watch",
]

_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
_PREFIX = f"hf_upipe/peers/{_ATTEMPT}"
_WATCH: dict = {}
_HOLD_S = (
    8.0  # how long a launcher's SIGTERM is held inside a step (its agent waits 30 s before SIGKILL)
)


def peer_timeout() -> float:
    """Seconds a silent peer is waited for inside a step (UPIPE_PEER_TIMEOUT, default 60)."""
    return env_seconds("UPIPE_PEER_TIMEOUT", 60.0)


def last_checkpoint(folder: str | None) -> str | None:
    """The newest complete checkpoint under `folder` (a subfolder with hf_upipe's manifest; the highest number
    in its name), or None."""
    if not folder or not os.path.isdir(folder):
        return None
    done = [
        d
        for d in os.listdir(folder)
        if not d.startswith(".") and os.path.isfile(os.path.join(folder, d, "upipe_manifest.json"))
    ]
    number = lambda d: int(m.group()) if (m := re.search(r"\d+$", d)) else -1  # noqa: E731
    return os.path.join(folder, max(done, key=number)) if done else None


def _client():
    """A client of its own to the default group's TCP store (the main thread's store calls may block), or None."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return dist.TCPStore(
        store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


class PeerStopped(RuntimeError):
    """A collective failed because another rank stopped; the message is the one line naming it. Under a launcher
    `hf_upipe.exits` prints just the line and exits with status 1."""

    upipe_line = True


class _Watch:
    """The heartbeat thread of one process (module docstring)."""

    def __init__(self, store, rank: int, world: int, timeout: float):
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.interval = min(1.0, timeout / 10)
        self.resume_dir: str | None = None
        self.inside = 0  # guarded regions this rank is in
        self.diagnosing = False  # the main thread names the peer (`diagnose`)
        self.hold_until: float | None = (
            None  # a SIGTERM is held until then (`hold_for`), at least _HOLD_S
        )
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its count, when it last moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_upipe-peers", daemon=True)
        atexit.register(self.close)
        self._thread.start()

    def check_often(self, seconds: float) -> None:
        """During a held SIGTERM: look for a failure another rank posted every tenth of a second (its line
        comes out at once rather than at the next beat)."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline and not self._stop.is_set():
                if not self.diagnosing and self.store.check([f"{_PREFIX}/failed"]):
                    failed = json.loads(self.store.get(f"{_PREFIX}/failed"))
                    if failed["rank"] != self.rank:
                        self._end(failed)
                time.sleep(0.1)

    def posted_by_another(self) -> PeerStopped | None:
        """The line naming another rank's posted failure, or None."""
        with contextlib.suppress(Exception):
            if self.store.check([f"{_PREFIX}/failed"]):
                failed = json.loads(self.store.get(f"{_PREFIX}/failed"))
                if failed["rank"] != self.rank:
                    self.done()
                    return PeerStopped(self._line(failed))
        return None

    def post(self, what: str) -> None:
        """Tell the other ranks this one failed (`what`: the error's type and first line)."""
        with contextlib.suppress(Exception):
            self._first(self.rank, f"failed: {what[:300]}")

    def _first(self, rank: int, what: str) -> dict:
        """The first cause posted (this one, unless another rank posted before): {"rank", "what"}."""
        line = json.dumps({"rank": rank, "what": what})
        return json.loads(self.store.compare_set(f"{_PREFIX}/failed", "", line))

    def done(self) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/done/{self.rank}", "1")

    def close(self) -> None:
        """At exit: mark this rank done and stop the heartbeat thread, joined before the interpreter finalizes (a
        thread left inside a store call then aborts the process: `terminate called without an active
        exception`, status -6, which the launcher reports as a failed rank)."""
        self.done()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{_PREFIX}/beat/{self.rank}", 1)
                self._check()
            except Exception:  # noqa: BLE001  (the store went away: the launcher is ending the run)
                return
            self._stop.wait(self.interval)

    def _check(self) -> None:
        if self.diagnosing:
            return
        if self.store.check([f"{_PREFIX}/failed"]):
            failed = json.loads(self.store.get(f"{_PREFIX}/failed"))
            if failed["rank"] != self.rank:
                self._end(failed)
        if self.inside:
            stale = self._stale([(self.rank + 1) % self.world], self.timeout)
            if stale is not None:
                self._end(stale)

    def _stale(self, peers, wait: float) -> dict | None:
        """The first cause posted, once one of `peers` has not beaten for `wait` seconds (and is not done)."""
        now = time.monotonic()
        for peer in (p for p in peers if p != self.rank):
            count = self.store.add(f"{_PREFIX}/beat/{peer}", 0)
            if self.seen.get(peer, (None,))[0] != count:
                self.seen[peer] = (count, now)
            elif now - self.seen[peer][1] > wait and not self.store.check(
                [f"{_PREFIX}/done/{peer}"]
            ):
                silent = now - self.seen[peer][1]
                return self._first(peer, f"stopped (no heartbeat for {silent:.0f} s)")
        return None

    def diagnose(self, err: BaseException) -> BaseException:
        """After a collective failed here: the `PeerStopped` naming the rank that stopped (or posted an error),
        found within about three beats; `err` itself when none is found in time."""
        self.diagnosing = True
        deadline = time.monotonic() + 3 * self.interval + 2.0
        with contextlib.suppress(Exception):
            while time.monotonic() < deadline:
                if self.store.check([f"{_PREFIX}/failed"]):
                    cause = json.loads(self.store.get(f"{_PREFIX}/failed"))
                else:
                    cause = self._stale(range(self.world), 3 * self.interval)
                if cause is not None and cause["rank"] != self.rank:
                    self.done()  # ending: the ranks still looking do not name this one
                    return PeerStopped(self._line(cause))
                time.sleep(self.interval / 2)
        self.diagnosing = False
        return err

    def _line(self, cause: dict) -> str:
        resume = last_checkpoint(self.resume_dir)
        where = (
            f"resume from {resume}"
            if resume
            else f"no checkpoint to resume from{f' in {self.resume_dir}' if self.resume_dir else ''}"
        )
        return f"error (rank {self.rank}): rank {cause['rank']} {cause['what']}; {where}"

    def _end(self, cause: dict) -> None:
        self.done()  # exiting now: the ranks still watching do not name this one
        line = self._line(cause)
        print(line, file=sys.__stderr__ or sys.stderr, flush=True)
        record_line(line)
        sys.stdout.flush()
        os._exit(1)


def start_watch(world_size: int, resume_dir: str | None = None):
    """See the module docstring."""
    if world_size < 2 or not dist.is_initialized():
        return None
    watch = _WATCH.get("watch")
    if watch is None:
        try:
            store = _client()
        except Exception:  # noqa: BLE001  (no reachable TCP store: nothing to watch with)
            store = None
        if store is None:
            return None
        watch = _WATCH["watch"] = _Watch(
            store, dist.get_rank(), dist.get_world_size(), peer_timeout()
        )
        _hold_launcher_stop(watch)
    watch.resume_dir = resume_dir or watch.resume_dir
    return watch


def _hold_launcher_stop(watch) -> None:
    """Under torchrun's agent (which stops the other ranks with SIGTERM as soon as one dies), a SIGTERM that
    arrives inside a step is held for up to `_HOLD_S` seconds, so that the rank can print its line naming the one
    that stopped; outside a step, or after that, the rank ends as SIGTERM would end it. A handler the script
    installed is kept."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        return

    def stop(signum, frame):
        if not watch.inside:
            os._exit(128 + signum)
        if watch.hold_until is not None:  # explaining an out-of-memory error: held until it is out
            limit = max(watch.hold_until - time.monotonic(), _HOLD_S)
        else:
            limit = _HOLD_S
        timer = threading.Timer(limit, lambda: os._exit(128 + signum))
        timer.daemon = True
        timer.start()
        threading.Thread(target=watch.check_often, args=(limit,), daemon=True).start()

    with contextlib.suppress(ValueError):  # (not the main thread)
        signal.signal(signal.SIGTERM, stop)


def post_failure(what: str) -> None:
    """Tell the other ranks this one failed (`what`: the error's type and first line), when a watch runs; they
    exit naming it."""
    watch = _WATCH.get("watch")
    if watch is not None:
        watch.post(what)


@contextlib.contextmanager
def saving():
    """Around a checkpoint save: a launcher's SIGTERM is held there as inside a step, so that a rank waiting in
    the save's barrier for a rank whose save failed prints the line naming it rather than ending silently."""
    watch = _WATCH.get("watch")
    if watch is not None:
        watch.inside += 1
    try:
        yield
    finally:
        if watch is not None:
            watch.inside -= 1


@contextlib.contextmanager
def hold_for(seconds: float):
    """Inside it (a rank explaining its own failure), a launcher's SIGTERM is held up to `seconds` from entry
    (at least `_HOLD_S`), so that the explanation is printed before the rank ends."""
    watch = _WATCH.get("watch")
    if watch is None:
        yield
        return
    watch.hold_until, watch.inside = time.monotonic() + seconds, watch.inside + 1
    try:
        yield
    finally:
        watch.hold_until, watch.inside = None, watch.inside - 1


def posted_by_another() -> PeerStopped | None:
    """The `PeerStopped` line naming a failure another rank posted, or None (none posted, no watch)."""
    watch = _WATCH.get("watch")
    return None if watch is None else watch.posted_by_another()


def named_peer(err: BaseException) -> BaseException:
    """See the module docstring."""
    watch = _WATCH.get("watch")
    if watch is None or not _lost_peer(err):
        return err
    return watch.diagnose(err)


def _lost_peer(err: BaseException) -> bool:
    """Whether a collective failed because a peer went away (gloo's and NCCL's words for it)."""
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        w in text for w in ("Connection reset", "Connection closed", "Broken pipe", "NCCL")
    )


@contextlib.contextmanager
def guarded(runtime, model=None, inner=None):
    """See the module docstring: `runtime` is the run's `UPipeRuntime` (`model`: for the out-of-memory advice);
    `inner`: a context manager entered inside the guard (the step's offload), or None."""
    watch = _WATCH.get("watch")
    if watch is not None:
        watch.inside += 1
    try:
        with inner if inner is not None else contextlib.nullcontext():
            yield
    except torch.OutOfMemoryError as err:
        if getattr(err, "upipe_explained", False):
            raise
        if watch is not None:  # at once: the others wait for this rank in a collective
            watch.post(
                "OutOfMemoryError: out of memory in a training step (its error says what fits)"
            )
        from hf_upipe.training.oom import explain_oom, hold_s

        with hold_for(hold_s()):  # a launcher's SIGTERM waits for the advice (bounded)
            explained = explain_oom(err, runtime, model, getattr(runtime, "seq_len", None))
        raise explained from None
    except Exception as err:
        if watch is None or not _lost_peer(err):
            raise
        found = watch.diagnose(err)
        if found is err:
            raise
        raise found from err
    finally:
        if watch is not None:
            watch.inside -= 1
