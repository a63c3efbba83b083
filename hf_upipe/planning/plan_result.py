"""What a plan found: the per-GPU memory of one training step, whether it fits, and how to launch it.

Entry points:
- `Plan`: per-GPU peak by category, the margin (or the allocator's predicted reserve and the allowance), fits or
  not, host memory for offload, the settings and how to launch them (`Plan.table()`, `Plan.launch()`,
  `Plan.upipe_config()`, `Plan.to_dict()`).
- `Margin`: what is added to the tensor peak for memory that tensor accounting cannot see.
- `host_bytes(config, settings, seq_len, sp_size, dtype)`: pinned host memory per GPU of offloaded checkpoints;
  `disk_bytes(...)`: the disk space per GPU of checkpoints offloaded to files (offload="disk").
- `format_plan(plan)`: the text `hf-upipe plan` prints (`Plan.table()`); `launch_lines(plan)`: the environment
  variables / `UPipeConfig` to run the plan with (`Plan.launch()`); `describe(settings)`: one line naming settings.

`hf_upipe.planning.planner.plan` builds a `Plan`; the `hf-upipe plan` command is
`hf_upipe.planning.plan_command`. This module does not import the planner.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_upipe.models.architectures import model_geometry
from hf_upipe.planning.step_time import GPU, H100_SXM, StepTime
from hf_upipe.planning.tracker import GiB
from hf_upipe.planning.train_step import StepSettings
from hf_upipe.units import format_tokens

__all__ = [
    "LORA_TARGETS",
    "Margin",
    "Plan",
    "assumptions",
    "describe",
    "disk_bytes",
    "format_plan",
    "host_bytes",
    "launch_lines",
]


@dataclasses.dataclass(frozen=True)
class Margin:
    """Memory a GPU needs beyond the tracked tensors.

    Attributes:
        fraction: share of the tensor peak for the CUDA caching allocator's rounding and fragmentation (10%:
            blocks are rounded to 2 MiB / 512 B and freed blocks cannot always be reused for larger tensors).
        reserved: bytes that are not tensors at all: the CUDA context, NCCL's buffers, cuBLAS and attention-kernel
            workspaces (2 GiB).
    """

    fraction: float = 0.10
    reserved: int = 2 * GiB

    def __post_init__(self):
        if not 0 <= self.fraction < 1 or self.reserved < 0:
            raise ValueError(
                f"margin fraction must be in [0, 1) and reserved >= 0, got {self.fraction}, "
                f"{self.reserved}"
            )

    def bytes(self, tensor_peak: int) -> int:
        return int(tensor_peak * self.fraction) + self.reserved


def host_bytes(
    config, settings: StepSettings, seq_len: int, sp_size: int, dtype: torch.dtype
) -> int:
    """Pinned host memory per GPU for the offloaded layer inputs: all layers but the last, [s, hidden] each. 0 for
    offload="disk": its bytes are in files (`disk_bytes`); the host holds at most `max_pending` (2) layer inputs in
    flight to the disk, and the page cache the writes fill is reclaimable."""
    if settings.offload != "cpu":
        return 0
    return checkpoint_bytes(config, seq_len, sp_size, dtype)


def disk_bytes(
    config, settings: StepSettings, seq_len: int, sp_size: int, dtype: torch.dtype
) -> int:
    """Disk space per GPU for the offloaded layer inputs with offload="disk" (0 otherwise)."""
    if settings.offload != "disk":
        return 0
    return checkpoint_bytes(config, seq_len, sp_size, dtype)


def checkpoint_bytes(config, seq_len: int, sp_size: int, dtype: torch.dtype) -> int:
    """The offloaded layer inputs of one GPU: all layers but the last, [seq_len / sp_size, hidden] each."""
    g = model_geometry(config)
    return (g["layers"] - 1) * (seq_len // sp_size) * g["hidden"] * torch.finfo(dtype).bits // 8


@dataclasses.dataclass
class Plan:
    """The per-GPU memory of one training step at `seq_len` tokens with `settings` (bytes; see `table()`)."""

    model: str
    config: object
    seq_len: int
    gpus: int
    nodes: int
    sp_size: int
    gpu_memory: int
    settings: StepSettings
    by_category: dict
    # None: the allocator model (reserved, allowance); a Margin: tensors + margin
    margin: Margin | None
    dtype: torch.dtype = torch.bfloat16
    exact: bool = False
    seconds: float = 0.0
    max_seq_len: int | None = None
    # candidates judged at seq_len when the settings were chosen, fastest first: (settings, required bytes or None
    # when not simulated, host ok, predicted step seconds)
    tried: list = dataclasses.field(default_factory=list)
    host_memory: int | None = None  # per node; None: not checked
    lora: tuple | None = None  # (rank, target modules) of a LoRA plan
    headroom: float = 0.0  # share of each GPU kept free: required must stay within `usable`
    step_time: StepTime | None = (
        None  # predicted step time of `settings` (a model: `hf_upipe.planning.step_time`)
    )
    gpu: GPU = H100_SXM  # whose figures the step time uses
    notes: list = dataclasses.field(
        default_factory=list
    )  # what the reader should know about the choice
    reserved: int | None = None  # the allocator model's max_memory_reserved (before any correction)
    # CUDA context, NCCL, kernel workspaces (hf_upipe.planning.reserved.Allowance)
    allowance: int = 0
    allocator: str = "default"  # the allocator mode predicted ("default" or "expandable" segments)
    correction: dict | None = None  # the stored calibration applied (hf-upipe calibrate), or None
    model_host_bytes: int = (
        0  # host memory per GPU of the model's state (model_offload='cpu'), simulated
    )
    # what fits instead, when it does not fit (hf_upipe.planning.plan_command: `hf-upipe plan` fills it)
    advice: list = dataclasses.field(default_factory=list)

    @property
    def usable(self) -> int:
        """The GPU memory a plan may take: `gpu_memory` less the headroom."""
        return int(self.gpu_memory * (1 - self.headroom))

    @property
    def tensor_peak(self) -> int:
        return sum(self.by_category.values())

    @property
    def predicted_reserved(self) -> int | None:
        """The predicted reserve with the calibration's factor applied (None with a flat margin)."""
        if self.reserved is None:
            return None
        return int(self.reserved * (self.correction["factor"] if self.correction else 1.0))

    @property
    def required(self) -> int:
        if self.margin is not None:
            return self.tensor_peak + self.margin.bytes(self.tensor_peak)
        return self.predicted_reserved + self.allowance

    @property
    def host_fits(self) -> bool:
        per_gpu = self.host_bytes_per_gpu + self.model_host_bytes
        return self.host_memory is None or per_gpu * self.gpus <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.required <= self.usable and self.host_fits

    @property
    def disk_bytes_per_gpu(self) -> int:
        """Disk space the offloaded checkpointed inputs take per GPU with offload="disk" (0 otherwise)."""
        return disk_bytes(self.config, self.settings, self.seq_len, self.sp_size, self.dtype)

    @property
    def host_bytes_per_gpu(self) -> int:
        """Host memory the offloaded checkpointed inputs take per GPU (all layers but the last)."""
        return host_bytes(self.config, self.settings, self.seq_len, self.sp_size, self.dtype)

    def upipe_config(self):
        """The `hf_upipe.UPipeConfig` of these settings."""
        from hf_upipe.config import UPipeConfig

        s = self.settings
        return UPipeConfig(
            sp_size=self.sp_size,
            ring_size=s.ring_size,
            heads_per_chunk=s.heads_per_chunk or "all",
            fused_attention=s.impl == "fused",
            tiled_loss=s.tiled_loss,
            loss_chunk_tokens=s.loss_chunk_tokens,
            tiled_mlp=s.tiled_mlp,
            mlp_chunk_tokens=s.mlp_chunk_tokens,
            offload=s.offload,
            fused_backward=s.fused_backward,
            overlap_comm=s.overlap,
            model_offload=s.model_offload,
            allocator=self.allocator,
        )

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "seq_len": self.seq_len,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "sp_size": self.sp_size,
            "gpu_memory": self.gpu_memory,
            "settings": dataclasses.asdict(self.settings),
            "by_category": dict(self.by_category),
            "tensor_peak": self.tensor_peak,
            "margin": None if self.margin is None else self.margin.bytes(self.tensor_peak),
            "margin_fraction": None if self.margin is None else self.margin.fraction,
            "margin_reserved": None if self.margin is None else self.margin.reserved,
            "predicted_reserved": self.predicted_reserved,
            "reserved_model": self.reserved,
            "allowance": self.allowance if self.margin is None else None,
            "allocator": self.allocator,
            "correction": self.correction,
            "required": self.required,
            "fits": self.fits,
            "host_bytes_per_gpu": self.host_bytes_per_gpu,
            "model_host_bytes_per_gpu": self.model_host_bytes,
            "exact": self.exact,
            "seconds": self.seconds,
            "max_seq_len": self.max_seq_len,
            "dtype": str(self.dtype).replace("torch.", ""),
            "host_memory": self.host_memory,
            "host_fits": self.host_fits,
            "headroom": self.headroom,
            "usable": self.usable,
            "notes": list(self.notes),
            "advice": list(self.advice),
            "lora": None
            if self.lora is None
            else {"rank": self.lora[0], "targets": list(self.lora[1])},
            "predicted_step_seconds": None if self.step_time is None else self.step_time.seconds,
            "predicted_tokens_per_s_per_gpu": None
            if self.step_time is None
            else self.step_time.tokens_per_s_per_gpu,
            "step_time_gpu": self.gpu.name,
            "tried": [
                {
                    "settings": dataclasses.asdict(s),
                    "required": r,
                    "host_fits": h,
                    "predicted_seconds": t,
                }
                for s, r, h, t in self.tried
            ],
        }

    def table(self) -> str:
        return format_plan(self)

    def launch(self) -> str:
        return "\n".join(launch_lines(self))


# ---- how a Plan is shown: the per-GPU table and the launch lines
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


_ZERO3_ROWS = {  # DeepSpeed's Ulysses with ZeRO-3's host optimizer (hf_upipe.planning.zero3_offload)
    "parameters": "ZeRO-3 partitions ({compute}) + gathered layers and root ({compute})",
    "gradients": "ZeRO-3 reduce bucket ({compute}) + reduce-scatter buffers (as FSDP2's, fp32)",
}
_ZERO3_BUCKET = (
    "FSDP2 gradient shards (fp32) + reduce-scatter buffers + ZeRO-3 reduce bucket ({compute})"
)


def _row_labels(plan) -> list[tuple[str, str]]:
    """(category, what it holds) with the dtypes the simulation built: fp32 master weights, gradients and AdamW
    states (whatever the model's config says: the planner builds them in fp32), the compute dtype gathered; the
    peer's ZeRO-3 with its optimizer on the host holds its own."""
    compute = str(plan.dtype).replace("torch.", "")
    rows = [(n, _LORA_ROWS.get(n, w) if plan.lora else w) for n, w in _ROWS]
    if plan.settings.impl == "deepspeed" and plan.settings.model_offload == "cpu" and not plan.lora:
        rows = [(n, _ZERO3_ROWS.get(n, w)) for n, w in rows]
    elif plan.settings.impl == "deepspeed":
        # its model state (or LoRA's frozen base) on the GPU, as FSDP2's
        rows = [(n, _ZERO3_BUCKET if n == "gradients" else w) for n, w in rows]
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
    if settings.model_offload == "cpu" and settings.impl == "deepspeed":
        parts.append("ZeRO-3 optimizer on the host (offload_optimizer: cpu, CPU Adam)")
    elif settings.model_offload == "cpu":
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
    what = (
        "ZeRO-3's host optimizer: fp32 master weights, Adam's m and v, fp32 and bf16 gradient partitions"
        if plan.settings.impl == "deepspeed"
        else "model offload: fp32 parameter and gradient shards, AdamW's states and step"
    )
    return f"host memory for the model's state ({what}): {_gib(plan.model_host_bytes)} GiB per GPU{host}"


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
    if plan.fits and plan.settings.impl == "deepspeed":  # the peer: not an hf_upipe run
        return [
            "launch: none from hf_upipe: this plans the peer, DeepSpeed's Ulysses (UlyssesSPAttentionHF) under "
            "ZeRO-3"
            + (
                " with offload_optimizer: {device: cpu} and CPU Adam (ALST's recipe)"
                if plan.settings.model_offload == "cpu"
                else " with its model state on the GPU"
            )
        ]
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
