"""Before launch: will this sequence length fit, with which settings, and what is the longest that fits?

Entry points:
- `plan(model, *, gpus, gpu_memory, nodes=1, seq_len=None, max_context=False, settings=None, ...)`: a `Plan`.
- `Plan`: per-GPU peak by category, the margin, fits or not, host memory for offload, the settings and how to
  launch them (`Plan.table()`, `Plan.launch()`, `Plan.upipe_config()`, `Plan.to_dict()`).
- `Margin`: what is added to the tensor peak for memory that tensor accounting cannot see.
- `resolve_model(spec)`: a model name, a config.json, a local model folder or a Hub id -> (name, config).
- `ladder(config, sp_size, impl=None)`: the memory ladder, cheapest first; `candidates(...)`: it with the fused
  block's faster variants, each with the rung it adds memory to.

How a length is judged: `hf_upipe.planning.train_step` runs one FSDP2 training step of the real model code on fake
tensors in a fake world of gpus x nodes ranks (rank 0), with 3 and with 4 decoder layers; every category of the
peak is extrapolated linearly to the model's depth (exact: tests check the slope against deeper runs; `exact=True`
simulates every layer). Required = the caching allocator's predicted reserve (the simulated step's allocation trace
replayed through `hf_upipe.planning.caching_allocator`, `hf_upipe.planning.reserved` for the depth rule) times a
stored calibration factor if any, plus `Allowance` (CUDA context, NCCL, kernel workspaces); or, with a `Margin`,
tensor peak + margin. It fits when required <= usable = gpu_memory less the
headroom (5% by default: a length at the very edge is not recommended) and the offloaded checkpoints fit the host
memory of a node (2 TiB by default, a DGX H100's).

Choosing settings (`settings=None`): the memory ladder goes from cheapest to most memory-saving: all local heads in
one chunk (Ulysses speed), then the tiled MLP, then offloading checkpointed inputs to host memory, then ever smaller
head chunks down to the smallest the head geometry allows, then smaller MLP and loss tiles. For the fused block each
rung also comes in faster variants that take more memory: the save-mode backward, and with several stages the
overlapped all-to-alls. Every candidate gets a predicted step time (`hf_upipe.planning.step_time`, a model of FLOPs
and bytes on the GPU named by `gpu`), and they are judged fastest first: the first that fits is the fastest that
fits. A variant whose rung does not fit is not simulated (it needs at least the rung's memory). With `max_context`,
the longest length the last rung fits is searched (in steps of `step` tokens), then the fastest candidate that fits
that length is chosen. The sequence-parallel degree defaults to the GPUs of one node; FSDP2 shards the model over
all GPUs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from hf_upipe.architectures import ARCHITECTURES, model_geometry
from hf_upipe.integrations.fused import fused_unavailable
from hf_upipe.models import resolve
from hf_upipe.ops.head_layout import valid_sp_sizes
from hf_upipe.planning.ladder import candidates, default_impl, ladder
from hf_upipe.planning.plan_report import format_plan, launch_lines
from hf_upipe.planning.reserved import (
    Allowance,
    allocator_mode,
    correction_key,
    extrapolate_reserved,
    load_correction,
    step_reserved,
)
from hf_upipe.planning.step_time import GPU, H100_SXM, StepTime, step_time
from hf_upipe.planning.tracker import GiB
from hf_upipe.planning.train_step import CATEGORIES, StepSettings
from hf_upipe.units import parse_size

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_HOST_MEMORY",
    "Margin",
    "Plan",
    "candidates",
    "default_impl",
    "ladder",
    "parse_bytes",
    "plan",
    "resolve_model",
]

DEFAULT_HEADROOM = 0.05  # share of each GPU a plan keeps free beyond its margin (--headroom)
DEFAULT_HOST_MEMORY = (
    "2TiB"  # host memory of one node offloaded checkpoints may use (--host-memory): a DGX H100
)


def parse_bytes(value) -> int:
    """`hf_upipe.units.parse_size`: '80GiB', '80GB', '75.5 GiB' or an int of bytes; a bare number in text is refused."""
    return parse_size(value)


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


def resolve_model(spec):
    """(name, config): a name of `hf_upipe.models.model_names()`, a config.json, a local model folder, a Hub id,
    a transformers config, or a Llama geometry dict (`hf_upipe.models.resolve`)."""
    return resolve(spec)


def _host_bytes(
    config, settings: StepSettings, seq_len: int, sp_size: int, dtype: torch.dtype
) -> int:
    """Pinned host memory per GPU for the offloaded layer inputs: all layers but the last, [s, hidden] each."""
    if settings.offload == "none":
        return 0
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
        return self.host_memory is None or self.host_bytes_per_gpu * self.gpus <= self.host_memory

    @property
    def fits(self) -> bool:
        return self.required <= self.usable and self.host_fits

    @property
    def host_bytes_per_gpu(self) -> int:
        """Host memory the offloaded checkpointed inputs take per GPU (all layers but the last)."""
        return _host_bytes(self.config, self.settings, self.seq_len, self.sp_size, self.dtype)

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
            "exact": self.exact,
            "seconds": self.seconds,
            "max_seq_len": self.max_seq_len,
            "dtype": str(self.dtype).replace("torch.", ""),
            "host_memory": self.host_memory,
            "host_fits": self.host_fits,
            "headroom": self.headroom,
            "usable": self.usable,
            "notes": list(self.notes),
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


_SIMULATIONS: collections.OrderedDict = (
    collections.OrderedDict()
)  # simulation key -> by_category (LRU)
_CACHE_SIZE = 1024


def _config_key(config) -> str:
    return (
        json.dumps(config, sort_keys=True) if isinstance(config, dict) else config.to_json_string()
    )


class _Estimator:
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

    def reserved(self, settings: StepSettings, seq_len: int, mode: str) -> int:
        """The allocator's predicted `max_memory_reserved` (hf_upipe.planning.reserved: depth rule)."""
        if self.exact or self.layers <= 4:
            return self._step(settings, seq_len, self.layers)["reserved"][mode]
        peak = sum(self(settings, seq_len).values())  # simulates 3 layers, then 4
        four = self._step(settings, seq_len, 4)
        return extrapolate_reserved(four["reserved"][mode], four["peak"], peak)


def _search_max(required, limit: int, step: int, max_steps: int) -> int:
    """Largest k * step (1 <= k <= max_steps) with required(k * step) <= limit, or 0; required grows with length.

    Secant guesses on the near-linear required(length), kept inside the bracket [fits, does not fit]: a handful
    of evaluations.
    """
    points: dict[int, int] = {}
    lo, hi = (
        0,
        max_steps + 1,
    )  # lo fits (0: nothing yet), hi does not (max_steps + 1: beyond the search)
    k, order = min(max_steps, 8), []
    while hi - lo > 1:
        points[k] = required(k * step)
        order.append(k)
        lo, hi = (k, hi) if points[k] <= limit else (lo, k)
        if hi - lo <= 1:
            break
        if len(order) == 1:
            k = 2 * k if lo == k else k // 2
        else:
            a, b = order[-2:]
            k = (
                int(b + (limit - points[b]) * (b - a) / (points[b] - points[a]))
                if points[b] != points[a]
                else (lo + hi) // 2
            )
        if k in points:
            k = lo + 1 if k == lo else hi - 1 if k == hi else (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
    return lo * step


def plan(
    model,
    *,
    gpus: int,
    gpu_memory="80GiB",
    nodes: int = 1,
    seq_len: int | None = None,
    max_context: bool = False,
    settings: StepSettings | None = None,
    impl: str | None = None,
    sp_size: int | None = None,
    margin: Margin | None = None,
    dtype: torch.dtype = torch.bfloat16,
    step: int = 2**17,
    max_seq_len: int = 2**26,
    exact: bool = False,
    host_memory=DEFAULT_HOST_MEMORY,
    lora=None,
    headroom: float = DEFAULT_HEADROOM,
    gpu: GPU = H100_SXM,
    ring_size: int = 1,
    allocator: str | None = None,
) -> Plan:
    """Plan a training run (see the module docstring).

    Args:
        model: a preset ("llama3-8b", "qwen3-32b-shape", "llama3-70b"), a config.json, a local model folder, a
            transformers config, or a Llama geometry dict.
        gpus: GPUs per node. nodes: nodes (FSDP2 shards over gpus x nodes; SP defaults to one node's GPUs).
        gpu_memory: memory of one GPU ("80GiB", "80GB", bytes).
        seq_len: tokens per sequence to judge. max_context: search the longest that fits instead (or as well).
        settings: fixed `StepSettings`; None chooses them (the ladder). impl: the attention implementation of the
            ladder (None: fused where supported; "ulysses" for our Ulysses mode; "deepspeed" for the peer).
        sp_size: sequence-parallel degree (default: `gpus`, with a ring `gpus` x `ring_size`). margin: None (the
            default) predicts the caching allocator's reserve from the simulated trace plus `Allowance()`, with a
            stored calibration applied (`hf-upipe calibrate`); a `Margin` adds it to the tensor peak instead.
        allocator: "default" or "expandable" (segments); None: what `PYTORCH_CUDA_ALLOC_CONF` says.
        ring_size: R > 1 plans ring attention across R ring shards of the SP group (UPipe over sp_size / R ranks
            inside each, `hf_upipe.ops.ring`): the SP degree can then exceed what the heads allow.
        step: granularity of the max search, tokens. max_seq_len: where the search stops.
        exact: simulate every layer instead of extrapolating from 3 and 4.
        host_memory: host memory of one node for offloaded checkpoints (default "2TiB", a DGX H100's); None: not
            checked.
        headroom: share of each GPU that must stay free beyond the margin (default 5%): a length at the very edge
            of the memory is not recommended.
        gpu: the hardware figures of the predicted step time (`hf_upipe.planning.step_time.H100_SXM` by default).
        lora: None plans a full fine-tune (fp32 master weights, gradients and AdamW states for every parameter);
            (rank, target module names) plans LoRA: the frozen base in `dtype`, fp32 adapters, AdamW on them.

    Raises:
        ValueError: with the numbers and the fix, for sizes that cannot work (heads not dividing the SP degree, a
            length not divisible by it, neither seq_len nor max_context).
    """
    started = time.perf_counter()
    name, config = resolve_model(model)
    g = model_geometry(config)
    if gpus < 1 or nodes < 1:
        raise ValueError(f"gpus={gpus} and nodes={nodes} must be >= 1")
    if not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"ring_size={ring_size!r} must be a positive integer (1: no ring)")
    sp = gpus * ring_size if sp_size is None else sp_size
    world = gpus * nodes
    if world % sp:
        raise ValueError(
            f"sp_size={sp} does not divide the {world} GPUs; use a divisor such as {gpus}"
        )
    if sp % ring_size:
        raise ValueError(f"ring_size={ring_size} does not divide sp_size={sp}")
    if ring_size > 1 and (
        impl == "deepspeed" or (settings is not None and settings.impl == "deepspeed")
    ):
        raise ValueError("ring_size > 1 is hf_upipe's ring attention; DeepSpeed's Ulysses has none")
    u = sp // ring_size  # the ranks UPipe's heads split over
    if u not in valid_sp_sizes(g["heads"], g["kv_heads"], upto=u):
        raise ValueError(
            f"sp_size={sp}"
            + (f" / ring_size={ring_size} = {u} ranks per ring shard" if ring_size > 1 else "")
            + f" does not fit {g['heads']} query / {g['kv_heads']} k/v "
            f"heads; valid: {valid_sp_sizes(g['heads'], g['kv_heads'], upto=world)}"
        )
    unit = sp * (2 if ring_size > 1 else 1)  # a ring cuts the sequence into 2R equal chunks
    if seq_len is None and not max_context:
        raise ValueError(
            "give seq_len (does it fit, and with which settings?) or max_context=True (what fits?)"
        )
    if seq_len is not None and seq_len % unit:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by sp_size={sp}"
            f"{' x 2 (a ring cuts the sequence into 2 x ring_size chunks)' if ring_size > 1 else ''}; "
            f"round it to {seq_len // unit * unit}"
        )
    if not 0 <= headroom < 1:
        raise ValueError(
            f"headroom={headroom} must be a share of the GPU memory in [0, 1), e.g. 0.05"
        )
    gpu_bytes, allowance = parse_size(gpu_memory), Allowance()
    mode = allocator or allocator_mode()
    if mode not in ("default", "expandable"):
        raise ValueError(f"allocator={allocator!r}: choose 'default' or 'expandable' (segments)")
    limit = int(gpu_bytes * (1 - headroom))
    step = math.lcm(step, unit)
    estimate = _Estimator(config, world=world, sp_size=sp, dtype=dtype, exact=exact, lora=lora)
    if settings is not None:  # (the plan's ring, whatever the given settings say)
        pairs = [(dataclasses.replace(settings, ring_size=ring_size),) * 2]
    else:  # the ladder over the ranks UPipe's heads split over, each rung with the ring
        pairs = [
            (
                dataclasses.replace(c, ring_size=ring_size),
                dataclasses.replace(r, ring_size=ring_size),
            )
            for c, r in candidates(config, u, impl)
        ]
    rungs = [rung for cand, rung in pairs if cand == rung]

    host = None if host_memory is None else parse_size(host_memory)

    def correction(s):
        return load_correction(correction_key(name, s, mode, dtype)) if margin is None else None

    def required(s, length):
        if margin is not None:  # a flat margin over the tensors, as given
            peak = sum(estimate(s, length).values())
            return peak + margin.bytes(peak)
        fix = correction(s)
        reserved = estimate.reserved(s, length, mode) * (fix["factor"] if fix else 1.0)
        return int(reserved) + allowance.bytes(config, s, length, sp)

    def host_ok(s, length):
        return host is None or _host_bytes(config, s, length, sp, dtype) * gpus <= host

    def seconds(s, length):
        return step_time(
            config,
            s,
            seq_len=length,
            sp_size=sp,
            world=world,
            gpus_per_node=gpus,
            lora=estimate.lora,
            gpu=gpu,
        )

    longest = None
    if max_context:
        steps = max_seq_len // step
        per_step = (
            _host_bytes(config, rungs[-1], step, sp, dtype) * gpus
        )  # host memory is linear in the length
        if host is not None and per_step:
            steps = min(steps, host // per_step)
        longest = _search_max(lambda length: required(rungs[-1], length), limit, step, steps)
        if seq_len is None:
            seq_len = longest or step
    # fastest first (the ladder's order among equal times); the first that fits is the fastest that fits
    times = [seconds(cand, seq_len).seconds for cand, _ in pairs]
    tried, chosen, fits_of = [], rungs[-1], {}
    for k in sorted(range(len(pairs)), key=lambda k: (times[k], k)):
        (cand, rung), t = pairs[k], times[k]
        if rung != cand:
            if rung not in fits_of:
                fits_of[rung] = required(rung, seq_len) <= limit and host_ok(rung, seq_len)
            if not fits_of[rung]:
                tried.append(
                    (cand, None, host_ok(cand, seq_len), t)
                )  # needs more than its rung, which does not fit
                continue
        need, host_fits = required(cand, seq_len), host_ok(cand, seq_len)
        fits_of[cand] = need <= limit and host_fits
        tried.append((cand, need, host_fits, t))
        if fits_of[cand]:
            chosen = cand
            break
    arch, why = ARCHITECTURES.get(g["model_type"]), fused_unavailable(config)
    notes = (
        [f"the fused attention block is not planned: {why}"]
        if (chosen.impl == "upipe" and arch is not None and arch.fused and why is not None)
        else []
    )
    return Plan(
        model=name,
        config=config,
        seq_len=seq_len,
        gpus=gpus,
        nodes=nodes,
        sp_size=sp,
        gpu_memory=gpu_bytes,
        settings=chosen,
        by_category=estimate(chosen, seq_len),
        margin=margin,
        reserved=None if margin is not None else estimate.reserved(chosen, seq_len, mode),
        allowance=0 if margin is not None else allowance.bytes(config, chosen, seq_len, sp),
        allocator=mode,
        correction=correction(chosen),
        dtype=dtype,
        exact=exact,
        seconds=time.perf_counter() - started,
        max_seq_len=longest,
        tried=tried if settings is None else [],
        host_memory=host,
        lora=estimate.lora,
        headroom=headroom,
        step_time=seconds(chosen, seq_len),
        gpu=gpu,
        notes=notes,
    )
