"""accelerate's `ParallelismConfig` under hf_upipe: its SP degree is honoured or the run is refused, never ignored.

Entry points:
- `find_parallelism(explicit, source)`: the sizes of a `ParallelismConfig` given in Python (`TrainingArguments(
  parallelism_config=...)`, `Accelerator(parallelism_config=...)`), or else those of the accelerate config file's
  `parallelism_config_*` keys, which `accelerate launch` exports as `PARALLELISM_CONFIG_*` variables with
  `ACCELERATE_USE_PARALLELISM_CONFIG=true` (read as accelerate's `ParallelismConfig.__post_init__` reads them);
  None when there is neither.
- `with_parallelism_sp(config, sizes)`: the UPipe settings with sp_size taken from the parallelism config when
  neither `UPipeConfig.sp_size` nor `UPIPE_SP_SIZE` gives it (a copy; errors then name the parallelism config).
- `resolve_launch(config, sizes, world, deepspeed=...)`: the `Launch`, the sizes of one launch resolved once at
  its first entry point (`UPipeTrainer`, `UPipePlugin.prepare`) and carried through `UPipeRuntime.setup`: the SP,
  ring and DP sizes, where each came from, the SP degree's own error, and in `Launch.errors` what hf_upipe
  refuses, each error naming the numbers and the fix: DeepSpeed together with an SP degree (accelerate would
  stack DeepSpeed's Ulysses SP, its only `sp_backend`, on hf_upipe's), an SP degree with any `sp_backend` other
  than 'deepspeed' (accelerate 1.15 knows no other; a backend of its own would shard the sequence a second time),
  `cp_size > 1` (context parallelism: another SP system), `tp_size > 1`, an sp_size that disagrees with
  `UPipeConfig.sp_size`, and sp x dp sizes that do not make the world size. `Launch.agreed` says whether the ranks
  have agreed on it (`runtime.agree_on_launch`, the one agreement collective of a launch).
- `accelerate_view(sizes, sp, world, fsdp)`: the `ParallelismConfig` accelerate and transformers get instead of the
  user's: no SP (hf_upipe runs it), the SP ranks folded into the data-parallel sizes (the gradients are averaged
  over all ranks), so neither sets up DeepSpeed SP, counts batches per SP size or computes a DeepSpeed SP loss.

Nothing here runs a collective: the callers share the errors with `runtime.agree_on_launch`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from hf_upipe.config import UPipeConfig

__all__ = [
    "ENV_SWITCH",
    "Launch",
    "ParallelismSizes",
    "accelerate_view",
    "find_parallelism",
    "resolve_launch",
    "uses_deepspeed",
    "with_parallelism_sp",
]

ENV_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"
_ENV = "PARALLELISM_CONFIG_"
_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
_FROM_ENV = "the accelerate config"
_SP_BACKEND = "deepspeed"  # accelerate's default and, in accelerate 1.15, its only sp_backend


@dataclass(frozen=True)
class ParallelismSizes:
    """The sizes of one `ParallelismConfig` and where they came from (`source`: the Python call, or
    `_FROM_ENV` for the accelerate config's `parallelism_config_*` keys)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1
    source: str = "ParallelismConfig"
    sp_backend: str = "deepspeed"

    @property
    def total(self) -> int:
        return math.prod(getattr(self, d) for d in _DIMS)

    def describe(self, dim: str) -> str:
        """`ParallelismConfig(sp_size=2)`, or `parallelism_config_sp_size: 2 (PARALLELISM_CONFIG_SP_SIZE=2)`."""
        value = getattr(self, dim)
        if self.source == _FROM_ENV:
            return f"parallelism_config_{dim}_size: {value} ({_ENV}{dim.upper()}_SIZE={value})"
        return f"{self.source}({dim}_size={value})"

    def spell(self, **sizes: int) -> str:
        """The fix written the way these sizes were given."""
        if self.source == _FROM_ENV:
            return ", ".join(f"parallelism_config_{d}_size: {v}" for d, v in sizes.items())
        return f"{self.source}({', '.join(f'{d}_size={v}' for d, v in sizes.items())})"


def _int(value, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"{name}={value!r}: a parallelism size is a positive integer.")
    return number


def find_parallelism(explicit=None, *, environ: dict | None = None) -> ParallelismSizes | None:
    """The sizes of `explicit` (a `ParallelismConfig`), else of the accelerate config's variables, else None.
    An `explicit` one built by accelerate from those variables (`Accelerator().parallelism_config` under
    `accelerate launch`) is named as the accelerate config's keys."""
    env = os.environ if environ is None else environ
    from_file = env.get(ENV_SWITCH, "false").lower() == "true"
    if explicit is not None:
        return ParallelismSizes(
            **{d: _int(getattr(explicit, f"{d}_size", None) or 1, f"{d}_size") for d in _DIMS},
            source=_FROM_ENV if from_file and _matches_env(explicit, env) else "ParallelismConfig",
            sp_backend=str(getattr(explicit, "sp_backend", None) or _SP_BACKEND),
        )
    if not from_file:
        return None
    return ParallelismSizes(
        **{
            d: _int(env.get(f"{_ENV}{d.upper()}_SIZE", "1"), f"{_ENV}{d.upper()}_SIZE")
            for d in _DIMS
        },
        source=_FROM_ENV,
        sp_backend=env.get(f"{_ENV}SP_BACKEND", _SP_BACKEND),
    )


def _matches_env(explicit, env) -> bool:
    return all(
        str(getattr(explicit, f"{d}_size", None) or 1) == env.get(f"{_ENV}{d.upper()}_SIZE", "1")
        for d in _DIMS
    )


def uses_deepspeed(args=None, environ: dict | None = None) -> bool:
    """Whether the run uses the DeepSpeed engine: `TrainingArguments(deepspeed=...)` or an accelerate DeepSpeed
    config (`ACCELERATE_USE_DEEPSPEED=true`)."""
    env = os.environ if environ is None else environ
    return (
        bool(getattr(args, "deepspeed", None))
        or env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    )


def with_parallelism_sp(config: UPipeConfig, sizes: ParallelismSizes | None) -> UPipeConfig:
    """`config`, or a copy with sp_size from `sizes` when only the parallelism config gives an SP degree."""
    if sizes is None or sizes.sp == 1 or config.sp_size is not None:
        return config
    return config.with_source(sizes.describe("sp"), sp_size=sizes.sp)


def _stacking_errors(
    config: UPipeConfig, sizes: ParallelismSizes, deepspeed: bool
) -> list[Exception]:
    errors: list[Exception] = []
    if sizes.sp > 1 and sizes.sp_backend != _SP_BACKEND:
        where = (
            f"parallelism_config_sp_backend: {sizes.sp_backend} "
            f"({_ENV}SP_BACKEND={sizes.sp_backend})"
            if sizes.source == _FROM_ENV
            else f"{sizes.source}(sp_backend={sizes.sp_backend!r})"
        )
        errors.append(
            ValueError(
                f"{where} with {sizes.describe('sp')}: hf_upipe runs the sequence parallelism itself and "
                f"takes only the degree from a parallelism config whose sp_backend is {_SP_BACKEND!r} (accelerate's "
                f"default); the {sizes.sp_backend!r} backend would shard each sequence a second time. Drop "
                "sp_backend (or set it to 'deepspeed') to run hf_upipe over those ranks, or drop hf_upipe to use "
                f"accelerate's {sizes.sp_backend!r} backend."
            )
        )
    if deepspeed and sizes.sp > 1:
        errors.append(
            ValueError(
                f"{sizes.describe('sp')} with DeepSpeed: accelerate would set up DeepSpeed's own sequence parallelism "
                f"(sp_backend='deepspeed', Ulysses) over {sizes.sp} ranks on top "
                "of hf_upipe's, two sequence-parallel systems stacked. Use hf_upipe with an "
                "FSDP2 or DDP accelerate config "
                "(not DeepSpeed), or drop hf_upipe (transformers.Trainer) to use DeepSpeed's sequence parallelism."
            )
        )
    if sizes.cp > 1:
        errors.append(
            ValueError(
                f"{sizes.describe('cp')} asks for context parallelism, another sequence-parallel "
                "system, which hf_upipe "
                f"would run under its own: set {sizes.spell(cp=1, sp=sizes.cp * sizes.sp)} to let hf_upipe split each "
                "sequence over those ranks instead."
            )
        )
    if sizes.tp > 1:
        errors.append(
            ValueError(
                f"{sizes.describe('tp')}: tensor parallelism is not supported together with hf_upipe's sequence "
                f"parallelism; set {sizes.spell(tp=1)}."
            )
        )
    if config.sp_size is not None and sizes.sp > 1 and config.sp_size != sizes.sp:
        errors.append(
            ValueError(
                f"{config.describe('sp_size')} and {sizes.describe('sp')} disagree on the sequence-parallel degree "
                f"({config.sp_size} vs {sizes.sp}): give it once (drop one of them) or make them equal."
            )
        )
    return errors


def _size_errors(
    config: UPipeConfig, sizes: ParallelismSizes, sp: int, world: int
) -> list[Exception]:
    """sp x dp sizes that do not make the world size (`config`: with the parallelism config's SP degree)."""
    dp = sizes.dp_replicate * sizes.dp_shard
    if sp * dp == world:
        return []
    fix = (
        f"set dp_replicate_size x dp_shard_size to {world // sp} (for example "
        f"{sizes.spell(dp_shard=world // sp) if sizes.dp_shard > 1 else sizes.spell(dp_replicate=world // sp)}"
        f"{', dp_replicate_size: 1' if sizes.dp_shard > 1 and sizes.dp_replicate > 1 else ''})"
    )
    origin = (
        config.describe("sp_size") if config.sp_size is not None else "hf_upipe's default: one node"
    )
    return [
        ValueError(
            f"sp_size {sp} ({origin}) x dp_replicate_size {sizes.dp_replicate} x dp_shard_size "
            f"{sizes.dp_shard} ({sizes.describe('dp_replicate')}, {sizes.describe('dp_shard')}) = {sp * dp} "
            f"processes, but this launch has {world}: {fix}, or choose an sp_size that makes {world}."
        )
    ]


@dataclass(frozen=True)
class Launch:
    """The sizes of one launch, resolved once (`resolve_launch`) and carried through the setup.

    Attributes:
        config: the settings, with the SP degree of accelerate's `ParallelismConfig` where they give none.
        world: the processes of the launch; `sp`: the SP degree (None when it does not resolve: `sp_error` says
            why); `ring`: the ring size; `dp`: world / sp, the data-parallel replicas.
        sp_source, ring_source, dp_source: where each size came from, as the user wrote it (the `UPipeConfig`
            field, an `UPIPE_*` variable, accelerate's `ParallelismConfig`, hf_upipe's default). The auto plan
            chooses memory settings, never a size: `with_plan` keeps the sizes agreed on.
        parallelism: the sizes of accelerate's `ParallelismConfig`, or None; `deepspeed`: whether DeepSpeed runs.
        errors: what hf_upipe refuses in `parallelism` (module docstring); `sp_error`: the SP degree's own.
        agreed: whether every rank agreed on this launch (`hf_upipe.training.runtime.agree_on_launch`) with the
            model it trains, so that the setup runs no other agreement.
    """

    config: UPipeConfig
    world: int
    sp: int | None
    ring: int
    sp_source: str
    ring_source: str
    dp_source: str
    parallelism: ParallelismSizes | None = None
    deepspeed: bool = False
    errors: tuple[Exception, ...] = ()
    sp_error: Exception | None = None
    agreed: bool = False

    @property
    def dp(self) -> int | None:
        return None if self.sp is None else self.world // self.sp

    def size_errors(self) -> list[Exception]:
        """`errors`, then `sp_error`: every refusal of the sizes, in the order they are reported."""
        return [*self.errors, *([self.sp_error] if self.sp_error is not None else [])]

    def with_plan(self, config: UPipeConfig) -> Launch:
        """This launch with the settings of the auto plan (`config`); its sizes stay those agreed on."""
        return replace(self, config=config)

    def as_agreed(self) -> Launch:
        return replace(self, agreed=True)


def resolve_launch(
    config: UPipeConfig, sizes: ParallelismSizes | None, world: int, *, deepspeed: bool = False
) -> Launch:
    """The `Launch` of `config` and accelerate's parallelism `sizes` over `world` processes: each size resolved once,
    what hf_upipe refuses in them collected (raised later, on every rank, by the agreement)."""
    errors = _stacking_errors(config, sizes, deepspeed) if sizes is not None else []
    config = with_parallelism_sp(config, sizes)
    sp, sp_error = None, None
    try:
        sp = config.resolve_sp_size(world)
    except ValueError as err:
        sp_error = err
    checked = sizes is not None and not errors and sizes.total > 1
    if checked and sp is not None:  # all sizes 1: accelerate's "data parallel over every process"
        errors += _size_errors(config, sizes, sp, world)
    if checked and sizes.dp_replicate * sizes.dp_shard > 1:
        dp_source = f"{sizes.describe('dp_replicate')}, {sizes.describe('dp_shard')}"
    else:
        dp_source = f"the {world} processes / sp_size"
    return Launch(
        config=config,
        world=world,
        sp=sp,
        ring=config.ring_size,
        sp_source=(
            config.describe("sp_size")
            if config.sp_size is not None
            else "hf_upipe's default: the processes of one node"
        ),
        ring_source=config.describe("ring_size"),
        dp_source=dp_source,
        parallelism=sizes,
        deepspeed=deepspeed,
        errors=tuple(errors),
        sp_error=sp_error,
    )


def accelerate_view(sizes: ParallelismSizes | None, sp: int, world: int, *, fsdp: bool = False):
    """The `accelerate.ParallelismConfig` accelerate and transformers get: sp_size, cp_size and tp_size 1, and
    data parallelism over all `world` processes (the gradients are averaged over every rank): under FSDP the SP
    ranks are folded into dp_shard (parameters sharded over them too, replicated over dp_replicate); otherwise all
    sizes 1, which accelerate reads as DDP over every process (it accepts nothing else on CPU). None when the user
    gave no parallelism config."""
    if sizes is None:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    replicate, shard = 1, 1
    if fsdp and sizes.total > 1:
        replicate = sizes.dp_replicate if world % (sizes.dp_replicate * sp) == 0 else 1
        shard = world // replicate
    return ParallelismConfig(
        dp_replicate_size=replicate,
        dp_shard_size=shard,
        tp_size=1,
        cp_size=1,
        sp_size=1,
        cp_backend="torch",
        sp_backend="deepspeed",
    )
