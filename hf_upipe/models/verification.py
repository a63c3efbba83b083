"""Adapters verified by what they compute, not by the text of one transformers release.

Entry points:
- `verify(adapter, subject, fingerprint, known, check)`: the `Verdict` on one adapter of one subject (an
  architecture, a mixer class, transformers' RoPE helper): verified by fingerprint when the installed source's
  fingerprint is one of the releases verified (`known`), else by behaviour: `check()` compares the adapter with
  the module's own forward and backward on a tiny model on CPU and returns None (equal) or what differed.
- `Verdict`: ok, how ("fingerprint", "behaviour" or "failed") and the detail.
- `verdicts()`: every verdict reached in this process, for `hf-upipe env` and `prepare_model`'s agreement.
- `fingerprint(*objects)`: SHA-256 (16 hex digits) of the objects' source; `underlying(obj)`: the function a
  decorator or a callable wrapper object runs.
- `cache_file()`: where verdicts by behaviour are kept across processes.
- `installed_release()` ("5.24"), `installed_version()` ("5.24.0"): the installed transformers.

A verdict by behaviour is reached once per (adapter, subject, source fingerprint): cached per process and on disk
(`$HF_UPIPE_CACHE_DIR/verified.json`, default `~/.cache/hf_upipe`), keyed also by the transformers, torch and
hf_upipe versions. The check is deterministic (fixed seeds, fp32 on CPU, one thread), so every rank of an SP group
reaches the same verdict without communicating; `prepare_model`'s bounded agreement compares them anyway. A pass
logs one info line; a failure keeps the registered path, with one warning per subject naming what differed and
the fix (the releases verified, and the pin to install).

This module imports nothing of transformers at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = [
    "TESTED_RANGE",
    "VERIFIED_RELEASES",
    "Verdict",
    "cache_file",
    "fingerprint",
    "installed_release",
    "installed_version",
    "underlying",
    "verdicts",
    "verify",
]

logger = logging.getLogger(__name__)

VERIFIED_RELEASES = (
    "5.23",
    "5.24",
    "5.25",
)  # transformers releases whose fingerprints the registry records
TESTED_RANGE = (
    "transformers>=5.23,<5.26"  # what CI tests (pyproject.toml), the pin a failed check names
)


@dataclass(frozen=True)
class Verdict:
    """ok: the adapter may be installed; how: "fingerprint" (a verified release's source), "behaviour" (checked on
    the installed source, also where the source could not be read whole) or "failed" (checked, and it differs or
    raised: a class that is gone fails its check); detail: what differed."""

    ok: bool
    how: str
    detail: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        if self.how == "fingerprint":
            return f"verified by fingerprint (transformers {', '.join(VERIFIED_RELEASES)})"
        if self.how == "behaviour":
            return f"verified by behaviour on transformers {_versions()['transformers']}"
        return f"not verified: {self.detail}"


_PROCESS: dict[tuple[str, str, str], Verdict] = {}
# the source key of a verdict whose source could not be read whole
UNREADABLE = "unreadable"
_WARNED: set[tuple[str, str]] = set()


def fingerprint(*objects) -> str:
    """SHA-256 (16 hex digits) of the source of `objects` (functions, classes, methods, or callables that wrap one:
    `underlying`), in order."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(underlying(obj)).encode())
    return digest.hexdigest()[:16]


def underlying(obj):
    """The function or class whose source `obj` runs: `obj` itself, what `functools.wraps` decorators wrap, or the
    function a callable wrapper object closes over (a Hub-kernel `Func` module, for instance, calls the function it
    was made from unless a kernel replaced it). Raises TypeError when there is none to read."""
    obj = inspect.unwrap(obj)
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return obj
    name = getattr(obj, "__name__", None)
    for method in ("forward", "__call__"):
        closure = getattr(getattr(type(obj), method, None), "__closure__", None) or ()
        functions = [c.cell_contents for c in closure if inspect.isfunction(c.cell_contents)]
        named = [f for f in functions if name is None or f.__name__ == name]
        if len(named) == 1 or len(functions) == 1:
            return (named or functions)[0]
    raise TypeError(f"{type(obj).__name__} wraps no single function whose source can be read")


def verdicts() -> dict[tuple[str, str], Verdict]:
    """(adapter, subject) -> the verdict reached in this process."""
    return {(adapter, subject): v for (adapter, subject, _), v in sorted(_PROCESS.items())}


def cache_file() -> str:
    folder = os.environ.get("HF_UPIPE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hf_upipe"
    )
    return os.path.join(folder, "verified.json")


def installed_release() -> str:
    """The installed transformers' release, major.minor ("5.24"), or "none"."""
    return ".".join(installed_version().split(".")[:2])


def installed_version() -> str:
    """The installed transformers' version ("5.24.0"), or "none"."""
    return _versions()["transformers"]


def _versions() -> dict[str, str]:
    import importlib.metadata as metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"

    return {
        "transformers": version("transformers"),
        "torch": torch.__version__,
        "hf_upipe": version("hf_upipe"),
    }


def _disk_key(adapter: str, subject: str, source: str) -> str:
    v = _versions()
    return f"{adapter}|{subject}|{source}|transformers={v['transformers']}|torch={v['torch']}|hf_upipe={v['hf_upipe']}"


def _read_disk() -> dict:
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_disk(key: str, verdict: Verdict) -> None:
    """Add one verdict to the file (atomically: ranks writing at once each leave a whole file)."""
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read_disk()
        data[key] = {"ok": verdict.ok, "detail": verdict.detail}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: the verdict is still cached in this process
        logger.debug("hf_upipe: could not write %s (%s)", path, err)


@contextlib.contextmanager
def _deterministic():
    """One thread, real fp32 CPU tensors, fixed seeds, grad on, transformers' warnings off, the caller's random state
    restored: the same result on every rank."""
    threads, quiet, dtype = (
        torch.get_num_threads(),
        logging.getLogger("transformers"),
        torch.get_default_dtype(),
    )
    level = quiet.level
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    quiet.setLevel(logging.ERROR)  # the tiny configs' own warnings are not the user's
    try:
        # real tensors on CPU, also when the caller simulates (the planner's fake tensors) or sets a default device
        with (
            unset_fake_temporarily(),
            torch.device("cpu"),
            torch.random.fork_rng(devices=[]),
            torch.enable_grad(),
        ):
            torch.manual_seed(0)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        quiet.setLevel(level)


def _run_check(check: Callable[[], str | None]) -> tuple[bool, str]:
    try:
        with _deterministic():
            detail = check()
    except Exception as err:  # noqa: BLE001 - any failure of the adapter on the new source is a failed check
        return (
            False,
            f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300],
        )
    return detail is None, detail or ""


def verify(
    adapter: str,
    subject: str,
    source: str | None,
    known: tuple[str, ...],
    check: Callable[[], str | None],
) -> Verdict:
    """The verdict on `adapter` ("fused", "tiled", "mixer", "rope") for `subject` (module docstring).

    Args:
        source: the installed source's fingerprint; None when some of it could not be read (a class or helper moved
            to another module, renamed or wrapped): then the check decides, as for a source not seen before.
        known: the fingerprints of the releases verified.
        check: runs the adapter against the module's own code; None when equal, else what differed.
    """
    if source is not None and source in known:
        _PROCESS[(adapter, subject, source)] = Verdict(True, "fingerprint")
        return _PROCESS[(adapter, subject, source)]
    # a source not seen before, or one that cannot be read (a helper moved, renamed or wrapped): the check decides
    source = source or UNREADABLE
    key = (adapter, subject, source)
    if key in _PROCESS:
        return _PROCESS[key]
    disk = _read_disk().get(_disk_key(adapter, subject, source))
    if isinstance(disk, dict) and isinstance(disk.get("ok"), bool):
        verdict = Verdict(
            disk["ok"], "behaviour" if disk["ok"] else "failed", str(disk.get("detail", ""))
        )
    else:
        start = time.perf_counter()
        ok, detail = _run_check(check)
        verdict = Verdict(ok, "behaviour" if ok else "failed", detail, time.perf_counter() - start)
        _write_disk(_disk_key(adapter, subject, source), verdict)
    _PROCESS[key] = verdict
    _announce(adapter, subject, verdict)
    return verdict


def _announce(adapter: str, subject: str, verdict: Verdict) -> None:
    version = _versions()["transformers"]
    if verdict.ok:
        logger.info(
            "hf_upipe: the %s adapter of %s verified by behaviour on transformers %s (a source not seen "
            "before; %.2f s, cached)",
            adapter,
            subject,
            version,
            verdict.seconds,
        )
        return
    if (adapter, subject) in _WARNED:
        return
    _WARNED.add((adapter, subject))
    fallback = _FALLBACK.get(adapter, "it is not used")
    logger.warning(
        "hf_upipe: the %s adapter of %s is not used with transformers %s (%s): %s. The adapter is verified "
        "on transformers %s: pip install '%s'.",
        adapter,
        subject,
        version,
        verdict.detail,
        fallback,
        ", ".join(VERIFIED_RELEASES),
        TESTED_RANGE,
    )


# what a model gets when an adapter fails its check
_FALLBACK = {
    "fused": "the model keeps transformers' own path, exact but without this adapter's savings",
    "tiled": "the model keeps transformers' own path, exact but without this adapter's savings",
    "mixer": "models with this mixer are refused under sequence parallelism (without it they run as before)",
    "rope": "models with length-dependent RoPE are refused under sequence parallelism (without it they run "
    "as before)",
}
