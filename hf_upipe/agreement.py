"""Checks that every rank enters, with a bounded wait: a rank that took another path makes the others fail with a
message instead of hanging for the process group's 30 minutes.

Entry points:
- `validation_group()`: a gloo group over all ranks whose collectives give up after `validation_timeout()` seconds
  (`UPIPE_VALIDATION_TIMEOUT`, default 60); `validation_failed(err, what)`: the error when one times out.
- `agree_on_settings(settings)`: every rank asked `init_sequence_parallel` for the same settings and has the same
  UPIPE_* variables (`upipe_environment()`, all but the per-rank `hf_upipe.config.PER_RANK_SETTINGS`), or the
  same ValueError everywhere; `settings_disagreement(every)`: that error from every rank's `agreed_settings`
  (what `hf_upipe.training.runtime.agree_on_launch` shares in the launch's one agreement instead).
- `simulated()`: whether the default group is a simulated (fake) one, where the agreement is skipped.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch.distributed as dist

__all__ = [
    "agree_on_settings",
    "agreed_settings",
    "settings_disagreement",
    "simulated",
    "upipe_environment",
    "validation_failed",
    "validation_group",
    "validation_timeout",
]

_VALIDATION: dict = {}  # (world, timeout) -> the world's validation group


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name` (`default` when unset)."""
    value = os.environ.get(name, "").strip()
    try:
        seconds = float(value) if value else default
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


def validation_timeout() -> float:
    """Seconds a validation collective waits for the other ranks (UPIPE_VALIDATION_TIMEOUT, default 60)."""
    return env_seconds("UPIPE_VALIDATION_TIMEOUT", 60.0)


def simulated() -> bool:
    """Whether the default process group is a simulated one (`hf_upipe.planning.simulated_world`: the "fake"
    backend, whose collectives carry no data, so agreement checks are skipped)."""
    return "fake" in str(dist.get_backend())


def validation_group():
    """The world's validation group (module docstring); every rank must reach its first use at the same point."""
    key = (dist.get_world_size(), validation_timeout())
    if key not in _VALIDATION:
        _VALIDATION[key] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=key[1])
        )
    return _VALIDATION[key]


def validation_failed(err: Exception, what: str) -> RuntimeError:
    """The error for a validation collective that timed out or lost a peer, with the likely cause."""
    return RuntimeError(
        f"hf_upipe: the other ranks did not reach {what} within {validation_timeout():.0f} s "
        f"({type(err).__name__}: {str(err)[:200]}). Every rank must run the same code up to there: did a rank skip "
        "init_sequence_parallel or the model call, use other settings, or fail earlier? (UPIPE_VALIDATION_TIMEOUT "
        "sets the wait.)"
    )


def upipe_environment() -> tuple:
    """((name, value or None, as shown), ...): this process's UPIPE_<SETTING> variables that every rank must share
    (those of every `UPipeConfig` field but the per-rank ones), which `prepare_model` and the Trainer read."""
    from dataclasses import fields

    from hf_upipe.config import (
        PER_RANK_SETTINGS,
        UPipeConfig,
    )  # local: keeps this module importable alone

    names = [
        f"UPIPE_{f.name.upper()}" for f in fields(UPipeConfig) if f.name not in PER_RANK_SETTINGS
    ]
    values = [os.environ.get(name) for name in names]
    return tuple((name, v, "unset" if v is None else repr(v)) for name, v in zip(names, values))


def agreed_settings(settings: tuple) -> tuple:
    """What a rank shares for `agree_on_settings`: the settings it asked for and its UPIPE_* environment."""
    return (settings, upipe_environment())


def settings_disagreement(every: list[tuple]) -> ValueError | None:
    """The error for every rank's `agreed_settings` that differ (the environment first), or None."""
    from hf_upipe.config import settings_that_differ  # local: keeps this module importable alone

    differ = settings_that_differ([env for _, env in every])
    every = [s for s, _ in every]
    if differ:
        return ValueError(
            f"The ranks have different UPIPE_* settings in their environment ({'; '.join(differ)}): "
            "export the same ones on every node (different settings pair different collectives, "
            "which hangs or corrupts the run)."
        )
    if len(set(every)) > 1:
        names = ("sp_size", "heads_per_chunk", "kernel", "allow_unverified", "ring_size")
        lines = "; ".join(
            f"rank {r}: " + ", ".join(f"{n}={v!r}" for n, v in zip(names, s))
            for r, s in enumerate(every)
        )
        return ValueError(
            f"The ranks asked init_sequence_parallel for different settings ({lines}): every rank must "
            "use the same ones (the same UPIPE_* variables, the same script)."
        )
    return None


def agree_on_settings(settings: tuple) -> None:
    """Every rank asked for the same settings and has the same UPIPE_* settings in its environment, or the same
    ValueError everywhere (bounded wait)."""
    if dist.get_world_size() == 1 or simulated():
        return
    every = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, agreed_settings(settings), group=validation_group())
    except (RuntimeError, dist.DistError) as err:
        raise validation_failed(err, "init_sequence_parallel") from None
    error = settings_disagreement(every)
    if error is not None:
        raise error


@atexit.register
def _release_groups() -> None:
    """Drop the validation groups while the interpreter is still whole (see `hf_upipe.distributed`)."""
    _VALIDATION.clear()
