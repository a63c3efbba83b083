"""The CUDA caching allocator's mode in force: expandable segments arranged for the user before CUDA initialises.

Entry points:
- `ALLOCATOR_SETTINGS`: the values of `UPipeConfig.allocator` ("expandable", the default; "default"; "keep").
- `conf_mode(conf)`: the mode a `PYTORCH_CUDA_ALLOC_CONF` value selects ("expandable" or "default").
- `with_mode(conf, mode)`: a `PYTORCH_CUDA_ALLOC_CONF` value for `mode`, the other entries of `conf` kept.
- `launch_mode(setting=None)`: the mode a launch with this setting runs in (None: `UPIPE_ALLOCATOR`, else
  "expandable"); what the planner plans for and the plan's launch line sets.
- `arrange_allocator(setting)`: sets `PYTORCH_CUDA_ALLOC_CONF` for the setting while CUDA is not yet initialised;
  once it is, it leaves it and logs once which mode is in force and that the plan for that mode applies. Returns
  the mode in force. `UPipeTrainer` and `UPipePlugin` call it when they are built, `UPipeRuntime.setup` again.

Why: the allocator reads `PYTORCH_CUDA_ALLOC_CONF` once, when CUDA initialises, and with expandable segments its
reserve stays nearer the tensors at long sequences (`docs/planner.md`), so the planned fit is longer.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["ALLOCATOR_SETTINGS", "arrange_allocator", "conf_mode", "launch_mode", "with_mode"]

logger = logging.getLogger(__name__)

ALLOCATOR_SETTINGS = ("expandable", "default", "keep")
VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
_logged: set = set()  # the (setting, mode in force) pairs already logged in this process


def conf_mode(conf: str | None) -> str:
    """The allocator mode that a `PYTORCH_CUDA_ALLOC_CONF` value selects."""
    entries = (conf or "").replace(" ", "").lower().split(",")
    return "expandable" if "expandable_segments:true" in entries else "default"


def check_setting(setting: str) -> str:
    """The setting, lower-case, or ValueError naming the choices."""
    value = str(setting).lower()
    if value not in ALLOCATOR_SETTINGS:
        raise ValueError(
            f"allocator={setting!r}: use 'expandable' (expandable segments, the default: the longest fit), "
            "'default' (the allocator's default segments) or 'keep' (leave PYTORCH_CUDA_ALLOC_CONF as it is)."
        )
    return value


def launch_mode(setting: str | None = None) -> str:
    """The allocator mode a launch with `setting` (None: `UPIPE_ALLOCATOR`, else "expandable") runs in."""
    if setting is None:
        setting = os.environ.get("UPIPE_ALLOCATOR") or "expandable"
    value = check_setting(setting)
    return conf_mode(os.environ.get(VARIABLE)) if value == "keep" else value


def with_mode(conf: str | None, mode: str) -> str:
    """`conf` with its expandable_segments entry replaced by the one `mode` needs (other entries kept)."""
    kept = [
        e
        for e in (conf or "").split(",")
        if e.strip() and not e.strip().lower().startswith("expandable_segments")
    ]
    return ",".join([*kept, f"expandable_segments:{mode == 'expandable'}"])


def arrange_allocator(setting: str) -> str:
    """Put the allocator in the mode `setting` asks for, if CUDA allows it still; the mode in force (docstring)."""
    value = check_setting(setting)
    current = conf_mode(os.environ.get(VARIABLE))
    if value == "keep" or not torch.cuda.is_available():
        return current  # nothing to arrange: kept as it is, or no CUDA allocator on this machine
    if not torch.cuda.is_initialized():
        if current != value:
            os.environ[VARIABLE] = with_mode(os.environ.get(VARIABLE), value)
        return value
    if current != value and (value, current) not in _logged:
        _logged.add((value, current))
        logger.warning(
            "hf_upipe: CUDA was already initialised with the %s allocator (%s=%r), so allocator=%r (expandable "
            "segments %s) cannot take effect in this process: the plan for the %s allocator applies "
            "(`hf-upipe plan --allocator %s`). Set %s=%s before anything uses CUDA (the plan's launch line does), "
            "or UPIPE_ALLOCATOR=keep to silence this.",
            current,
            VARIABLE,
            os.environ.get(VARIABLE, ""),
            value,
            "on" if value == "expandable" else "off",
            current,
            current,
            VARIABLE,
            with_mode(os.environ.get(VARIABLE), value),
        )
    return current
