"""Predicted GPU memory of a training step: what the CUDA caching allocator reserves, plus what it cannot see.

Entry points:

* `step_reserved(model_config, settings, *, seq_len, world_size, sp_size, layers, ...) -> dict`: simulates the step
  (`hf_upipe.planning.alloc_trace.record_step_trace`), replays its trace through the allocator model in both modes
  (`hf_upipe.planning.caching_allocator.replay`) and returns the tensor peak by category with
  ``reserved = {"default": bytes, "expandable": bytes}``.
* `extrapolate_reserved(reserved_4, peak_4, peak_L)`: the reserve of a deeper model (see below).
* `Allowance`: the bytes the simulation cannot see, as stated constants and per-kernel functions; its attention
  term is `unseen_rate(impl, heads)` bytes per token of one kernel call (`UNSEEN_PER_TOKEN`, `UNSEEN_BASE`:
  measured on an H100), over `kernel_call_tokens(config, settings, seq_len)` tokens (one tile of the tiled
  backward, `hf_upipe.ops.tiled_backward`, where it applies).
* `allocator_mode()`: "expandable" when `PYTORCH_CUDA_ALLOC_CONF` asks for expandable segments, else "default".
* `calibration_file()`, `load_correction(key)`, `save_correction(key, measured, predicted)`: the correction that
  `hf-upipe calibrate` measures on a GPU and `hf-upipe plan` applies.

Depth. A trace of 3 and 4 layers is simulated; a deeper model adds, per layer, only persistent sharded state
(parameters, gradients, AdamW states: allocated before the step, each in its own large segment) while the step's
transient working set is the same for every layer. So the reserve of L layers is the 4-layer reserve plus the
extra tensor bytes: ``reserved(L) = reserved(4) + peak(L) - peak(4)``. For Llama3-8B at 256K tokens on 8 GPUs
this gives 29.49 GiB (default) and 29.25 GiB (expandable) for 32 layers, against 29.54 and 29.01 GiB from
replaying the full 32-layer trace (`exact=True`). A straight line through the 3- and 4-layer reserves is not
used: fragmentation makes them non-monotonic (18.82 GiB for 3 layers, 18.12 GiB for 4).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from hf_upipe.allocator import conf_mode
from hf_upipe.planning.alloc_trace import record_step_trace
from hf_upipe.planning.caching_allocator import replay

__all__ = [
    "UNSEEN_BASE",
    "UNSEEN_PER_TOKEN",
    "Allowance",
    "allocator_mode",
    "calibration_file",
    "extrapolate_reserved",
    "kernel_call_tokens",
    "load_correction",
    "save_correction",
    "step_reserved",
    "unseen_rate",
]

MiB, GiB = 2**20, 2**30
MODES = ("default", "expandable")


def allocator_mode(env: str | None = None) -> str:
    """The allocator mode that `PYTORCH_CUDA_ALLOC_CONF` (or `env`) selects."""
    return conf_mode(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if env is None else env)


def step_reserved(model_config, settings, **kw) -> dict:
    """Tensor peak by category and the allocator's predicted reserve, in both modes (see the module docstring)."""
    events, result = record_step_trace(model_config, settings, **kw)
    return {
        "by_category": result["by_category"],
        "peak": result["peak"],
        "host_peak": result.get(
            "host_peak", 0
        ),  # model_offload='cpu': the model's state in host memory
        "reserved": {mode: replay(events, mode == "expandable").max_reserved for mode in MODES},
    }


def extrapolate_reserved(reserved_4: int, peak_4: int, peak_l: int) -> int:
    """The reserve of a deeper model: the 4-layer reserve plus the extra (persistent) tensor bytes."""
    return reserved_4 + peak_l - peak_4


# Bytes the attention block allocates on the GPU beyond the tensors the simulation counts, per token of the
# sequence its kernel sees, at head_dim 128 (`benchmarks/results/gpu/memory_blocks.json`, H100, torch 2.11, cuDNN
# up to 512K tokens and the flash kernel above: max_memory_allocated minus the tracked tensor peak, at 512K and 1M
# tokens). Every row is 16 MiB + rate x tokens to the byte; the rates are per implementation and heads per stage.
UNSEEN_PER_TOKEN = {
    ("fused", 1): 2501,  # the fused block, both backward modes
    ("upipe", 1): 2629,
    ("upipe", 2): 2121,
    ("upipe", 4): 3153,  # our Ulysses mode: all 4 local heads in one stage
    ("deepspeed", 4): 4929,  # DeepSpeed's Ulysses around sdpa
}
UNSEEN_BASE = {"deepspeed": 304 * MiB}  # the other rows' 16 MiB is within the cuBLAS allowance


def unseen_rate(impl: str, heads: int) -> float:
    """Bytes per token (head_dim 128) for `heads` per stage: the measured rate where there is one, else the line
    through our block's measured extremes (2629 at 1 head, 3153 at 4: above every measured rate of 1 to 4 heads),
    or DeepSpeed's measured 4 heads scaled by heads."""
    if impl == "deepspeed":
        return UNSEEN_PER_TOKEN.get((impl, heads), UNSEEN_PER_TOKEN[("deepspeed", 4)] * heads / 4)
    measured = UNSEEN_PER_TOKEN.get(("fused" if impl.startswith("fused") else "upipe", heads))
    if measured is not None:
        return measured
    lo, hi = UNSEEN_PER_TOKEN[("upipe", 1)], UNSEEN_PER_TOKEN[("upipe", 4)]
    return lo + (hi - lo) * (heads - 1) / 3


@dataclasses.dataclass(frozen=True)
class Allowance:
    """GPU memory outside the simulated tensors, added to the predicted reserve.

    Attributes:
        context: the CUDA context and the libraries' handles, outside the caching allocator (measured on an H100
            with CUDA 13.0 and torch 2.11: 843 MiB, `benchmarks/results/gpu/memory_step_*.json`
            "calibration.context_bytes"; 0.85 GiB here).
        nccl: NCCL's communication buffers, allocated by NCCL outside the caching allocator (not measured: the GPU
            runs used a fake process group); 1 GiB, a stated allowance for 8 GPUs per node.
        cublas_per_stream: cuBLAS workspace per stream that runs matmuls, through the caching allocator (torch's
            default on Hopper, `CUBLAS_WORKSPACE_CONFIG=:4096:8`: 32 MiB); the step's matmuls run on one stream.
    """

    context: int = int(0.85 * GiB)
    nccl: int = 1 * GiB
    cublas_per_stream: int = 32 * MiB

    def attention_workspace(self, config, settings, seq_len: int, sp_size: int) -> int:
        """What the attention kernels allocate beyond the simulated tensors (their scratch, invisible to the
        tracker): `unseen_rate` bytes per token of one kernel call, scaled by head_dim / 128, plus DeepSpeed's
        measured constant. A call covers the sequence the kernel sees (the ring's shard), or one tile of
        `kernel_call_tokens` where hf_upipe tiles the backward."""
        from hf_upipe.models.architectures import model_geometry

        g = model_geometry(config)
        heads = g["heads"] // sp_size if settings.impl in ("ulysses", "deepspeed") else None
        if heads is None:
            heads = settings.heads_per_chunk or g["heads"] // sp_size
        head_dim = _get(config, "head_dim") or g["hidden"] // g["heads"]
        rate = unseen_rate(settings.impl, heads) * head_dim / 128
        tokens = kernel_call_tokens(config, settings, seq_len)
        return int(tokens * rate) + UNSEEN_BASE.get(settings.impl, 0)

    def bytes(self, config, settings, seq_len: int, sp_size: int, device_only: bool = False) -> int:
        """Everything added to the reserve; `device_only`: only what a single-GPU measurement holds in its
        reserve (workspaces), for comparing with `max_memory_reserved`."""
        work = self.cublas_per_stream + self.attention_workspace(config, settings, seq_len, sp_size)
        return work if device_only else work + self.context + self.nccl


def kernel_call_tokens(config, settings, seq_len: int) -> int:
    """Tokens of the longest attention backward call: the sequence the kernel sees (the ring's shard), or one tile of
    `hf_upipe.ops.tiled_backward.backward_block()` for hf_upipe's impls on plain causal attention (the tiles'
    fp32 accumulators are simulated tensors). DeepSpeed's attention and models whose attention goes through a
    wrapping kernel (a sliding window, soft-capped scores, chunked attention) are not tiled. The forward kernels
    are taken to allocate nothing beyond their output and log-sum-exp (both simulated)."""
    from hf_upipe.ops.tiled_backward import backward_block

    tokens = seq_len // max(1, settings.ring_size)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    types = _get(config, "layer_types")
    if isinstance(types, (list, tuple)):  # transformers' per-layer kinds say where a window applies
        window = any(t != "full_attention" for t in types)
    else:
        window = (
            bool(_get(config, "sliding_window")) and _get(config, "use_sliding_window") is not False
        )
    wrapped = window or any(
        _get(config, n) for n in ("attn_logit_softcapping", "attention_chunk_size")
    )
    block = backward_block()
    if settings.impl == "deepspeed" or wrapped or block <= 0:
        return tokens
    return min(tokens, block)


def _get(config, name: str):
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def calibration_file() -> str:
    folder = os.environ.get("HF_UPIPE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hf_upipe"
    )
    return os.path.join(folder, "calibration.json")


def _read() -> dict:
    try:
        with open(calibration_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def load_correction(key: str) -> dict | None:
    """The stored correction for `key` (`{"factor", "measured", "predicted", ...}`), or None."""
    return _read().get(key)


def save_correction(key: str, measured: int, predicted: int, **info) -> dict:
    """Stores measured / predicted reserve for `key` (the planner multiplies its prediction by it)."""
    if measured <= 0 or predicted <= 0:
        raise ValueError(f"measured={measured} and predicted={predicted} must be positive bytes")
    data = _read()
    data[key] = dict(factor=measured / predicted, measured=measured, predicted=predicted, **info)
    os.makedirs(os.path.dirname(calibration_file()), exist_ok=True)
    with open(calibration_file(), "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return data[key]


def correction_key(model_name: str, settings, mode: str, dtype: torch.dtype) -> str:
    """The calibration's key: model, settings that shape the step, allocator mode, dtype."""
    fields = ",".join(f"{k}={v}" for k, v in sorted(dataclasses.asdict(settings).items()))
    return f"{model_name}|{fields}|{mode}|{dtype}"
