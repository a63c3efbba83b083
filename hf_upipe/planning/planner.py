"""Before launch: will this sequence length fit, with which settings, and what is the longest that fits?

Entry points:
- `plan(model, request)` or `plan(model, *, gpus, gpu_memory, nodes=1, seq_len=None, max_context=False, ...)`: a
  `Plan`; `PlanRequest`: what a plan is asked (the keywords of `plan`).
- `Plan`: per-GPU peak by category, the margin, fits or not, host memory for offload, the settings and how to
  launch them (`Plan.table()`, `Plan.launch()`, `Plan.upipe_config()`, `Plan.to_dict()`).
- `Margin`: what is added to the tensor peak for memory that tensor accounting cannot see.
- `resolve_model(spec)`: a model name, a config.json, a local model folder or a Hub id -> (name, config).
- `ladder(config, sp_size, impl=None)`: the memory ladder, cheapest first; `candidates(...)`: it with the fused
  block's faster variants, each with the rung it adds memory to; `default_impl(config)`: "fused" where
  `prepare_model` would install the fused block, "upipe" otherwise.
- `Estimator(case, *, world, exact)`: for the `StepCase` `case` (the model and its depth, the SP degree, the dtype,
  the fine-tune), called with (settings, seq_len), the tensor peak by category; `Estimator.reserved(settings,
  seq_len, mode)`, the caching allocator's predicted reserve; `Estimator.host(settings, seq_len)`, the host
  memory of the model's state under model_offload='cpu' (0 else).
- `Requirement(name, estimate, *, margin, mode, gpus, host)`: called with (settings, length), the bytes a GPU must
  have (the margin or the allowance applied); `Requirement.host_ok(settings, length)`: whether the offloaded
  checkpoints fit a node's host memory.
- `search_max(required, limit, step, max_steps)`, `longest_fit(need, rung, ...)`, `fastest_fit(need, pairs, ...)`,
  `last_rung(pairs)`: the two searches (below).

This module is the planner's search: it checks the request, builds the candidates, estimates and judges them, and
puts the chosen one in a `Plan` (`hf_upipe.planning.plan_result`, which also formats it).

How a length is judged: `hf_upipe.planning.train_step` runs one FSDP2 training step of the real model code on fake
tensors in a fake world of gpus x nodes ranks (rank 0), with 3 and with 4 decoder layers; every category of the
peak is extrapolated linearly to the model's depth (exact: tests check the slope against deeper runs; `exact=True`
simulates every layer). Required = the caching allocator's predicted reserve (the simulated step's allocation trace
replayed through the allocator model of `hf_upipe.planning.reserved`, with its depth rule) times a
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

Model offload (`model_offload`; `StepSettings.model_offload`, FSDP2's host offload of the parameter, gradient and
optimizer shards): None (default) adds every candidate again with it, after the others, so it is chosen only
where nothing without it fits (it is slower: the AdamW step on the host). With `max_context` the longest length is
then searched with it; if it costs `MODEL_OFFLOAD_MAX_COST` (2%) of the predicted step or more there, the search
is redone without it. "cpu" or "none" fixes it. For DeepSpeed's Ulysses (the peer, `impl="deepspeed"`) "cpu" is
ZeRO-3's host optimizer (`offload_optimizer: cpu`, CPU Adam: `hf_upipe.planning.zero3_offload`), and it is the
default there, as ALST's recipe runs it; "none" plans the peer with its model state on the GPU.

One candidate's memory. A simulation is one FSDP2 training step of the real model code on fake tensors in a fake
world of `world` ranks (`hf_upipe.planning.reserved.step_reserved`), with 3 and with 4 decoder layers; every category
of the peak is extrapolated linearly to the model's depth, and the reserve by the depth rule of
`hf_upipe.planning.reserved` (`exact=True`, or a model of at most 4 layers, simulates every layer). Simulations are
cached per process (the same model, world, settings and length give the same bytes; the 1024 most recently used
are kept), so later plans reuse them.

What a candidate needs. With `margin=None`, the caching allocator's predicted reserve times the stored calibration
factor for this model, settings, allocator mode and dtype if any (`hf-upipe calibrate`), plus
`hf_upipe.planning.reserved.Allowance` (CUDA context, NCCL, kernel workspaces); with a `Margin`, the tensor peak
plus the margin.

The searches. `search_max` finds the largest multiple of `step` whose required bytes stay within `limit` (secant
guesses on the near-linear required(length), inside a bracket: a handful of evaluations); `longest_fit`, the
longest length a rung fits on the GPU and in the host memory (`--max`), 0 if none; `fastest_fit`, the fastest
candidate that fits a length, and what was judged on the way. Candidates are judged fastest first, so the first
that fits is the fastest that fits; a variant whose rung does not fit is not simulated (it needs at least the
rung's memory).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import time

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from hf_upipe.allocator import launch_mode
from hf_upipe.attention.fused import fused_unavailable
from hf_upipe.models.architectures import ARCHITECTURES, model_geometry
from hf_upipe.models.presets import resolve
from hf_upipe.ops.head_layout import valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.planning import zero3_offload as _zero3
from hf_upipe.planning.plan_result import Margin, Plan, describe, host_bytes
from hf_upipe.planning.progress import say
from hf_upipe.planning.reserved import (
    ROUND_LARGE,
    Allowance,
    correction_key,
    extrapolate_reserved,
    load_correction,
    step_reserved,
)
from hf_upipe.planning.step_time import GPU, H100_SXM, step_time
from hf_upipe.planning.train_step import CATEGORIES, StepCase, StepSettings, device_twin
from hf_upipe.units import format_tokens, parse_size, parse_tokens

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_HOST_MEMORY",
    "Estimator",
    "Margin",
    "Plan",
    "PlanRequest",
    "Requirement",
    "candidates",
    "default_impl",
    "fastest_fit",
    "ladder",
    "last_rung",
    "longest_fit",
    "parse_bytes",
    "plan",
    "resolve_model",
    "search_max",
]

DEFAULT_HEADROOM = 0.05  # share of each GPU a plan keeps free beyond its margin (--headroom)
MODEL_OFFLOAD_MAX_COST = (
    0.02  # the share of the predicted step model offload may cost when the planner chooses it
)
DEFAULT_HOST_MEMORY = (
    "2TiB"  # host memory of one node offloaded checkpoints may use (--host-memory): a DGX H100
)


def parse_bytes(value) -> int:
    """`hf_upipe.units.parse_size`: '80GiB', '80GB', '75.5 GiB' or an int of bytes; a bare number in text is refused."""
    return parse_size(value)


def resolve_model(spec):
    """(name, config): a name of `hf_upipe.models.presets.model_names()`, a config.json, a local model folder, a Hub id,
    a transformers config, or a Llama geometry dict (`hf_upipe.models.presets.resolve`)."""
    return resolve(spec)


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked: the hardware, the length (or the longest), the settings, how memory is predicted.

    Attributes:
        gpus: GPUs per node. nodes: nodes (FSDP2 shards over gpus x nodes; SP defaults to one node's GPUs).
        gpu_memory: memory of one GPU ("80GiB", "80GB", bytes).
        seq_len: tokens per sequence to judge (1048576, "1024K", "1M"). max_context: search the longest that fits
            instead (or as well).
        settings: fixed `StepSettings`; None chooses them (the ladder). impl: the attention implementation of the
            ladder (None: fused where supported; "ulysses" for our Ulysses mode; "deepspeed" for the peer).
        sp_size: sequence-parallel degree (default: `gpus`, with a ring `gpus` x `ring_size`). margin: None (the
            default) predicts the caching allocator's reserve from the simulated trace plus `Allowance()`, with a
            stored calibration applied (`hf-upipe calibrate`); a `Margin` adds it to the tensor peak instead.
        dtype: the compute dtype.
        step: granularity of the max search, tokens. max_seq_len: where the search stops.
        exact: simulate every layer instead of extrapolating from 3 and 4.
        host_memory: host memory of one node for offloaded checkpoints (default "2TiB", a DGX H100's); None: not
            checked.
        lora: None plans a full fine-tune (fp32 master weights, gradients and AdamW states for every parameter);
            (rank, target module names) plans LoRA: the frozen base in `dtype`, fp32 adapters, AdamW on them.
        headroom: share of each GPU that must stay free beyond the margin (default 5%): a length at the very edge
            of the memory is not recommended.
        gpu: the hardware figures of the predicted step time (`hf_upipe.planning.step_time.H100_SXM` by default).
        ring_size: R > 1 plans ring attention across R ring shards of the SP group (UPipe over sp_size / R ranks
            inside each, `hf_upipe.ops.ring`): the SP degree can then exceed what the heads allow.
        allocator: "default" or "expandable" (segments); None: the mode the launch runs in, the one the launch
            line sets (`UPIPE_ALLOCATOR`, default "expandable"; "keep": what `PYTORCH_CUDA_ALLOC_CONF` says;
            `hf_upipe.allocator.launch_mode`).
        model_offload: None lets the planner choose FSDP2's host offload of the model's state (the module
            docstring); "cpu" or "none" fixes it (also over given `settings`). DeepSpeed's Ulysses: ZeRO-3's host
            optimizer, "cpu" by default (ALST's recipe).
    """

    gpus: int
    gpu_memory: int | str = "80GiB"
    nodes: int = 1
    seq_len: int | str | None = None
    max_context: bool = False
    settings: StepSettings | None = None
    impl: str | None = None
    sp_size: int | None = None
    margin: Margin | None = None
    dtype: torch.dtype = torch.bfloat16
    step: int = 2**17
    max_seq_len: int = 2**26
    exact: bool = False
    host_memory: int | str | None = DEFAULT_HOST_MEMORY
    lora: tuple | None = None
    headroom: float = DEFAULT_HEADROOM
    gpu: GPU = H100_SXM
    ring_size: int = 1
    allocator: str | None = None
    model_offload: str | None = None

    def uses_deepspeed(self) -> bool:
        """Whether the plan is of DeepSpeed's Ulysses (by `impl` or by the fixed settings)."""
        return self.impl == "deepspeed" or (
            self.settings is not None and self.settings.impl == "deepspeed"
        )


def plan(model, request: PlanRequest | None = None, /, **options) -> Plan:
    """Plan a training run (see the module docstring).

    Args:
        model: a preset ("llama3-8b", "qwen3-32b-shape", "llama3-70b"), a config.json, a local model folder, a
            transformers config, or a Llama geometry dict.
        request: a `PlanRequest`; or none, and its fields as keywords: `plan("llama3-8b", gpus=8, seq_len="1M")`
            (keywords given with a request replace its fields).

    Raises:
        ValueError: with the numbers and the fix, for sizes that cannot work (heads not dividing the SP degree, a
            length not divisible by it, neither seq_len nor max_context).
    """
    started = time.perf_counter()
    if request is None:
        request = PlanRequest(**options)
    elif options:
        request = dataclasses.replace(request, **options)
    r = request
    # 1048576, "1024K" and "1M" alike
    seq_len = None if r.seq_len is None else parse_tokens(r.seq_len)
    name, config = resolve_model(model)
    _check_quantized(config, r.lora)
    sp, world, unit = _check_layout(config, r)
    _check_length(seq_len, r.max_context, unit=unit, sp=sp, ring_size=r.ring_size)
    gpu_bytes, limit, mode = _check_memory(r.gpu_memory, r.headroom, r.allocator)
    depth = model_geometry(config)["layers"]
    # the step each candidate is simulated as; each simulation sets its own length and depth
    case = StepCase(config, seq_len or 0, sp, depth, dtype=r.dtype, lora=r.lora)
    estimate = Estimator(case, world=world, exact=r.exact)
    model_offload = r.model_offload
    if r.settings is not None and model_offload is None:  # fixed settings: their own model_offload
        model_offload = r.settings.model_offload
    if model_offload is None and r.uses_deepspeed():
        # the peer as ALST runs it: ZeRO-3's host optimizer (`_with_model_offload`)
        model_offload = "cpu"
    pairs = _with_model_offload(
        _pairs(config, r.settings, sp // r.ring_size, r.impl, r.ring_size), model_offload
    )
    say(f"planning {name} on {r.nodes} x {r.gpus} GPUs: {len(pairs)} candidate settings")
    host = None if r.host_memory is None else parse_size(r.host_memory)
    need = Requirement(name, estimate, margin=r.margin, mode=mode, gpus=r.gpus, host=host)
    predict = functools.partial(  # the predicted step time of settings at a length
        step_time,
        config,
        sp_size=sp,
        world=world,
        gpus_per_node=r.gpus,
        lora=estimate.lora,
        gpu=r.gpu,
    )
    search = _Search(need, predict, limit, math.lcm(r.step, unit), r.max_seq_len)
    longest, length, chosen, tried = search(pairs, seq_len, r.max_context)
    cost = _model_offload_cost(predict, chosen, length)
    if (
        model_offload is None
        and r.max_context
        and cost is not None
        and cost >= MODEL_OFFLOAD_MAX_COST
    ):
        pairs = [
            p for p in pairs if p[0].model_offload == "none"
        ]  # too dear: the longest without it
        longest, length, chosen, tried = search(pairs, seq_len, r.max_context)
    seq_len = length
    notes = [] if cost is None else [_model_offload_note(cost, chosen)]
    return _plan_of(
        need,
        chosen,
        seq_len,
        nodes=r.nodes,
        gpu_memory=gpu_bytes,
        seconds=time.perf_counter() - started,
        max_seq_len=longest,
        tried=tried if r.settings is None else [],
        headroom=r.headroom,
        step_time=predict(chosen, seq_len=seq_len),
        gpu=r.gpu,
        extra_notes=notes,
    )


@dataclasses.dataclass(frozen=True)
class _Search:
    """The planner's search over (candidate, rung) pairs: what they need, their predicted step time, the bytes a
    GPU may use, the granularity of the longest-length search and where it stops."""

    need: Requirement
    predict: object
    limit: int
    step: int
    max_seq_len: int

    def __call__(self, pairs, seq_len, max_context):
        """(longest or None, the length judged, the fastest candidate that fits it, what was tried): with
        `max_context`, the longest length the last rung fits first (`seq_len`, if given, is judged instead)."""
        longest = None
        if max_context:
            longest = longest_fit(
                self.need,
                last_rung(pairs),
                limit=self.limit,
                step=self.step,
                max_seq_len=self.max_seq_len,
            )
            seq_len = longest or self.step if seq_len is None else seq_len
        chosen, tried = fastest_fit(
            self.need,
            pairs,
            lambda s, n: self.predict(s, seq_len=n).seconds,
            limit=self.limit,
            seq_len=seq_len,
        )
        return longest, seq_len, chosen, tried


def _with_model_offload(pairs: list, model_offload: str | None) -> list:
    """The (candidate, rung) pairs for `model_offload`: all with it ("cpu"), none ("none"), or (None: the planner
    chooses) each pair again with it after all the others. For DeepSpeed's peer "cpu" is ZeRO-3's host optimizer
    (`offload_optimizer: cpu`, `hf_upipe.planning.zero3_offload`), and None is "cpu": ALST's recipe runs it."""
    if model_offload not in (None, "none", "cpu"):
        raise ValueError(
            f"model_offload={model_offload!r}: choose 'none', 'cpu' or None (the planner chooses)"
        )

    def offloaded(pair):
        return tuple(dataclasses.replace(s, model_offload="cpu") for s in pair)

    if model_offload is None and any(c.impl == "deepspeed" for c, _ in pairs):
        model_offload = "cpu"  # the peer as ALST runs it
    if model_offload == "cpu":
        return [offloaded(p) for p in pairs]
    if model_offload == "none":
        return [tuple(dataclasses.replace(s, model_offload="none") for s in p) for p in pairs]
    return pairs + [offloaded(p) for p in pairs if p[0].model_offload == "none"]


def _model_offload_cost(predict, chosen: StepSettings, seq_len: int) -> float | None:
    """The share of the predicted step that model offload adds to `chosen` (None when it is not chosen)."""
    if chosen.model_offload != "cpu":
        return None
    with_it = predict(chosen, seq_len=seq_len).seconds
    without = predict(dataclasses.replace(chosen, model_offload="none"), seq_len=seq_len).seconds
    return with_it / without - 1


def _model_offload_note(cost: float, chosen: StepSettings) -> str:
    what = (
        "ZeRO-3's host optimizer (offload_optimizer: cpu, CPU Adam)"
        if chosen.impl == "deepspeed"
        else "FSDP2's host offload of the parameter, gradient and optimizer shards"
    )
    return f"model offload ({what}) costs a predicted {cost:.2%} of the step" + (
        "" if chosen.model_offload == "cpu" else "; not chosen (over 2%)"
    )


def _check_layout(config, request: PlanRequest) -> tuple[int, int, int]:
    """(SP degree, world size, the unit a length must be a multiple of), or ValueError with the numbers and the
    fix: the GPUs, the ring and the model's head geometry must fit together."""
    g = model_geometry(config)
    gpus, nodes, sp_size, ring_size = (
        request.gpus,
        request.nodes,
        request.sp_size,
        request.ring_size,
    )
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
    if ring_size > 1 and request.uses_deepspeed():
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
    return sp, world, unit


def _quantization(config) -> str | None:
    """The quantization a config's `quantization_config` names ("bitsandbytes 4-bit", "fp8", ...), else None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    q = (
        config.get("quantization_config")
        if isinstance(config, dict)
        else getattr(config, "quantization_config", None)
        or getattr(text, "quantization_config", None)
    )
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    bits = "4-bit" if q.get("load_in_4bit") else "8-bit" if q.get("load_in_8bit") else q.get("bits")
    return " ".join(str(x) for x in (q.get("quant_method", "quantized"), bits) if x)


def _check_quantized(config, lora) -> None:
    """A full fine-tune of a quantized config is refused: the planner builds the model from its config, in fp32
    master weights, which a quantized checkpoint's training does not hold (LoRA plans the base unquantized, in the
    compute dtype: an upper bound, said in the plan's notes)."""
    if lora is None and (q := _quantization(config)) is not None:
        raise ValueError(
            f"the model's config carries quantization_config ({q}): its weights cannot be fully fine-tuned "
            "quantized, and the planner would plan an unquantized model under its name. Plan a LoRA fine-tune "
            "(--lora-rank; the base is then planned unquantized, an upper bound), or remove quantization_config "
            "from the config.json to plan a full fine-tune of the unquantized model."
        )


def _check_length(seq_len, max_context: bool, *, unit: int, sp: int, ring_size: int) -> None:
    """A length to judge, a multiple of `unit`, or max_context (ValueError otherwise)."""
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


def _check_memory(gpu_memory, headroom: float, allocator: str | None) -> tuple[int, int, str]:
    """(bytes of one GPU, the bytes a plan may use of them, the allocator mode), or ValueError for a headroom
    outside [0, 1) or an unknown mode."""
    if not 0 <= headroom < 1:
        raise ValueError(
            f"headroom={headroom} must be a share of the GPU memory in [0, 1), e.g. 0.05"
        )
    gpu_bytes = parse_size(gpu_memory)
    mode = allocator or launch_mode()
    if mode not in ("default", "expandable"):
        raise ValueError(f"allocator={allocator!r}: choose 'default' or 'expandable' (segments)")
    return gpu_bytes, int(gpu_bytes * (1 - headroom)), mode


def _pairs(config, settings: StepSettings | None, heads_ranks: int, impl, ring_size: int) -> list:
    """(candidate, its rung) pairs with the plan's ring: the given settings alone, or the ladder's candidates over
    the `heads_ranks` ranks UPipe's heads split over (`candidates`)."""
    if settings is not None:  # (the plan's ring, whatever the given settings say)
        return [(dataclasses.replace(settings, ring_size=ring_size),) * 2]
    return [  # the ladder, each rung with the ring
        (
            dataclasses.replace(c, ring_size=ring_size),
            dataclasses.replace(r, ring_size=ring_size),
        )
        for c, r in candidates(config, heads_ranks, impl)
    ]


def _plan_of(need: Requirement, chosen: StepSettings, seq_len: int, **fields) -> Plan:
    """The `Plan` of `chosen` at `seq_len`: the fields `need` knows, a note if the fused block was not planned where
    the registry has one, and `fields` (the rest)."""
    g, config, estimate = model_geometry(need.config), need.config, need.estimate
    arch, why = ARCHITECTURES.get(g["model_type"]), fused_unavailable(config)
    notes = (
        [f"the fused attention block is not planned: {why}"]
        if (chosen.impl == "upipe" and arch is not None and arch.fused and why is not None)
        else []
    ) + fields.pop("extra_notes", [])
    if (q := _quantization(config)) is not None:  # (LoRA only: _check_quantized)
        notes.append(
            f"the base is quantized ({q}) and planned unquantized in {str(need.dtype).replace('torch.', '')}: "
            "its parameters are an upper bound"
        )
    return Plan(
        model=need.name,
        config=config,
        seq_len=seq_len,
        gpus=need.gpus,
        sp_size=need.sp_size,
        settings=chosen,
        by_category=estimate(chosen, seq_len),
        margin=need.margin,
        reserved=need.reserved(chosen, seq_len),
        allowance=need.allowance_bytes(chosen, seq_len),
        allocator=need.mode,
        correction=need.correction(chosen),
        dtype=need.dtype,
        exact=estimate.exact,
        host_memory=need.host,
        model_host_bytes=estimate.host(chosen, seq_len),
        lora=estimate.lora,
        notes=notes,
        **fields,
    )


# ---- the candidates: the memory ladder and the fused block's faster variants
def default_impl(config) -> str:
    """ "fused" where a run would install the fused block (`hf_upipe.attention.fused.fused_unavailable` is
    None), "upipe" (registered) otherwise: the planner plans what `prepare_model` will run."""
    return "fused" if fused_unavailable(config) is None else "upipe"


def ladder(config, sp_size: int, impl: str | None = None) -> list[StepSettings]:
    """The candidate settings for this model and SP degree, cheapest first (`hf_upipe.planning.planner`'s docstring),
    then each checkpoint-offload rung with offload="disk" (no host memory for the checkpoints).

    `impl`: None picks `default_impl(config)` (fused where a run installs the fused block); "ulysses" or "deepspeed"
    keep all heads in one chunk (their ladder has the tiled MLP and offload rungs only).
    """
    g = model_geometry(config)
    impl = impl or default_impl(config)
    rungs = [
        StepSettings(impl, None, tiled_mlp=False, offload="none"),
        StepSettings(impl, None, tiled_mlp=True, offload="none"),
        StepSettings(impl, None, tiled_mlp=True, offload="cpu"),
    ]
    if impl in ("ulysses", "deepspeed"):
        return rungs
    chunks = sorted(
        c
        for c in valid_heads_per_chunk(g["heads"], g["kv_heads"], sp_size)
        if c < g["heads"] // sp_size
    )
    rungs += [StepSettings(impl, c, tiled_mlp=True, offload="cpu") for c in reversed(chunks)]
    smallest = rungs[-1]
    rungs.append(
        dataclasses.replace(
            smallest,
            mlp_chunk_tokens=max(1, g["hidden"] // 4),
            loss_chunk_tokens=max(1, math.ceil(2**24 / g["vocab"])),
        )
    )  # 64 MiB fp32 logits
    # where the host memory binds: the offload rungs' checkpoints to disk, the same device memory as "cpu", judged
    # only after every "cpu" candidate (`fastest_fit`); the last rung is the smallest one's disk twin (`--max`)
    return rungs + [dataclasses.replace(r, offload="disk") for r in rungs if r.offload == "cpu"]


def candidates(
    config, sp_size: int, impl: str | None = None
) -> list[tuple[StepSettings, StepSettings]]:
    """(candidate, its memory rung): the ladder's rungs (their own rung), and for the fused block each rung's faster
    variants, which need at least the rung's memory: the save-mode backward, and where a rung has several stages
    the overlapped all-to-alls, in both backward modes."""
    g = model_geometry(config)
    out = []
    for rung in ladder(config, sp_size, impl):
        out.append((rung, rung))
        if rung.impl != "fused":
            continue
        stages = g["heads"] // sp_size // (rung.heads_per_chunk or g["heads"] // sp_size)
        out.append((dataclasses.replace(rung, fused_backward="save"), rung))
        if stages > 1:
            out += [
                (dataclasses.replace(rung, overlap=True), rung),
                (dataclasses.replace(rung, fused_backward="save", overlap=True), rung),
            ]
    return out


# ---- one candidate's memory at one length: simulated, cached, extrapolated to the depth
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
    process (the same model, world, settings and length give the same bytes), so later plans reuse them.

    Args:
        case: the step the peaks are of (`StepCase`): the model, the SP degree, the dtype, the fine-tune and the
            kernel; `case.layers` is the depth the peaks are extrapolated to, and each simulation runs its own
            sequence length and depth in place of `case.seq_len` and `case.layers`.
        world: the ranks of the simulated step; exact: simulate every layer instead of extrapolating from 3 and 4.
    """

    def __init__(self, case: StepCase, *, world: int, exact: bool):
        lora = None if case.lora is None else (int(case.lora[0]), tuple(case.lora[1]))
        self.case = dataclasses.replace(case, lora=lora)
        self.config, self.sp_size, self.dtype, self.lora = (
            case.model_config,
            case.sp_size,
            case.dtype,
            lora,
        )
        self.world, self.exact, self.layers = world, exact, case.layers
        self._key = (_config_key(self.config), world, self.sp_size, str(self.dtype), lora)
        if case.kernel != "auto":
            self._key += (case.kernel,)

    def _sim(self, settings, seq_len, layers) -> dict:
        return self._step(settings, seq_len, layers)["by_category"]

    def _step(self, settings, seq_len, layers) -> dict:
        settings = device_twin(settings)  # offload="disk" holds on the device what "cpu" does
        if settings.impl == "deepspeed" and self.lora is not None:
            # ZeRO-3's host optimizer leaves a frozen base on the GPU, gathered from there: the step without it
            settings = dataclasses.replace(settings, model_offload="none")
        key = (*self._key, settings, seq_len, layers)
        if key in _SIMULATIONS:
            _SIMULATIONS.move_to_end(key)
        else:
            try:
                case = dataclasses.replace(self.case, seq_len=seq_len, layers=layers)
                _SIMULATIONS[key] = step_reserved(case, settings, world_size=self.world)
            except (DataDependentOutputException, DynamicOutputShapeException) as err:
                name = model_geometry(self.config)["model_type"]
                raise ValueError(
                    f"{name}: the planner runs the model's own code on fake tensors (shapes, no values), and this "
                    f"model's code needs values ({err.func}: e.g. routing tokens by value), so its memory cannot be "
                    "simulated. Measure a real step instead (hf_upipe.planning.train_step.measure_train_step on a "
                    "small world)."
                ) from None
            if len(_SIMULATIONS) > _CACHE_SIZE:
                _SIMULATIONS.popitem(last=False)
        return _SIMULATIONS[key]

    def __call__(self, settings: StepSettings, seq_len: int) -> dict:
        out = self._simulated(settings, seq_len)
        # the peer's ZeRO-3 buffers (host optimizer)
        for c, v in self._zero3_device(settings).items():
            out[c] = out.get(c, 0) + v
        return {c: v for c, v in out.items() if v}

    def _simulated(self, settings: StepSettings, seq_len: int) -> dict:
        if self.exact or self.layers <= 4:
            return dict(self._sim(settings, seq_len, self.layers))
        c3, c4 = self._sim(settings, seq_len, 3), self._sim(settings, seq_len, 4)
        extra = self.layers - 4
        out = {c: c4.get(c, 0) + extra * (c4.get(c, 0) - c3.get(c, 0)) for c in CATEGORIES}
        return {c: v for c, v in out.items() if v}

    def _zero3_device(self, settings: StepSettings) -> dict:
        """DeepSpeed's Ulysses (`zero3_offload`): what ZeRO-3 keeps on the GPU beside the simulated step. Its
        reduce bucket always; with model_offload='cpu' (its host optimizer; the step simulated with FSDP2's host
        offload) its bf16 partitions too, except under LoRA, whose step keeps the frozen base's shards on the GPU
        (`_step`; the adapters' fp32 shards and AdamW states, under 0.1 GiB for an 8B model, stay counted there
        too). {} for hf_upipe's impls."""
        if settings.impl != "deepspeed":
            return {}
        out = _zero3.device_bytes(_zero3.param_counts(self.config, self.lora), self.world)
        if settings.model_offload != "cpu" or self.lora is not None:
            out.pop("parameters")  # the simulated step holds them (FSDP2's shards)
        return out

    def host(self, settings: StepSettings, seq_len: int) -> int:
        """Host memory per GPU of the model's state with model_offload='cpu' (the simulated step's host peak:
        parameter and gradient shards, AdamW's states and its step), extrapolated to the depth; for DeepSpeed's
        Ulysses ZeRO-3's trainable partitions on the host (`zero3_offload.host_bytes`); 0 without it."""
        if settings.model_offload == "none":
            return 0
        if settings.impl == "deepspeed":
            return _zero3.host_bytes(_zero3.param_counts(self.config, self.lora), self.world)
        if self.exact or self.layers <= 4:
            return self._step(settings, seq_len, self.layers)["host_peak"]
        h3 = self._step(settings, seq_len, 3)["host_peak"]
        h4 = self._step(settings, seq_len, 4)["host_peak"]
        return h4 + (self.layers - 4) * (h4 - h3)

    def reserved(self, settings: StepSettings, seq_len: int, mode: str) -> int:
        """The allocator's predicted `max_memory_reserved` (hf_upipe.planning.reserved: depth rule), with the
        peer's ZeRO-3 buffers (allocated before the step, never freed) in 2 MiB pages of their own."""
        extra = sum(
            -(-n // ROUND_LARGE) * ROUND_LARGE for n in self._zero3_device(settings).values()
        )
        if self.exact or self.layers <= 4:
            return self._step(settings, seq_len, self.layers)["reserved"][mode] + extra
        peak = sum(self._simulated(settings, seq_len).values())  # simulates 3 layers, then 4
        four = self._step(settings, seq_len, 4)
        return extrapolate_reserved(four["reserved"][mode], four["peak"], peak) + extra


# ---- what a candidate needs of a GPU and of its node's host memory
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


# ---- the two searches: the longest length that fits, the fastest settings that fit one
def search_max(required, limit: int, step: int, max_steps: int) -> int:
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


def last_rung(pairs: list) -> StepSettings:
    """The last rung of (candidate, rung) pairs: the most memory-saving settings."""
    return [rung for cand, rung in pairs if cand == rung][-1]


def _fallback(need: Requirement, pairs: list, seq_len: int) -> StepSettings:
    """What a plan reports when nothing fits: the last rung without disk offload, unless its checkpoints do not fit
    the host memory (then the last rung)."""
    kept = [p for p in pairs if p[0].offload != "disk"]
    rung = last_rung(kept) if kept else last_rung(pairs)
    return rung if need.host_ok(rung, seq_len) else last_rung(pairs)


def longest_fit(
    need: Requirement, rung: StepSettings, *, limit: int, step: int, max_seq_len: int
) -> int:
    """The longest multiple of `step` (up to `max_seq_len`) at which `rung` needs at most `limit` bytes of GPU memory
    and its offloaded checkpoints (and model state, model_offload='cpu') fit the host memory; 0 if not even `step`
    fits."""
    steps = max_seq_len // step
    per_step = (
        host_bytes(need.config, rung, step, need.sp_size, need.dtype) * need.gpus
    )  # host memory is linear in the length
    fixed = (
        need.estimate.host(rung, step) * need.gpus
    )  # the model's state: the same at every length
    if need.host is not None and (per_step or fixed):
        steps = min(steps, max(0, need.host - fixed) // per_step if per_step else steps)
        steps = 0 if fixed > need.host else steps

    def required(length: int) -> int:
        say(
            f"longest length: trying {format_tokens(length)} tokens (the most memory-saving settings)"
        )
        return need(rung, length)

    return search_max(required, limit, step, steps)


def fastest_fit(
    need: Requirement, pairs: list, seconds, *, limit: int, seq_len: int
) -> tuple[StepSettings, list]:
    """(chosen settings, tried) at `seq_len`: `pairs` are (candidate, its rung); `seconds(settings, seq_len)`, a
    candidate's predicted step seconds.

    The first that fits, fastest first (the ladder's order among equal times), is chosen, candidates with
    offload="disk" judged only after all others (they are chosen only where the host memory binds); if none fits,
    the last rung (the last without disk where that one's checkpoints fit the host). `tried`: (settings, required
    bytes or None when not simulated, host ok, seconds) of each judged; a candidate whose host memory does not fit
    is not simulated.
    """
    say(f"predicting the step time of {len(pairs)} candidates at {format_tokens(seq_len)} tokens")
    times = [seconds(cand, seq_len) for cand, _ in pairs]
    tried, chosen, fits_of = [], _fallback(need, pairs, seq_len), {}
    disk = [cand.offload == "disk" for cand, _ in pairs]
    for i, k in enumerate(sorted(range(len(pairs)), key=lambda k: (disk[k], times[k], k))):
        (cand, rung), t = pairs[k], times[k]
        say(
            f"candidate {i + 1} of {len(pairs)} at {format_tokens(seq_len)} tokens: {describe(cand)}"
        )
        if not need.host_ok(cand, seq_len):
            fits_of[cand] = False
            tried.append((cand, None, False, t))  # its offloaded bytes do not fit the host
            continue
        if rung != cand:
            if rung not in fits_of:
                fits_of[rung] = need(rung, seq_len) <= limit and need.host_ok(rung, seq_len)
            if not fits_of[rung]:
                tried.append(
                    (cand, None, need.host_ok(cand, seq_len), t)
                )  # needs more than its rung, which does not fit
                continue
        required, host_fits = need(cand, seq_len), need.host_ok(cand, seq_len)
        fits_of[cand] = required <= limit and host_fits
        tried.append((cand, required, host_fits, t))
        if fits_of[cand]:
            chosen = cand
            break
    return chosen, tried
