"""How a `Plan` is shown: the per-GPU table, the launch lines, and the `hf-upipe plan` command.

Entry points:
- `format_plan(plan)`: the text `hf-upipe plan` prints (`Plan.table()`).
- `launch_lines(plan)`: the environment variables / `UPipeConfig` to run the plan with (`Plan.launch()`).

The `hf-upipe plan` command itself is `hf_upipe.planning.plan_command`. This module imports neither the planner nor
transformers: `Plan` calls it.
"""

from __future__ import annotations

from hf_upipe.models.architectures import model_geometry
from hf_upipe.planning.tracker import GiB
from hf_upipe.units import format_tokens

__all__ = ["LORA_TARGETS", "assumptions", "describe", "format_plan", "launch_lines"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_ROWS = (
    ("parameters", "FSDP2 shards (fp32) + gathered layers and root ({compute})"),
    ("gradients", "FSDP2 gradient shards (fp32) + reduce-scatter buffers"),
    ("optimizer", "AdamW m and v shards (fp32) + foreach temporaries"),
    ("checkpoints", "checkpointed layer inputs on the GPU"),
    ("attention", "attention block (projections, all-to-alls, kernel, their gradients)"),
    ("mlp", "MLP working set"),
    ("residual", "norms, residual stream and its gradient"),
    ("loss", "lm_head + loss (tiled: gradients of the head)"),
    ("other", "embeddings, final norm, RoPE tables"),
)


_LORA_ROWS = {  # what the static rows hold under LoRA: a frozen base in the compute dtype, fp32 adapters
    "parameters": "frozen base shards ({compute}) + fp32 adapter shards + gathered layers and root ({compute})",
    "gradients": "adapter gradient shards (fp32) + reduce-scatter buffers",
    "optimizer": "AdamW m and v of the adapters (fp32) + foreach temporaries",
}


def _row_labels(plan) -> list[tuple[str, str]]:
    """(category, what it holds) with the dtypes the simulation built: fp32 master weights, gradients and AdamW
    states (whatever the model's config says: the planner builds them in fp32), the compute dtype gathered."""
    compute = str(plan.dtype).replace("torch.", "")
    rows = [(n, _LORA_ROWS.get(n, w) if plan.lora else w) for n, w in _ROWS]
    return [(n, w.format(compute=compute)) for n, w in rows]


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f}"


def _secs(t: float) -> str:
    return f"{t:,.1f} s" if t >= 10 else f"{t:.2f} s"


def describe(settings) -> str:
    """One line naming the settings."""
    impl = {
        "fused": "fused UPipe",
        "upipe": "UPipe (registered)",
        "ulysses": "Ulysses mode (our code)",
        "deepspeed": "DeepSpeed Ulysses",
    }[settings.impl]
    parts = [impl, f"heads_per_chunk={settings.heads_per_chunk or 'all'}"]
    if settings.impl == "fused":
        parts.append(
            f"{settings.fused_backward} backward"
            + (", all-to-alls overlapped" if settings.overlap else "")
        )
    if settings.tiled_mlp:
        parts.append(f"tiled MLP ({settings.mlp_chunk_tokens or 'hidden-size'} tokens)")
    if settings.tiled_loss:
        parts.append(f"tiled loss ({settings.loss_chunk_tokens or 'default'} tokens)")
    parts.append(
        {"cpu": "checkpoints offloaded to host", "disk": "checkpoints offloaded to disk"}.get(
            settings.offload, "checkpoints kept on the GPU"
        )
    )
    if settings.model_offload == "cpu":
        parts.append("model state offloaded to host (parameters, gradients, AdamW step)")
    return ", ".join(parts)


def _header_line(plan, g: dict) -> str:
    """The model, the hardware, the parallelism, the dtype and the kind of fine-tune, on one line."""
    return (
        f"model {plan.model}: {g['layers']} layers, hidden {g['hidden']}, {g['heads']}/{g['kv_heads']} heads, "
        f"vocab {g['vocab']}; {plan.nodes} node(s) x {plan.gpus} GPUs of {_gib(plan.gpu_memory)} GiB; "
        f"SP {plan.sp_size}"
        + (
            f" (UPipe over {plan.sp_size // plan.settings.ring_size} x a ring of "
            f"{plan.settings.ring_size})"
            if plan.settings.ring_size > 1
            else ""
        )
        + f", FSDP2 over {plan.gpus * plan.nodes}; {str(plan.dtype).replace('torch.', '')}; "
        + (
            "full fine-tune"
            if plan.lora is None
            else f"LoRA rank {plan.lora[0]} on {','.join(plan.lora[1])}"
        )
    )


def _memory_lines(plan) -> list[str]:
    """The per-GPU table: the categories, the tensors, the overhead rows and the required total."""
    lines = [f"{'per-GPU peak':<14}{'GiB':>9}"]
    for name, what in _row_labels(plan):
        if (
            plan.by_category.get(name, 0) >= 2**20
        ):  # rows of a few bytes (bookkeeping) would read 0.00
            lines.append(f"  {name:<12}{_gib(plan.by_category[name]):>9}   {what}")
    lines.append(f"  {'tensors':<12}{_gib(plan.tensor_peak):>9}")
    lines += _overhead_lines(plan)
    lines += [
        f"  {'required':<12}{_gib(plan.required):>9}   of {_gib(plan.usable)} GiB usable "
        f"({'free' if plan.required <= plan.usable else 'short by'} "
        f"{_gib(abs(plan.usable - plan.required))} GiB)",
    ]
    return lines


def _host_line(plan) -> str:
    """The pinned host memory the offloaded checkpoints take, and whether it fits."""
    host = (
        ""
        if plan.host_memory is None
        else (f" of {_gib(plan.host_memory)} GiB" + ("" if plan.host_fits else ": DOES NOT FIT"))
    )
    return (
        f"host memory for offloaded checkpoints: {_gib(plan.host_bytes_per_gpu)} GiB per GPU, "
        f"{_gib(plan.host_bytes_per_gpu * plan.gpus)} GiB per node (pinned)"
        + (host or " (--host-memory checks it)")
    )


def _disk_line(plan) -> str:
    """Where offload="disk" puts the checkpoints: the disk space per GPU and per node (no host memory held)."""
    return (
        f"disk for offloaded checkpoints: {_gib(plan.disk_bytes_per_gpu)} GiB per GPU, "
        f"{_gib(plan.disk_bytes_per_gpu * plan.gpus)} GiB per node, in files under UPIPE_OFFLOAD_PATH (a fast "
        "local NVMe disk per GPU; no pinned host memory, the page cache the writes fill is reclaimable)"
    )


def _model_host_line(plan) -> str:
    """The host memory the model's state takes with model_offload='cpu' (checked with the checkpoints')."""
    total = (plan.host_bytes_per_gpu + plan.model_host_bytes) * plan.gpus
    host = (
        " (--host-memory checks it)"
        if plan.host_memory is None
        else f", {_gib(total)} GiB per node with the checkpoints, of {_gib(plan.host_memory)} GiB"
        + ("" if plan.host_fits else ": DOES NOT FIT")
    )
    return (
        f"host memory for the model's state (model offload: fp32 parameter and gradient shards, AdamW's states "
        f"and step): {_gib(plan.model_host_bytes)} GiB per GPU{host}"
    )


def _tried_lines(plan) -> list[str]:
    """The settings the planner judged, fastest first, with their step time and memory."""
    lines = [
        "",
        f"settings judged at {format_tokens(plan.seq_len)}, fastest first (predicted step, tokens/s per "
        "GPU, required GiB; '-': not simulated, it needs more memory than a setting that does not fit):",
    ]
    for s, need, host, secs in plan.tried:
        verdict = (
            "host"
            if not host
            else "-   "
            if need is None
            else "fits"
            if need <= plan.usable
            else "no  "
        )
        lines.append(
            f"  {_secs(secs):>9} {plan.seq_len / secs / plan.sp_size:>9,.0f} "
            f"{'-' if need is None else _gib(need):>9}  {verdict}  {describe(s)}"
        )
    return lines


def format_plan(plan) -> str:
    """The text `hf-upipe plan` prints: the verdict, the per-GPU table, the settings judged, how to launch."""
    g = model_geometry(plan.config)
    lines = [_header_line(plan, g)]
    if plan.max_seq_len is not None:
        lines.append(
            f"longest sequence that fits: {plan.max_seq_len:,} tokens ({format_tokens(plan.max_seq_len)})"
            if plan.max_seq_len
            else "nothing fits, not even the shortest step: see the table below"
        )
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += [
        f"sequence {plan.seq_len:,} tokens ({format_tokens(plan.seq_len)}), {plan.seq_len // plan.sp_size:,} per "
        f"GPU: {verdict}",
        f"settings: {describe(plan.settings)}",
    ]
    lines += [f"note: {note}" for note in plan.notes] + [""]
    lines += _memory_lines(plan)
    if plan.host_bytes_per_gpu:
        lines.append(_host_line(plan))
    if plan.disk_bytes_per_gpu:
        lines.append(_disk_line(plan))
    if plan.model_host_bytes:
        lines.append(_model_host_line(plan))
    if plan.step_time is not None:
        t = plan.step_time
        lines.append(
            f"predicted step: {_secs(t.seconds)}, {t.tokens_per_s_per_gpu:,.0f} tokens/s per GPU on "
            f"{plan.gpu.name} (a model of FLOPs and bytes, not a measurement: hf_upipe.planning.step_time)"
        )
    if plan.tried:
        lines += _tried_lines(plan)
    lines += ["", "assumed: " + assumptions(plan), "", *_launch_or_advice(plan), ""]
    lines += [
        f"planned in {plan.seconds:.1f} s: one FSDP2 training step of the model code on fake tensors, "
        + (
            f"all {g['layers']} layers"
            if plan.exact or g["layers"] <= 4
            else f"with 3 and 4 layers, extrapolated to {g['layers']} (--exact simulates all)"
        ),
    ]
    return "\n".join(lines)


def _launch_or_advice(plan) -> list[str]:
    """How to launch a plan that fits; for one that does not, no launch line but what would fit instead."""
    if plan.fits:
        return launch_lines(plan)
    return ["no launch line: this does not fit."] + [f"  {line}" for line in plan.advice]


def assumptions(plan) -> str:
    """What the verdict assumed, with the flags that change it."""
    host = (
        "host memory not checked"
        if plan.host_memory is None
        else f"{_gib(plan.host_memory)} GiB of host memory per node for offloaded checkpoints (--host-memory)"
    )
    return (
        f"{plan.headroom:.0%} of each GPU kept free, usable {_gib(plan.usable)} of {_gib(plan.gpu_memory)} GiB "
        f"(--headroom); {_overhead_assumption(plan)}; {host}"
    )


def _overhead_lines(plan) -> list[str]:
    """The rows between the tensors and the total: the predicted reserve and the allowance, or a flat margin."""
    m = plan.margin
    if m is not None:
        return [
            f"  {'margin':<12}{_gib(m.bytes(plan.tensor_peak)):>9}   {m.fraction:.0%} of tensors (allocator) + "
            f"{_gib(m.reserved)} GiB reserved (CUDA context, NCCL, workspaces): --margin, --reserved"
        ]
    fix = plan.correction
    how = (
        f"calibrated x{fix['factor']:.3f} (hf-upipe calibrate"
        f"{' --hollow-attention' if fix.get('hollow_attention') else ''}: measured "
        f"{_gib(fix['measured'])} GiB, predicted {_gib(fix['predicted'])} GiB)"
        if fix
        else "not calibrated (hf-upipe calibrate)"
    )
    return [
        f"  {'reserved':<12}{_gib(plan.predicted_reserved):>9}   the caching allocator's predicted reserve "
        f"({plan.allocator} segments), {how}",
        f"  {'allowance':<12}{_gib(plan.allowance):>9}   CUDA context, NCCL buffers, cuBLAS and attention "
        "workspaces",
    ]


def _overhead_assumption(plan) -> str:
    if plan.margin is not None:
        return (
            f"margin {plan.margin.fraction:.0%} of tensors + {_gib(plan.margin.reserved)} GiB "
            "(--margin, --reserved)"
        )
    return f"allocator reserve predicted for {plan.allocator} segments (--allocator)"


def launch_lines(plan) -> list[str]:
    cfg = plan.upipe_config()
    env = {
        "UPIPE_SP_SIZE": cfg.sp_size,
        "UPIPE_HEADS_PER_CHUNK": cfg.heads_per_chunk,
        "UPIPE_FUSED_ATTENTION": str(cfg.fused_attention).lower(),
        "UPIPE_TILED_MLP": str(cfg.tiled_mlp).lower(),
        "UPIPE_OFFLOAD": cfg.offload,
    }
    if cfg.offload == "disk":  # a placeholder: the user names a fast local disk
        env["UPIPE_OFFLOAD_PATH"] = "/path/to/nvme"
    if plan.allocator == "expandable":  # read once, when CUDA initialises: set before anything runs
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **env}
    else:
        env["UPIPE_ALLOCATOR"] = "default"
    if cfg.fused_attention and cfg.fused_backward != "recompute":
        env["UPIPE_FUSED_BACKWARD"] = cfg.fused_backward
    if cfg.overlap_comm:
        env["UPIPE_OVERLAP_COMM"] = "true"
    if cfg.model_offload != "none":
        env["UPIPE_MODEL_OFFLOAD"] = cfg.model_offload
    if cfg.ring_size > 1:
        env["UPIPE_RING_SIZE"] = cfg.ring_size
    for name in ("mlp_chunk_tokens", "loss_chunk_tokens"):
        if getattr(cfg, name):
            env[f"UPIPE_{name.upper()}"] = getattr(cfg, name)
    config_file = {1: "fsdp2_1node_8gpu.yaml", 2: "fsdp2_2nodes_8gpu.yaml"}.get(
        plan.nodes, "<your FSDP2 config>"
    )
    names = (
        [
            "sp_size",
            "heads_per_chunk",
            "fused_attention",
            "tiled_mlp",
            "offload",
            "mlp_chunk_tokens",
            "loss_chunk_tokens",
        ]
        + (["fused_backward"] if "UPIPE_FUSED_BACKWARD" in env else [])
        + (["overlap_comm"] if cfg.overlap_comm else [])
        + (["model_offload"] if cfg.model_offload != "none" else [])
        + (["ring_size"] if cfg.ring_size > 1 else [])
        + (["allocator"] if cfg.allocator != "expandable" else [])
    )
    fields = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in names if getattr(cfg, k) is not None)
    if cfg.offload == "disk":
        fields += ", offload_path='/path/to/nvme'"
    return [
        "launch: "
        + " ".join(f"{k}={v}" for k, v in env.items())
        + f" accelerate launch --config_file accelerate_configs/{config_file}"
        # model offload: accelerate's FSDP2 host offload, and a process group with a CPU backend (cuda:nccl,cpu:gloo)
        + (" --fsdp_offload_params true" if cfg.model_offload == "cpu" else "")
        + " your_script.py"
        + ("" if plan.settings.offload == "none" else "  (activation checkpointing on)"),
        f"or in Python: hf_upipe.UPipeConfig({fields})",
    ] + (
        [
            f"UPIPE_OFFLOAD_PATH (offload_path): a folder on a fast local disk (NVMe) with at least "
            f"{_gib(plan.disk_bytes_per_gpu)} GiB free per GPU ({_gib(plan.disk_bytes_per_gpu * plan.gpus)} GiB "
            "per node): /path/to/nvme is a placeholder"
        ]
        if cfg.offload == "disk"
        else []
    )
