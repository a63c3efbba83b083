"""The one set of hf_upipe settings, read by `UPipeTrainer`, `UPipePlugin` and the `hf-upipe` CLI.

Entry points:
- `UPipeConfig`: accelerate-style dataclass (help text per field, `UPIPE_*` environment fallbacks, validation in
  `__post_init__` that names the fix).
- `UPipeConfig.resolve_sp_size(world_size, local_world_size=None)`: the SP degree for a given launch.
- `UPipeConfig.init_kwargs()`: the arguments of `hf_upipe.init_sequence_parallel`.
- `UPipeConfig.describe(name)`: a setting as the user wrote it, for error messages; `UPipeConfig.from_flags(...)`
  for the settings of a script's command-line flags (errors then name `--the-flag`).
- `auto=True`: `hf_upipe.training.auto_settings.apply_auto_settings` returns a copy with the planner's memory settings
  (UPipeTrainer and UPipePlugin call it before anything else; the planner runs in a child process).
- `check_config(value, name)`: a ValueError naming a value that is neither None nor a `UPipeConfig`.
- Re-exported: `settings_that_differ(every)` / `differing_settings_error(every, intro, advice)` and
  `PER_RANK_SETTINGS` from `hf_upipe.config`, which also resolves and checks each field
  (`resolve_settings`); the `UPIPE_*` variables are read and values parsed by `hf_upipe.config`.

Precedence: an explicit argument, then the `UPIPE_<FIELD>` environment variable, then the default. Validation
that needs the world size (sp_size dividing it) happens in `resolve_sp_size`, on every rank, before any
collective: every rank sees the same settings and the same world size, so every rank raises the same error.

hf_upipe settings as users write them: the `UPIPE_<FIELD>` environment fallbacks and the parsing of values.

Entry points:
- `env_setting(name)`: the stripped value of `UPIPE_<NAME>`, or None when unset or blank.
- `parse_bool(name, value)`, `parse_positive_int(name, value, allow_none=False, minimum=1)`: a setting's value
  from a Python value or its text, or a ValueError naming the setting and the values it takes.
- `parse_with(parse, name, value)`: `parse(value)`, its ValueError prefixed with `name=value`.

hf_upipe settings resolved and validated: on each rank, and across the ranks of a launch.

Entry points:
- `resolve_settings(config, env)`: every field of a `hf_upipe.config.UPipeConfig` set from its argument, else its
  `UPIPE_<FIELD>` variable (`env`, by field name), else its default, parsed and checked, with errors that name
  the fix; `UPipeConfig.__post_init__` calls it.
- `settings_that_differ(every)` / `differing_settings_error(every, intro, advice)`: the lines, and the error, that
  name each setting whose value differs between ranks (the runtime's, `init_sequence_parallel`'s and
  `prepare_model`'s agreement checks); `PER_RANK_SETTINGS`: the settings a rank may hold on its own.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from typing import ClassVar

from hf_upipe.ops.kernels import check_kernel_name
from hf_upipe.units import parse_size, parse_tokens

__all__ = [
    "PER_RANK_SETTINGS",
    "UPipeConfig",
    "check_config",
    "differing_settings_error",
    "env_setting",
    "parse_bool",
    "parse_positive_int",
    "parse_with",
    "resolve_settings",
    "settings_that_differ",
]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_setting(name: str) -> str | None:
    """The value of `UPIPE_<NAME>` (stripped), or None when it is unset or blank."""
    value = os.environ.get(f"UPIPE_{name.upper()}")
    return None if value is None or value.strip() == "" else value.strip()


def parse_bool(name: str, value) -> bool:
    """A bool, or its text (1/true/yes/on, 0/false/no/off, any case); else a ValueError naming `name`."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}={value!r} is not a boolean: use one of {_TRUE + _FALSE}.")


def parse_with(parse, name: str, value):
    """`parse(value)`, a ValueError it raises prefixed with `name=value`."""
    try:
        return parse(value)
    except ValueError as err:
        raise ValueError(f"{name}={value!r}: {err}") from None


def parse_positive_int(name: str, value, allow_none: bool = False, minimum: int = 1):
    """An integer >= `minimum` (or None when `allow_none`), from an int, a whole float or its text; else a
    ValueError naming `name`."""
    if value is None and allow_none:
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum or (isinstance(value, float) and value != number):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        got = "" if isinstance(value, (int, str)) else f" is a {type(value).__name__}:"
        raise ValueError(f"{name}={value!r}{got} must be {kind}.")
    return number


# settings a rank may hold on its own: its offload folder, and the GPU memory the planner is told (auto's choice is
# broadcast from rank 0); every other setting decides which collectives run, so all ranks must share it
PER_RANK_SETTINGS = ("offload_path", "gpu_memory")


def resolve_settings(config, env: dict) -> None:
    """Set every field of `config` from its argument, else `env[field]` (the `UPIPE_<FIELD>` value or None), else
    its default, parsed and checked (a ValueError that names the fix)."""
    _resolve_parallelism(config, env)
    _resolve_features(config, env)
    _resolve_offload(config, env)
    _resolve_planning_and_checkpoints(config, env)
    if config.overlap_comm and not config.fused_attention:
        raise ValueError(
            f"{config.describe('overlap_comm')} overlaps the fused block's all-to-alls, but "
            f"{config.describe('fused_attention')}: turn fused_attention on or overlap_comm off."
        )
    if config.auto and config.plan_seq_len is None:
        raise ValueError(
            "auto=True chooses settings for a sequence length: set plan_seq_len (UPIPE_PLAN_SEQ_LEN) "
            "to the longest sequence of your data."
        )


def _resolve_parallelism(config, env: dict) -> None:
    """sp_size, ring_size, heads_per_chunk ('all' or a positive integer) and kernel."""
    if config.sp_size is None and env["sp_size"] is not None:
        config.sp_size = env["sp_size"]
    config.sp_size = parse_positive_int("sp_size", config.sp_size, allow_none=True)
    ring = config.ring_size if config.ring_size is not None else env["ring_size"]
    config.ring_size = 1 if ring is None else parse_positive_int("ring_size", ring)

    hpc = config.heads_per_chunk if config.heads_per_chunk is not None else env["heads_per_chunk"]
    if hpc is None:
        hpc = 1
    if isinstance(hpc, str) and hpc.lower() in ("all", "none", "ulysses"):
        hpc = "all"
    else:
        hpc = parse_positive_int("heads_per_chunk", hpc)
    config.heads_per_chunk = hpc

    config.kernel = config.kernel or env["kernel"] or "auto"
    check_kernel_name(config.kernel)


def _resolve_features(config, env: dict) -> None:
    """fused_backward, mixer_state_passing, the on/off features and the tile sizes."""
    config.fused_backward = str(
        config.fused_backward or env["fused_backward"] or "recompute"
    ).lower()
    if config.fused_backward not in ("recompute", "save"):
        raise ValueError(
            f"fused_backward={config.fused_backward!r}: use 'recompute' (the least memory) or 'save' "
            "(no attention recompute in the backward; more memory)."
        )
    config.mixer_state_passing = str(
        config.mixer_state_passing or env["mixer_state_passing"] or "parallel"
    ).lower()
    if config.mixer_state_passing not in ("parallel", "sequential"):
        raise ValueError(
            f"mixer_state_passing={config.mixer_state_passing!r}: use 'parallel' (every rank at once) "
            "or 'sequential' (the least memory)."
        )
    for name, default in (
        ("fused_attention", True),
        ("tiled_loss", True),
        ("tiled_mlp", False),
        ("allow_unverified", False),
        ("overlap_comm", False),
    ):
        value = getattr(config, name)
        value = env[name] if value is None else value
        setattr(config, name, default if value is None else parse_bool(name, value))
    for name in ("loss_chunk_tokens", "mlp_chunk_tokens"):
        value = getattr(config, name) if getattr(config, name) is not None else env[name]
        setattr(config, name, parse_positive_int(name, value, allow_none=True))


def _resolve_offload(config, env: dict) -> None:
    """offload ('none', 'cpu' or 'disk'), model_offload ('none' or 'cpu'), offload_path, offload_min_bytes and
    the allocator mode."""
    config.offload = (config.offload or env["offload"] or "none").lower()
    if config.offload not in ("none", "cpu", "disk"):
        raise ValueError(
            f"offload={config.offload!r}: use 'none', 'cpu' (pinned host memory, CUDA) or 'disk'."
        )
    config.model_offload = (config.model_offload or env["model_offload"] or "none").lower()
    if config.model_offload not in ("none", "cpu"):
        raise ValueError(
            f"model_offload={config.model_offload!r}: use 'none' (the model's state on the GPU) or 'cpu' "
            "(FSDP2's host offload of parameters, gradients and the optimizer step)."
        )
    from hf_upipe.allocator import check_setting

    config.allocator = check_setting(config.allocator or env["allocator"] or "expandable")
    config.offload_path = config.offload_path or env["offload_path"]
    floor = (
        config.offload_min_bytes
        if config.offload_min_bytes is not None
        else env["offload_min_bytes"]
    )
    config.offload_min_bytes = (
        2**20 if floor is None else parse_positive_int("offload_min_bytes", floor, minimum=0)
    )


def _resolve_planning_and_checkpoints(config, env: dict) -> None:
    """auto, plan_seq_len (tokens: 1M, 1024K), gpu_memory (a size: 80GiB) and verify_checkpoints."""
    auto = config.auto if config.auto is not None else env["auto"]
    config.auto = False if auto is None else parse_bool("auto", auto)
    length = config.plan_seq_len if config.plan_seq_len is not None else env["plan_seq_len"]
    config.plan_seq_len = (
        None if length is None else parse_with(parse_tokens, "plan_seq_len", length)
    )
    config.gpu_memory = config.gpu_memory or env["gpu_memory"]
    if config.gpu_memory is not None:
        parse_with(parse_size, "gpu_memory", config.gpu_memory)
    config.verify_checkpoints = parse_bool(
        "verify_checkpoints",
        config.verify_checkpoints
        if config.verify_checkpoints is not None
        else (env["verify_checkpoints"] or True),
    )


def settings_that_differ(every: list[tuple]) -> list[str]:
    """every[rank] = ((name, value, as shown), ...), the same names in the same order on every rank -> one line per
    setting whose value differs: "name: <shown> on ranks 0, 2, <shown> on rank 1" (empty when all agree)."""
    lines = []
    for i, (name, _, _) in enumerate(every[0]):
        by_value: dict[str, tuple[str, list[int]]] = {}
        for rank, settings in enumerate(every):
            by_value.setdefault(repr(settings[i][1]), (settings[i][2], []))[1].append(rank)
        if len(by_value) > 1:
            lines.append(
                f"{name}: "
                + ", ".join(
                    f"{shown} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                    for shown, r in by_value.values()
                )
            )
    return lines


def differing_settings_error(every: list[tuple], intro: str, advice: str) -> ValueError | None:
    """`{intro} (<settings_that_differ lines>){advice}` when a setting of `every` differs between ranks, else None."""
    differ = settings_that_differ(every)
    return ValueError(f"{intro} ({'; '.join(differ)}){advice}") if differ else None


def check_config(value, name: str = "upipe_config") -> None:
    """A ValueError naming `value` when it is neither None nor a `UPipeConfig` (a dict, a string, ...)."""
    if value is None or isinstance(value, UPipeConfig):
        return
    hint = f" (UPipeConfig(**{name}) for a dict of settings)" if isinstance(value, dict) else ""
    raise ValueError(
        f"{name}={value!r} is a {type(value).__name__}: pass an hf_upipe.UPipeConfig (e.g. "
        f"UPipeConfig(sp_size=8)), or None for the defaults{hint}."
    )


@dataclass
class UPipeConfig:
    """Sequence-parallel training settings. Every field falls back to the environment variable `UPIPE_<FIELD>`
    (for example `UPIPE_SP_SIZE=8`, `UPIPE_HEADS_PER_CHUNK=all`) when not given."""

    sp_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Ranks that share one sequence (sequence-parallel degree). Default: all processes of a node "
                "(LOCAL_WORLD_SIZE when it divides the world size), else all processes. Must "
                "divide the world size; the "
                "remaining factor is data parallelism."
            )
        },
    )
    ring_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Ring attention across the SP group: sp_size = U x ring_size ranks, UPipe's "
                "all-to-alls over U contiguous "
                "ranks (a node) and a ring over ring_size (across nodes), for more ranks than "
                "the heads allow. Default 1 "
                "(no ring). With a ring, sp_size defaults to the processes of one node times ring_size."
            )
        },
    )
    heads_per_chunk: int | str | None = field(
        default=None,
        metadata={
            "help": (
                "Query heads each rank processes per UPipe stage: 1 (default) uses the least attention memory; 'all' "
                "processes all local heads at once, which is DeepSpeed-Ulysses done by the same code."
            )
        },
    )
    kernel: str | None = field(
        default=None,
        metadata={
            "help": (
                "Inner attention kernel: 'auto' (the fastest one usable on the device: flash_attn, then cudnn, "
                "then sdpa), 'sdpa' (torch's own flash-attention kernels, CPU and CUDA), "
                "'cudnn' (torch's cuDNN attention, CUDA only) or 'flash_attn' (the flash-attn package, CUDA only); "
                "see hf_upipe.ops.kernels."
            )
        },
    )
    fused_attention: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Install the fused UPipe attention block (q/k/v/o projections inside the head-chunk loop) on Llama, "
                "Mistral, Qwen2 and Qwen3 attention modules (hf_upipe.prepare_model). Default True."
            )
        },
    )
    fused_backward: str | None = field(
        default=None,
        metadata={
            "help": (
                "How the fused block's backward gets each stage's attention output: 'recompute' (default: the least "
                "memory) or 'save' (kept from the forward, about one local attention output more "
                "per layer: no attention "
                "recompute, and dk/dv sent once per key-value chunk)."
            )
        },
    )
    overlap_comm: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Issue the fused block's backward all-to-alls one stage ahead, asynchronously, so they run while the "
                "neighbouring stage's attention kernel computes (NCCL: on its own stream; gloo: "
                "its worker thread), as its "
                "forward always does in training (that costs no peak memory). The same result, for one more stage of "
                "q/k/v and gradient buffers in the backward. Needs fused_attention. Default False."
            )
        },
    )
    mixer_state_passing: str | None = field(
        default=None,
        metadata={
            "help": (
                "How a hybrid's delta-rule mixers (gated DeltaNet, Kimi delta attention) pass state across shards: "
                "'parallel' (default: every rank at once, from the states all ranks gather; its "
                "kernel carries d_k more "
                "value columns) or 'sequential' (rank after rank inside each such layer: the least memory, P times the "
                "time). Mamba2 mixers always pass it in sequence."
            )
        },
    )
    tiled_loss: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Compute lm_head + cross-entropy in token chunks so the [tokens, vocab] logits "
                "never exist. Default True."
            )
        },
    )
    loss_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": (
                "Tokens per tiled-loss chunk. Default: about 256 MiB of fp32 logits per chunk "
                "(65536 // (vocab / 1024))."
            )
        },
    )
    tiled_mlp: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Run the MLPs and norms of the fused families (Llama, Mistral, Qwen, Granite, "
                "OLMo 2, Phi-3, Gemma, ...; "
                "not MoE blocks) over sequence chunks, recomputed in backward "
                "(hf_upipe.adapters.tiled_mlp). Default False."
            )
        },
    )
    mlp_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": ("Tokens per tiled-MLP chunk. Default: the model's hidden size.")},
    )
    offload: str | None = field(
        default=None,
        metadata={
            "help": (
                "Where activation checkpointing keeps the layer inputs: 'none' (default), 'cpu' "
                "(pinned host memory, CUDA) "
                "or 'disk' (files under offload_path). Needs activation checkpointing."
            )
        },
    )
    offload_path: str | None = field(
        default=None,
        metadata={
            "help": (
                "Folder for offload='disk' (a per-step subfolder is created and removed). Default: the temp folder."
            )
        },
    )
    offload_min_bytes: int | None = field(
        default=None,
        metadata={"help": ("Layer inputs smaller than this stay on the device. Default 1 MiB.")},
    )
    model_offload: str | None = field(
        default=None,
        metadata={
            "help": (
                "Where FSDP2 keeps the model's state: 'none' (default: on the GPU) or 'cpu' (FSDP2's "
                "CPUOffloadPolicy: fp32 parameter shards, gradient shards and AdamW's states in host memory, the "
                "optimizer step on the CPU; each layer's shard is copied to the GPU for its all-gather). Needs "
                "FSDP2 (refused under DDP and DeepSpeed: docs/memory-stack.md)."
            )
        },
    )
    allocator: str | None = field(
        default=None,
        metadata={
            "help": (
                "The CUDA caching allocator's mode, set in PYTORCH_CUDA_ALLOC_CONF before CUDA initialises "
                "(hf_upipe.allocator): 'expandable' (default: expandable segments, the longest planned fit), "
                "'default' (the allocator's own segments) or 'keep' (leave the variable as it is). If CUDA is "
                "already initialised in another mode, that is said once and the plan for that mode applies."
            )
        },
    )
    auto: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Let the planner (hf_upipe.plan) choose heads_per_chunk, fused_attention, "
                "fused_backward, overlap_comm, "
                "tiled_mlp, the MLP and loss tiles and offload for plan_seq_len tokens on this "
                "launch's GPUs: the settings "
                "with the shortest predicted step that fit. The explicit "
                "values of those fields are then replaced. Default False."
            )
        },
    )
    plan_seq_len: int | None = field(
        default=None,
        metadata={
            "help": (
                "Tokens per sequence the auto settings must fit (the longest sequence of your "
                "data), e.g. 1048576, 1024K or "
                "1M (K = 1024, M = 1048576 tokens). Needed with auto."
            )
        },
    )
    gpu_memory: str | None = field(
        default=None,
        metadata={
            "help": (
                "Memory of one GPU for the auto settings, with its unit: '80GiB', '80GB'. "
                "Default: the CUDA device's total "
                "memory."
            )
        },
    )
    allow_unverified: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Run a model architecture hf_upipe has not verified under sequence parallelism (after checking it with "
                "`hf-upipe selftest --model <yours>`). Default False: unverified architectures are refused."
            )
        },
    )
    verify_checkpoints: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Check a checkpoint's manifest (size and SHA-256 of every file) before resuming from it, and refuse a "
                "corrupted, incomplete or unmanifested one. Default True; False resumes from any checkpoint unchecked."
            )
        },
    )

    # Where each setting came from, for messages that name it as the user wrote it (see `describe`): the name of
    # the dataclass, "env" or "default". Not a field: no runtime state, excluded from repr and equality.
    _origin: ClassVar[dict]

    def __post_init__(self):
        env = {f.name: env_setting(f.name) for f in fields(self)}
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        object.__setattr__(
            self,
            "_origin",
            {
                name: ("arg", given[name])
                if given[name] is not None
                else ("env", env[name])
                if env[name] is not None
                else ("default", None)
                for name in given
            },
        )
        resolve_settings(self, env)

    def describe(self, name: str) -> str:
        """How the user set `name`, for error messages: `UPipeConfig(heads_per_chunk='all')`,
        `UPIPE_HEADS_PER_CHUNK=all`, `heads_per_chunk=1 (the default)` or `heads_per_chunk=2 (chosen by auto)`;
        for the settings of a script's flags (`from_flags`), the flag: `--heads-per-chunk 3`, `--no-tiled-mlp`."""
        origin, raw = self._origin.get(name, ("default", None))
        if origin == "arg" and getattr(self, "_flags", False):
            flag = "--" + name.replace("_", "-")
            if isinstance(raw, bool):
                return flag if raw else "--no-" + flag[2:]
            return f"{flag} {raw}"
        if origin == "arg":
            return f"{type(self).__name__}({name}={raw!r})"
        if origin == "env":
            return f"UPIPE_{name.upper()}={raw}"
        if origin == "source":
            return raw
        value = getattr(self, name)
        return f"{name}={value!r} ({'chosen by auto=True' if origin == 'auto' else 'the default'})"

    def spell(self, name: str, value) -> str:
        """How the user would write `name=value` in the way they wrote these settings (for the fix in a message)."""
        if getattr(self, "_flags", False):
            flag = "--" + name.replace("_", "-")
            return (
                (flag if value else "--no-" + flag[2:])
                if isinstance(value, bool)
                else f"{flag} {value}"
            )
        return f"{type(self).__name__}({name}={value!r}) / UPIPE_{name.upper()}={value}"

    @classmethod
    def from_flags(cls, **settings):
        """The settings a script read from its command-line flags (`--heads-per-chunk 2` -> heads_per_chunk=2):
        errors then name the flag as typed, `--heads-per-chunk 2`, rather than the Python argument."""
        config = cls(**settings)
        object.__setattr__(config, "_flags", True)
        return config

    def with_auto(self, **chosen) -> "UPipeConfig":
        """A copy with the planner's `chosen` values, marked as chosen by auto (this config is left unchanged)."""
        return self._with({name: ("auto", value) for name, value in chosen.items()}, chosen)

    def with_source(self, source: str, **values) -> "UPipeConfig":
        """A copy with `values` taken from another setting (`source`, how the user wrote it, e.g.
        `ParallelismConfig(sp_size=2)`), which `describe` then names; this config is left unchanged."""
        return self._with({name: ("source", source) for name in values}, values)

    def _with(self, origins: dict, values: dict) -> "UPipeConfig":
        """A copy with `values` set and their `origins` recorded."""
        new = copy.copy(self)
        object.__setattr__(new, "_origin", dict(self._origin))
        for name, value in values.items():
            setattr(new, name, value)
        new._origin.update(origins)
        return new

    def resolve_sp_size(self, world_size: int, local_world_size: int | None = None) -> int:
        """The SP degree for a launch of `world_size` processes (`local_world_size` per node).

        Raises:
            ValueError: sp_size does not divide world_size (the message lists the values that do).
        """
        if local_world_size is None and os.environ.get("LOCAL_WORLD_SIZE"):
            local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        sp = self.sp_size
        if sp is None:
            node = local_world_size * self.ring_size if local_world_size else None
            sp = node if node and world_size % node == 0 else world_size
        if world_size % sp != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"{self.describe('sp_size')}: sp_size={sp} does not divide the {world_size} processes "
                f"of this launch; use one of {divisors}."
            )
        if sp % self.ring_size:
            raise ValueError(
                f"{self.describe('ring_size')} does not divide sp_size={sp} (sp_size = ranks per ring "
                f"shard x ring_size); use one of {[d for d in range(1, sp + 1) if sp % d == 0]}."
            )
        return sp

    def init_kwargs(self) -> dict:
        """`ring_size`, `heads_per_chunk`, `kernel` and `allow_unverified` as `init_sequence_parallel` takes them
        ('all' -> None)."""
        return {
            "ring_size": self.ring_size,
            "heads_per_chunk": None if self.heads_per_chunk == "all" else self.heads_per_chunk,
            "kernel": self.kernel,
            "allow_unverified": self.allow_unverified,
        }
