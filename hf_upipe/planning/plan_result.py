"""What a plan found: the per-GPU memory of one training step, whether it fits, and how to launch it.

Entry points:
- `Plan`: per-GPU peak by category, the margin (or the allocator's predicted reserve and the allowance), fits or
  not, host memory for offload, the settings and how to launch them (`Plan.table()`, `Plan.launch()`,
  `Plan.upipe_config()`, `Plan.to_dict()`).
- `Margin`: what is added to the tensor peak for memory that tensor accounting cannot see.
- `host_bytes(config, settings, seq_len, sp_size, dtype)`: pinned host memory per GPU of offloaded checkpoints;
  `disk_bytes(...)`: the disk space per GPU of checkpoints offloaded to files (offload="disk").

`hf_upipe.planning.planner.plan` builds a `Plan`; `hf_upipe.planning.plan_report` formats one.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_upipe.models.architectures import model_geometry
from hf_upipe.planning.plan_report import format_plan, launch_lines
from hf_upipe.planning.step_time import GPU, H100_SXM, StepTime
from hf_upipe.planning.tracker import GiB
from hf_upipe.planning.train_step import StepSettings

__all__ = ["Margin", "Plan", "disk_bytes", "host_bytes"]


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
    # what fits instead, when it does not fit (hf_upipe.planning.no_fit: `hf-upipe plan` fills it)
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
