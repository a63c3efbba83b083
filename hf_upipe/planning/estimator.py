"""The per-GPU memory of one candidate at one length: simulated, cached, and extrapolated to the model's depth.

Entry points:
- `Estimator(config, *, world, sp_size, dtype, exact, lora=None)`: called with (settings, seq_len), the tensor peak
  by category; `Estimator.reserved(settings, seq_len, mode)`, the caching allocator's predicted reserve;
  `Estimator.host(settings, seq_len)`, the host memory of the model's state under model_offload='cpu' (0 else).

A simulation is one FSDP2 training step of the real model code on fake tensors in a fake world of `world` ranks
(`hf_upipe.planning.reserved.step_reserved`), with 3 and with 4 decoder layers; every category of the peak is
extrapolated linearly to the model's depth, and the reserve by the depth rule of `hf_upipe.planning.reserved`
(`exact=True`, or a model of at most 4 layers, simulates every layer). Simulations are cached per process (the same
model, world, settings and length give the same bytes; the 1024 most recently used are kept), so later plans
reuse them.
"""

from __future__ import annotations

import collections
import json

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from hf_upipe.models.architectures import model_geometry
from hf_upipe.planning.reserved import extrapolate_reserved, step_reserved
from hf_upipe.planning.train_step import CATEGORIES, StepSettings, device_twin

__all__ = ["Estimator"]


_SIMULATIONS: collections.OrderedDict = (
    collections.OrderedDict()
)  # simulation key -> step_reserved's result (LRU)
_CACHE_SIZE = 1024


def _config_key(config) -> str:
    return (
        json.dumps(config, sort_keys=True) if isinstance(config, dict) else config.to_json_string()
    )


class Estimator:
    """Per-category peaks of (settings, seq_len), extrapolated to the model's depth. Simulations are cached per
    process (the same model, world, settings and length give the same bytes), so later plans reuse them."""

    def __init__(
        self, config, *, world: int, sp_size: int, dtype: torch.dtype, exact: bool, lora=None
    ):
        self.config, self.world, self.sp_size, self.dtype, self.exact = (
            config,
            world,
            sp_size,
            dtype,
            exact,
        )
        self.lora = None if lora is None else (int(lora[0]), tuple(lora[1]))
        self.layers = model_geometry(config)["layers"]
        self._key = (_config_key(config), world, sp_size, str(dtype), self.lora)

    def _sim(self, settings, seq_len, layers) -> dict:
        return self._step(settings, seq_len, layers)["by_category"]

    def _step(self, settings, seq_len, layers) -> dict:
        settings = device_twin(settings)  # offload="disk" holds on the device what "cpu" does
        key = (*self._key, settings, seq_len, layers)
        if key in _SIMULATIONS:
            _SIMULATIONS.move_to_end(key)
        else:
            try:
                _SIMULATIONS[key] = step_reserved(
                    self.config,
                    settings,
                    seq_len=seq_len,
                    world_size=self.world,
                    sp_size=self.sp_size,
                    layers=layers,
                    dtype=self.dtype,
                    lora=self.lora,
                )
            except (DataDependentOutputException, DynamicOutputShapeException) as err:
                name = model_geometry(self.config)["model_type"]
                raise ValueError(
                    f"{name}: the planner runs the model's own code on fake tensors (shapes, no values), and this "
                    f"model's code needs values ({err.func}: e.g. routing tokens by value), so its memory cannot be "
                    "simulated. Measure a real step instead (hf_upipe.planning.measure_train_step on a small "
                    "world)."
                ) from None
            if len(_SIMULATIONS) > _CACHE_SIZE:
                _SIMULATIONS.popitem(last=False)
        return _SIMULATIONS[key]

    def __call__(self, settings: StepSettings, seq_len: int) -> dict:
        if self.exact or self.layers <= 4:
            return dict(self._sim(settings, seq_len, self.layers))
        c3, c4 = self._sim(settings, seq_len, 3), self._sim(settings, seq_len, 4)
        extra = self.layers - 4
        out = {c: c4.get(c, 0) + extra * (c4.get(c, 0) - c3.get(c, 0)) for c in CATEGORIES}
        return {c: v for c, v in out.items() if v}

    def host(self, settings: StepSettings, seq_len: int) -> int:
        """Host memory per GPU of the model's state with model_offload='cpu' (the simulated step's host peak:
        parameter and gradient shards, AdamW's states and its step), extrapolated to the depth; 0 without it."""
        if settings.model_offload == "none":
            return 0
        if self.exact or self.layers <= 4:
            return self._step(settings, seq_len, self.layers)["host_peak"]
        h3 = self._step(settings, seq_len, 3)["host_peak"]
        h4 = self._step(settings, seq_len, 4)["host_peak"]
        return h4 + (self.layers - 4) * (h4 - h3)

    def reserved(self, settings: StepSettings, seq_len: int, mode: str) -> int:
        """The allocator's predicted `max_memory_reserved` (hf_upipe.planning.reserved: depth rule)."""
        if self.exact or self.layers <= 4:
            return self._step(settings, seq_len, self.layers)["reserved"][mode]
        peak = sum(self(settings, seq_len).values())  # simulates 3 layers, then 4
        four = self._step(settings, seq_len, 4)
        return extrapolate_reserved(four["reserved"][mode], four["peak"], peak)
