"""Process groups for sequence parallelism: the only module that creates them.

Entry points:
- `init_sequence_parallel(sp_size=None, *, ring_size=1, heads_per_chunk=1, group=None, kernel="auto")`: after
  `torch.distributed` is up (torchrun, `accelerate launch`), build contiguous sequence-parallel (SP) groups of
  `sp_size` ranks, data parallel (DP) across groups, and install them as the defaults the registered
  `attn_implementation="upipe"` uses. Returns a `SequenceParallelState`. With `ring_size` R > 1 each SP group is
  U x R ranks: UPipe's all-to-alls over U contiguous ranks (a node), ring attention over R (`hf_upipe.ops.ring`).
- `get_sequence_parallel_state()`: the installed defaults, or `None` when SP was never initialised (then "upipe"
  is exact local attention).
- `reset_sequence_parallel()`: forget the defaults (tests, notebooks).
- `set_sequence_parallel_state(state)`: install a state (or None) directly and return the previous one, e.g. to
  restore it after a temporary change; `without_sequence_parallel()`: a context without any state, to run a model
  on whole sequences in an SP process.
- `on_state_change(listener)`: be told of every state change. While a state of sp_size > 1 is installed,
  `hf_upipe.adapters.hooks` (a listener) refuses a transformers model called without `prepare_model` whose
  attention is not "upipe" or that has token mixers (each rank would mix its shard alone); installing a state
  imports that module first, so the hooks listen whatever was imported before.
- `validation_group()` (with `validation_timeout`, `validation_failed`, `simulated`: `hf_upipe.agreement`, re-exported
  here): a gloo group over all ranks whose collectives give up after `validation_timeout()` seconds
  (`UPIPE_VALIDATION_TIMEOUT`, default 60): the checks that every rank enters (settings agreement, the runtime's
  shared errors) use it, so a rank that took another path makes the others fail with a message, not hang for the
  process group's 30 minutes. Each SP group has such a twin (`SequenceParallelState.check_group`) for the layout
  check of the attention.

Agreement: `init_sequence_parallel` compares every rank's settings (sp_size, heads_per_chunk, kernel,
allow_unverified, ring_size) and the UPIPE_* variables of its environment that `prepare_model` and the Trainer read
(all but the per-rank `hf_upipe.config.PER_RANK_SETTINGS`) over the validation group, and raises the same error
everywhere when they differ (unless `agreed=True`: `UPipeRuntime.setup` shares them in the launch's one
agreement, `agreed_settings` / `settings_disagreement`). Calling it again with the same settings returns the
installed state; with other settings it raises until `reset_sequence_parallel()`. `simulated()`: whether the
default group is a simulated (fake) one, where the agreement checks are skipped.

Layout: with world size W and `sp_size` P, SP group g holds ranks [g*P, (g+1)*P) (neighbours share a node, where
the all-to-alls are fast) and DP group i holds ranks {i, i+P, i+2P, ...}. Every rank of one SP group works on
the same sample; different SP groups get different samples. With `ring_size` R (U = sp_size / R), inside SP
group g the Ulysses group j holds ranks g*P + j*U + [0, U) and ring group u the ranks g*P + u + U*[0, R): SP rank
r = j*U + u holds part u of ring shard j (`hf_upipe.ops.ring.ring_positions`). The layout is the pure function
`hf_upipe.rank_layout.rank_layout` (tested without processes); this module creates its process groups.

The defaults are a convenience for transformers' attention interface, which gives no way to pass a process group
through a model call. Every op in `hf_upipe.ops` takes its group explicitly.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import logging
from dataclasses import dataclass

import torch.distributed as dist

from hf_upipe.agreement import (
    agree_on_settings,
    agreed_settings,
    settings_disagreement,
    simulated,
    validation_failed,
    validation_group,
    validation_timeout,
)
from hf_upipe.rank_layout import RankLayout, rank_layout

logger = logging.getLogger(__name__)

__all__ = [
    "SequenceParallelState",
    "agreed_settings",
    "check_type",
    "validation_failed",
    "validation_group",
    "validation_timeout",
    "init_sequence_parallel",
    "get_sequence_parallel_state",
    "reset_sequence_parallel",
    "set_sequence_parallel_state",
    "settings_disagreement",
    "on_state_change",
    "simulated",
    "without_sequence_parallel",
]


@dataclass(frozen=True)
class SequenceParallelState:
    """The sequence-parallel setup of this rank.

    Attributes:
        sp_group: process group of the ranks that share one sequence (None: no SP, size 1).
        sp_size: ranks in `sp_group`.
        sp_rank: this rank's index in `sp_group`; it owns sequence shard `sp_rank`.
        dp_group: process group of the ranks with the same `sp_rank` in other SP groups (None if one SP group).
        dp_size: number of SP groups (data-parallel replicas).
        dp_rank: index of this rank's SP group.
        heads_per_chunk: query heads per rank per UPipe stage; None puts all local heads in one chunk, which is
            plain DeepSpeed-Ulysses done by the same code.
        kernel: inner attention kernel name ("auto", "sdpa", "flash_attn", ...), see `hf_upipe.ops.kernels`.
        allow_unverified: run model types hf_upipe has not verified under SP (after `hf-upipe selftest` on them).
        check_group: a gloo twin of `sp_group` with a short timeout, for validation collectives (None: use sp_group).
        ring_size: R, the ring across the SP group (1: none); `ulysses_group` (its U = sp_size / R ranks that
            all-to-all heads) and `ring_group` (the R ranks with this rank's place in the other ring shards).
    """

    sp_group: dist.ProcessGroup | None
    sp_size: int
    sp_rank: int
    dp_group: dist.ProcessGroup | None
    dp_size: int
    dp_rank: int
    heads_per_chunk: int | None = 1
    kernel: str = "auto"
    allow_unverified: bool = False
    check_group: dist.ProcessGroup | None = None
    ring_size: int = 1
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None

    def settings(self) -> tuple:
        return (
            self.sp_size,
            self.heads_per_chunk,
            self.kernel,
            self.allow_unverified,
            self.ring_size,
        )

    @property
    def attention_group(self) -> dist.ProcessGroup | None:
        """The group UPipe's all-to-alls run over: the Ulysses group with a ring, else the SP group."""
        return self.ulysses_group if self.ring_size > 1 else self.sp_group


_STATE: SequenceParallelState | None = None
_LISTENERS: list = []  # called with the new state whenever it changes (`on_state_change`)


def _check_heads_per_chunk(heads_per_chunk: int | None) -> None:
    check_type(
        "heads_per_chunk",
        heads_per_chunk,
        "a positive integer (1 = least memory), or None for all local "
        "heads in one chunk (plain Ulysses)",
    )
    if heads_per_chunk is not None and heads_per_chunk < 1:
        raise ValueError(
            f"heads_per_chunk={heads_per_chunk!r} is invalid: use a positive integer (1 = least memory), "
            "or None for all local heads in one chunk (plain Ulysses)."
        )


def check_type(name: str, value, want: str, kind: type = int, none: bool = True) -> None:
    """A ValueError naming `name`, the type it got and what to pass, for a value not of `kind` (bool is not an int
    here), or None where `none` allows it."""
    if (value is None and none) or (
        isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    ):
        return
    hint = ""
    if kind is int and isinstance(value, str) and value.strip().isdigit():
        hint = f" ({name}={int(value)}, not the string {value!r})"
    elif kind is int and isinstance(value, float) and value.is_integer():
        hint = f" ({name}={int(value)})"
    got = type(value).__name__
    raise ValueError(
        f"{name}={value!r} is {'an' if got[0] in 'aeiou' else 'a'} {got}: pass {want}{hint}."
    )


def _create_groups(layout: RankLayout, rank: int) -> dict:
    """The process groups of `layout` that `rank` belongs to, by kind ("sp", "check": the SP group's gloo twin
    for validation, "ulysses", "ring", "dp"; None for a kind not built). Every rank creates every group, in the
    same order, as `dist.new_group` requires: the SP groups (each with its twin), then SP group by SP group its
    Ulysses groups and its ring groups, then the DP groups."""
    mine = dict.fromkeys(("sp", "check", "ulysses", "ring", "dp"))
    fake = simulated()
    timeout = datetime.timedelta(seconds=validation_timeout())
    whole = layout.sp_size == layout.world
    for sp_ranks in layout.sp_groups:
        pg = dist.new_group(list(sp_ranks)) if not whole else dist.group.WORLD
        twin = None if fake else dist.new_group(list(sp_ranks), backend="gloo", timeout=timeout)
        if rank in sp_ranks:
            mine["sp"], mine["check"] = pg, twin
    for sp_ranks in layout.sp_groups:
        for kind in ("ulysses", "ring"):
            for ranks in getattr(layout, f"{kind}_groups"):
                if ranks[0] in sp_ranks:  # this SP group's
                    pg = dist.new_group(list(ranks))
                    mine[kind] = pg if rank in ranks else mine[kind]
    for ranks in layout.dp_groups:
        pg = dist.new_group(list(ranks)) if layout.dp_size < layout.world else dist.group.WORLD
        mine["dp"] = pg if rank in ranks else mine["dp"]
    return mine


def _check_arguments(sp_size, ring_size, heads_per_chunk, kernel, allow_unverified) -> None:
    """The argument types of `init_sequence_parallel`, the kernel name, and that torch.distributed is up."""
    from hf_upipe.ops.kernels import (
        check_kernel_name,
    )  # local: keeps distributed.py importable alone

    check_type("sp_size", sp_size, "an int that divides the world size, or None for all ranks")
    check_type("ring_size", ring_size, "a positive int (1: no ring)", none=False)
    check_type("kernel", kernel, "a kernel name such as 'auto' or 'sdpa'", kind=str, none=False)
    check_type("allow_unverified", allow_unverified, "True or False", kind=bool, none=False)
    _check_heads_per_chunk(heads_per_chunk)
    check_kernel_name(kernel)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_sequence_parallel() needs torch.distributed: launch with torchrun or `accelerate launch`, "
            "or call torch.distributed.init_process_group() first."
        )


def _given_group_state(
    group, rank, sp_size, heads_per_chunk, kernel, allow_unverified
) -> SequenceParallelState:
    """The state of an explicit SP `group` (no DP group), after checking that `rank` is in it and `sp_size` fits."""
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {rank} is not a member of the given group: pass every rank its own sequence-parallel group "
            "(or use sp_size to let hf_upipe build contiguous groups)."
        )
    size = dist.get_world_size(group)
    if sp_size is not None and sp_size != size:
        raise ValueError(
            f"sp_size={sp_size} but the given group has {size} ranks: pass one of them, not both."
        )
    return SequenceParallelState(
        sp_group=group,
        sp_size=size,
        sp_rank=dist.get_rank(group),
        dp_group=None,
        dp_size=1,
        dp_rank=0,
        heads_per_chunk=heads_per_chunk,
        kernel=kernel,
        allow_unverified=allow_unverified,
    )


def init_sequence_parallel(
    sp_size: int | None = None,
    *,
    ring_size: int = 1,
    heads_per_chunk: int | None = 1,
    group: dist.ProcessGroup | None = None,
    kernel: str = "auto",
    allow_unverified: bool = False,
    agreed: bool = False,
) -> SequenceParallelState:
    """Create the SP and DP groups and make them the defaults of `attn_implementation="upipe"`.

    Call it on every rank, after `torch.distributed.init_process_group` (torchrun and `accelerate launch` do that
    for you), before the first forward.

    Args:
        sp_size: ranks that share one sequence; default: all ranks. Must divide the world size.
        ring_size: R > 1 splits the SP group into U = sp_size / R ranks that all-to-all heads (UPipe, inside a
            node) times R ring shards passed around by ring attention (across nodes); must divide sp_size.
        heads_per_chunk: query heads each rank processes per stage (1 = least memory, the UPipe default);
            None = all local heads at once (Ulysses).
        group: an explicit SP process group to use instead of building one (then `sp_size`, if given, must
            equal its size; no DP group is built).
        kernel: inner attention kernel: "auto" or a name from `hf_upipe.ops.kernels.available_kernels()`.
        allow_unverified: run model types that hf_upipe has not verified under SP (see `hf-upipe selftest`).
        agreed: the ranks already agreed on these settings and their UPIPE_* environment in the launch's one
            agreement (`hf_upipe.training.runtime.agree_on_launch`, which shares `agreed_settings`): skip it here.

    Returns:
        The installed `SequenceParallelState`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: `sp_size` does not divide the world size, or bad `heads_per_chunk`/`group`, or the ranks asked
            for different settings, or the state is installed with other settings (reset it first). Raised on every
            rank.
        RuntimeError: another rank did not reach this call within the validation timeout.
    """
    _check_arguments(sp_size, ring_size, heads_per_chunk, kernel, allow_unverified)
    world = dist.get_world_size()
    rank = dist.get_rank()

    if not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"ring_size={ring_size!r} must be a positive integer (1: no ring).")
    if group is not None and ring_size > 1:
        raise ValueError(
            "ring_size > 1 builds its own Ulysses and ring groups: pass sp_size, not group."
        )
    if group is not None:
        return _install(
            _given_group_state(group, rank, sp_size, heads_per_chunk, kernel, allow_unverified)
        )

    sp_size = world if sp_size is None else sp_size
    layout = rank_layout(world, sp_size, ring_size)  # ValueError when a size does not divide
    dp_size = layout.dp_size
    settings = (sp_size, heads_per_chunk, kernel, allow_unverified, ring_size)
    if not agreed:
        agree_on_settings(settings)
    if _STATE is not None and _STATE.check_group is not None:
        if _STATE.settings() == settings:
            return _STATE  # the same settings again: nothing to build
        raise ValueError(
            f"init_sequence_parallel was already called with sp_size={_STATE.sp_size}, ring_size="
            f"{_STATE.ring_size}, heads_per_chunk={_STATE.heads_per_chunk!r}, kernel={_STATE.kernel!r}: "
            "call reset_sequence_parallel() first to change them."
        )

    groups = _create_groups(layout, rank)

    _install(
        SequenceParallelState(
            sp_group=groups["sp"],
            sp_size=sp_size,
            sp_rank=rank % sp_size,
            dp_group=groups["dp"],
            dp_size=dp_size,
            dp_rank=rank // sp_size,
            heads_per_chunk=heads_per_chunk,
            kernel=kernel,
            allow_unverified=allow_unverified,
            check_group=groups["check"],
            ring_size=ring_size,
            ulysses_group=groups["ulysses"],
            ring_group=groups["ring"],
        )
    )
    if rank == 0:
        logger.info(
            "hf_upipe: %d SP group(s) of %d ranks (ring of %d), heads_per_chunk=%s, kernel=%s",
            dp_size,
            sp_size,
            ring_size,
            heads_per_chunk,
            kernel,
        )
    return _STATE


def get_sequence_parallel_state() -> SequenceParallelState | None:
    """The state installed by `init_sequence_parallel`, or None."""
    return _STATE


def reset_sequence_parallel() -> None:
    """Forget the installed defaults; "upipe" falls back to exact local attention. Groups are not destroyed."""
    _install(None)


def set_sequence_parallel_state(
    state: SequenceParallelState | None,
) -> SequenceParallelState | None:
    """Install `state` (None: no SP) as the "upipe" defaults; return the previous state."""
    previous = _STATE
    _install(state)
    return previous


@contextlib.contextmanager
def without_sequence_parallel():
    """Inside, no SP state is installed: run a model on whole sequences in this process (a reference, an evaluation)
    without the guard refusing it. The previous state is restored after."""
    previous = set_sequence_parallel_state(None)
    try:
        yield
    finally:
        set_sequence_parallel_state(previous)


def on_state_change(listener) -> None:
    """Call `listener(state)` now and whenever the installed state changes (`hf_upipe.adapters.hooks` turns its
    hook on and off so)."""
    _LISTENERS.append(listener)
    listener(_STATE)


@atexit.register
def _release_groups() -> None:
    """Drop this module's references to process groups (the state's) while the interpreter is still whole: a gloo
    group whose last reference dies in the interpreter's teardown can abort the process."""
    _install(None)


def _install(state: SequenceParallelState | None) -> SequenceParallelState | None:
    global _STATE
    if state is not None:
        # the global hooks (layer 4) listen before the first state is installed: `import hf_upipe` no longer imports
        # them (nor torch), so they are imported here, by name, the one reference this module makes upward
        importlib.import_module("hf_upipe.adapters.hooks")
    _STATE = state
    for listener in _LISTENERS:
        listener(state)
    return state
