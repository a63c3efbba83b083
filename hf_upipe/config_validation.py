"""hf_upipe settings resolved and validated: on each rank, and across the ranks of a launch.

Entry points:
- `resolve_settings(config, env)`: every field of a `hf_upipe.config.UPipeConfig` set from its argument, else its
  `UPIPE_<FIELD>` variable (`env`, by field name), else its default, parsed and checked, with errors that name
  the fix; `UPipeConfig.__post_init__` calls it.
- `settings_that_differ(every)` / `differing_settings_error(every, intro, advice)`: the lines, and the error, that
  name each setting whose value differs between ranks (the runtime's, `init_sequence_parallel`'s and
  `prepare_model`'s agreement checks); `PER_RANK_SETTINGS`: the settings a rank may hold on its own.
"""

from __future__ import annotations

from hf_upipe.config_parsing import parse_bool, parse_positive_int, parse_with
from hf_upipe.ops.kernels import check_kernel_name
from hf_upipe.units import parse_size, parse_tokens

__all__ = [
    "PER_RANK_SETTINGS",
    "differing_settings_error",
    "resolve_settings",
    "settings_that_differ",
]

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
    from hf_upipe.memory.allocator import check_setting

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
