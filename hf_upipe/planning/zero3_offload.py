"""The peer's model state: DeepSpeed ZeRO-3 with the optimizer on the host, as DeepSpeed 0.19.8 holds it.

Entry points:
- `Zero3`: the ZeRO-3 settings the accounting reads; `ALST_ZERO3`, those of ALST's recipe (ArcticTraining's
  `projects/sequence-parallelism/run-h100-sp8-llama-8b.yml`: `stage: 3`, `offload_optimizer: {device: cpu}`,
  `optimizer: cpu_adam`, no `offload_param`, no bucket sizes set, so DeepSpeed's defaults).
- `param_counts(config, lora=None) -> ParamCounts`: the model's parameters, counted on the meta device (full
  depth; LoRA adapters counted from the target Linear layers' widths).
- `device_bytes(counts, world, zero=ALST_ZERO3) -> dict`: per GPU, by category, what ZeRO-3 keeps on the GPU for
  the whole step beyond the layers it gathers: "parameters": the bf16 parameter partitions (`lp_param_buffer`,
  and the frozen ones' `ds_tensor`), parameters of at most `param_persistence_threshold` elements also kept
  whole (gathered once, never released);
  "gradients": the reduce bucket (`ipg_buckets`, `reduce_bucket_size` elements of the bf16 communication dtype).
- `host_bytes(counts, world) -> int`: per GPU, the host memory of the trainable partitions: fp32 master weights,
  Adam's exp_avg and exp_avg_sq, the fp32 gradient (`fp32_partitioned_groups_flat[i].grad`) and the bf16
  gradient-accumulation buffer (`grad_partitions_flat_buffer`: the model dtype unless `grad_accum_dtype` is
  set), 4 + 4 + 4 + 4 + 2 = 18 bytes per parameter of the partition.

The planner (`hf_upipe.planning.planner.Estimator`) simulates the peer's step with the host offload of its model
state (FSDP2's `CPUOffloadPolicy`: every layer gathered from the host, its gradient reduced and sent to the host,
as ZeRO-3 gathers and reduces per layer) and adds `device_bytes` to the GPU's peak and reserve; `host_bytes`
replaces the simulated host peak. `hf_upipe.planning.step_time` prices CPU Adam as it prices hf_upipe's own model
offload, and the copies over the host link (`step_time.zero3_copy_bytes`).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "ALST_ZERO3",
    "HOST_BYTES_PER_PARAM",
    "ParamCounts",
    "Zero3",
    "device_bytes",
    "host_bytes",
    "param_counts",
]

# host bytes per trainable parameter of a GPU's partition (module docstring): fp32 master, exp_avg, exp_avg_sq,
# fp32 gradient, bf16 gradient-accumulation buffer
HOST_BYTES_PER_PARAM = 4 + 4 + 4 + 4 + 2


@dataclasses.dataclass(frozen=True)
class Zero3:
    """The ZeRO-3 settings the accounting reads (DeepSpeed 0.19.8's `DeepSpeedZeroConfig` defaults).

    Attributes:
        reduce_bucket_size: elements of the gradient reduce bucket (default 5e8).
        param_persistence_threshold: parameters of at most this many elements are not partitioned (1e5).
        comm_bytes: bytes per element of the bucket: the communication dtype, bf16 in a bf16 run (2).
        lp_bytes: bytes per element of the parameter partitions on the GPU, the model dtype (bf16: 2).
    """

    reduce_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 100_000
    comm_bytes: int = 2
    lp_bytes: int = 2


ALST_ZERO3 = Zero3()  # ALST's recipe sets no bucket sizes: DeepSpeed's defaults


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter sizes of a model (elements): `sizes` of every parameter (tied ones once), `trainable` the sizes
    of the trained ones (all of them for a full fine-tune, the LoRA adapters' A and B otherwise)."""

    sizes: tuple[int, ...]
    trainable: tuple[int, ...]


def _config_key(config) -> str:
    import json

    return (
        json.dumps(config, sort_keys=True) if isinstance(config, dict) else config.to_json_string()
    )


def param_counts(config, lora=None) -> ParamCounts:
    """The parameters of `config`'s model at its full depth (built on the meta device); `lora` = (rank, target
    module names): the base frozen, an A [r, in] and B [out, r] per Linear layer whose name ends in a target."""
    key = (_config_key(config), None if lora is None else (int(lora[0]), tuple(lora[1])))
    return _param_counts(key, config)


_COUNTS: dict = {}  # (config, lora) -> ParamCounts


def _param_counts(key, config) -> ParamCounts:
    if key in _COUNTS:
        return _COUNTS[key]
    import torch
    from transformers import AutoModelForCausalLM

    from hf_upipe.models.architectures import model_geometry
    from hf_upipe.planning.model_step import step_config

    layers = model_geometry(config)["layers"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(step_config(config, layers, 1))
    model.tie_weights()
    sizes = tuple(p.numel() for p in model.parameters())  # tied weights once
    lora = key[1]
    if lora is None:
        trainable = sizes
    else:
        rank, targets = lora
        trainable = tuple(
            n
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
            for n in (rank * m.in_features, m.out_features * rank)
        )
        sizes = sizes + trainable
    _COUNTS[key] = ParamCounts(sizes, trainable)
    return _COUNTS[key]


def _partition(numel: int, world: int) -> int:
    """Elements of one rank's partition of a parameter (`ds_tensor`: ceil(numel / world))."""
    return math.ceil(numel / world)


def device_bytes(counts: ParamCounts, world: int, zero: Zero3 = ALST_ZERO3) -> dict:
    """Per GPU, by category, the bytes ZeRO-3 holds on the GPU for the whole step (module docstring)."""
    t = zero.param_persistence_threshold
    # a persistent parameter stays gathered beside its partition
    partitions = sum((n if n <= t else 0) + _partition(n, world) for n in counts.sizes)
    return {
        "parameters": partitions * zero.lp_bytes,
        "gradients": zero.reduce_bucket_size * zero.comm_bytes if counts.trainable else 0,
    }


def host_bytes(counts: ParamCounts, world: int) -> int:
    """Per GPU, host bytes of the trainable partitions under `offload_optimizer: cpu` (module docstring)."""
    return HOST_BYTES_PER_PARAM * sum(_partition(n, world) for n in counts.trainable)
