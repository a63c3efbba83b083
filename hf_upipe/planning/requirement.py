"""What a candidate needs at a length: the GPU memory, with the margin or the allowance applied, and the host memory.

Entry points:
- `Requirement(name, estimate, *, margin, mode, gpus, host)`: called with (settings, length), the bytes a GPU must
  have; `Requirement.host_ok(settings, length)`: whether the offloaded checkpoints fit a node's host memory;
  `Requirement.reserved`, `Requirement.allowance_bytes` and `Requirement.correction`: the parts a `Plan` records.

GPU memory: with `margin=None`, the caching allocator's predicted reserve (`hf_upipe.planning.estimator.Estimator`)
times the stored calibration factor for this model, settings, allocator mode and dtype if any (`hf-upipe
calibrate`), plus `hf_upipe.planning.reserved.Allowance` (CUDA context, NCCL, kernel workspaces); with a `Margin`,
the tensor peak plus the margin.
"""

from __future__ import annotations

from hf_upipe.planning.estimator import Estimator
from hf_upipe.planning.plan_result import Margin, host_bytes
from hf_upipe.planning.reserved import Allowance, correction_key, load_correction
from hf_upipe.planning.train_step import StepSettings, device_twin

__all__ = ["Requirement"]


class Requirement:
    """The bytes a candidate needs of a GPU and of its node's host memory (see the module docstring).

    Args:
        name: the model's name (the calibration's key). estimate: its `Estimator` (whose config, SP degree and
            dtype these are).
        margin: None for the allocator model with `Allowance()`; a `Margin` over the tensor peak.
        mode: the allocator mode ("default" or "expandable"). gpus: GPUs per node. host: host memory of a node,
            bytes (None: not checked).
    """

    def __init__(
        self,
        name: str,
        estimate: Estimator,
        *,
        margin: Margin | None,
        mode: str,
        gpus: int,
        host: int | None,
    ):
        self.name, self.estimate, self.margin, self.mode = name, estimate, margin, mode
        self.gpus, self.host = gpus, host
        self.config, self.sp_size, self.dtype = estimate.config, estimate.sp_size, estimate.dtype
        self.allowance = Allowance()

    def correction(self, settings: StepSettings) -> dict | None:
        """The stored calibration of these settings (None with a margin, or when none is stored)."""
        if self.margin is not None:
            return None
        twin = device_twin(settings)  # offload="disk": the device memory (and calibration) of "cpu"
        return load_correction(correction_key(self.name, twin, self.mode, self.dtype))

    def __call__(self, settings: StepSettings, length: int) -> int:
        """The GPU memory `settings` need at `length` tokens, bytes."""
        if self.margin is not None:  # a flat margin over the tensors, as given
            peak = sum(self.estimate(settings, length).values())
            return peak + self.margin.bytes(peak)
        fix = self.correction(settings)
        factor = fix["factor"] if fix else 1.0
        reserved = self.estimate.reserved(settings, length, self.mode) * factor
        return int(reserved) + self.allowance_bytes(settings, length)

    def reserved(self, settings: StepSettings, length: int) -> int | None:
        """The allocator model's predicted reserve before any calibration (None with a margin)."""
        if self.margin is not None:
            return None
        return self.estimate.reserved(settings, length, self.mode)

    def allowance_bytes(self, settings: StepSettings, length: int) -> int:
        """`Allowance` of these settings at `length` tokens (0 with a margin, which includes it)."""
        if self.margin is not None:
            return 0
        return self.allowance.bytes(self.config, settings, length, self.sp_size)

    def host_ok(self, settings: StepSettings, length: int) -> bool:
        """Whether the offloaded checkpoints and model state (model_offload='cpu') of all of a node's GPUs fit its
        host memory."""
        if self.host is None:
            return True
        per_gpu = host_bytes(self.config, settings, length, self.sp_size, self.dtype)
        return (per_gpu + self.estimate.host(settings, length)) * self.gpus <= self.host
