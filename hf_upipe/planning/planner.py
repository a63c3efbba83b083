"""Before launch: will this sequence length fit, with which settings, and what is the longest that fits?

Entry points:
- `plan(model, *, gpus, gpu_memory, nodes=1, seq_len=None, max_context=False, settings=None, ...)`: a `Plan`.
- `Plan`: per-GPU peak by category, the margin, fits or not, host memory for offload, the settings and how to
  launch them (`Plan.table()`, `Plan.launch()`, `Plan.upipe_config()`, `Plan.to_dict()`).
- `Margin`: what is added to the tensor peak for memory that tensor accounting cannot see.
- `resolve_model(spec)`: a model name, a config.json, a local model folder or a Hub id -> (name, config).
- `ladder(config, sp_size, impl=None)`: the memory ladder, cheapest first; `candidates(...)`: it with the fused
  block's faster variants, each with the rung it adds memory to.

Where the parts live: `Plan` and `Margin` in `hf_upipe.planning.plan_result`; the simulation of one candidate in
`hf_upipe.planning.estimator`; what a candidate needs (margin or allowance applied) in
`hf_upipe.planning.requirement`; the searches in `hf_upipe.planning.fit_search`; the candidates in
`hf_upipe.planning.ladder`. This module checks the request and puts them together.

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

Model offload (`model_offload`; `StepSettings.model_offload`, FSDP2's host offload of the parameter, gradient and
optimizer shards): None (default) adds every candidate again with it, after the others, so it is chosen only
where nothing without it fits (it is slower: the AdamW step on the host). With `max_context` the longest length is
then searched with it; if it costs `MODEL_OFFLOAD_MAX_COST` (2%) of the predicted step or more there, the search
is redone without it. "cpu" or "none" fixes it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from hf_upipe.allocator import launch_mode
from hf_upipe.attention.fused import fused_unavailable
from hf_upipe.models.architectures import ARCHITECTURES, model_geometry
from hf_upipe.models.presets import resolve
from hf_upipe.ops.head_layout import valid_sp_sizes
from hf_upipe.planning.estimator import Estimator
from hf_upipe.planning.fit_search import fastest_fit, last_rung, longest_fit
from hf_upipe.planning.ladder import candidates, default_impl, ladder
from hf_upipe.planning.plan_result import Margin, Plan
from hf_upipe.planning.requirement import Requirement
from hf_upipe.planning.step_time import GPU, H100_SXM, step_time
from hf_upipe.planning.train_step import StepSettings
from hf_upipe.units import parse_size, parse_tokens

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


def plan(
    model,
    *,
    gpus: int,
    gpu_memory="80GiB",
    nodes: int = 1,
    seq_len: int | str | None = None,
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
    model_offload: str | None = None,
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
        allocator: "default" or "expandable" (segments); None: the mode the launch runs in, the one the launch
            line sets (`UPIPE_ALLOCATOR`, default "expandable"; "keep": what `PYTORCH_CUDA_ALLOC_CONF` says;
            `hf_upipe.allocator.launch_mode`).
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
        model_offload: None lets the planner choose FSDP2's host offload of the model's state (the module
            docstring); "cpu" or "none" fixes it (also over given `settings`).

    Raises:
        ValueError: with the numbers and the fix, for sizes that cannot work (heads not dividing the SP degree, a
            length not divisible by it, neither seq_len nor max_context).
    """
    started = time.perf_counter()
    seq_len = None if seq_len is None else parse_tokens(seq_len)  # 1048576, "1024K" and "1M" alike
    name, config = resolve_model(model)
    _check_quantized(config, lora)
    sp, world, unit = _check_layout(config, gpus, nodes, sp_size, ring_size, impl, settings)
    _check_length(seq_len, max_context, unit=unit, sp=sp, ring_size=ring_size)
    gpu_bytes, limit, mode = _check_memory(gpu_memory, headroom, allocator)
    estimate = Estimator(config, world=world, sp_size=sp, dtype=dtype, exact=exact, lora=lora)
    if settings is not None and model_offload is None:  # fixed settings: their own model_offload
        model_offload = settings.model_offload
    pairs = _with_model_offload(
        _pairs(config, settings, sp // ring_size, impl, ring_size), model_offload
    )
    host = None if host_memory is None else parse_size(host_memory)
    need = Requirement(name, estimate, margin=margin, mode=mode, gpus=gpus, host=host)
    predict = functools.partial(  # the predicted step time of settings at a length
        step_time, config, sp_size=sp, world=world, gpus_per_node=gpus, lora=estimate.lora, gpu=gpu
    )
    search = functools.partial(
        _search,
        need,
        predict=predict,
        limit=limit,
        step=math.lcm(step, unit),
        max_seq_len=max_seq_len,
    )
    longest, length, chosen, tried = search(pairs, seq_len, max_context)
    cost = _model_offload_cost(predict, chosen, length)
    if (
        model_offload is None
        and max_context
        and cost is not None
        and cost >= MODEL_OFFLOAD_MAX_COST
    ):
        pairs = [
            p for p in pairs if p[0].model_offload == "none"
        ]  # too dear: the longest without it
        longest, length, chosen, tried = search(pairs, seq_len, max_context)
    seq_len = length
    notes = [] if cost is None else [_model_offload_note(cost, chosen)]
    return _plan_of(
        need,
        chosen,
        seq_len,
        nodes=nodes,
        gpu_memory=gpu_bytes,
        seconds=time.perf_counter() - started,
        max_seq_len=longest,
        tried=tried if settings is None else [],
        headroom=headroom,
        step_time=predict(chosen, seq_len=seq_len),
        gpu=gpu,
        extra_notes=notes,
    )


def _search(need, pairs, seq_len, max_context, *, predict, limit, step, max_seq_len):
    """(longest or None, the length judged, the fastest candidate that fits it, what was tried): with
    `max_context`, the longest length the last rung fits first (`seq_len`, if given, is judged instead)."""
    longest = None
    if max_context:
        longest = longest_fit(
            need, last_rung(pairs), limit=limit, step=step, max_seq_len=max_seq_len
        )
        seq_len = longest or step if seq_len is None else seq_len
    chosen, tried = fastest_fit(
        need, pairs, lambda s, n: predict(s, seq_len=n).seconds, limit=limit, seq_len=seq_len
    )
    return longest, seq_len, chosen, tried


def _with_model_offload(pairs: list, model_offload: str | None) -> list:
    """The (candidate, rung) pairs for `model_offload`: all with it ("cpu"), none ("none"), or (None: the planner
    chooses) each pair again with it after all the others; never for DeepSpeed's peer (ZeRO-3 runs it)."""
    if model_offload not in (None, "none", "cpu"):
        raise ValueError(
            f"model_offload={model_offload!r}: choose 'none', 'cpu' or None (the planner chooses)"
        )

    def offloaded(pair):
        return tuple(dataclasses.replace(s, model_offload="cpu") for s in pair)

    deepspeed = any(c.impl == "deepspeed" for c, _ in pairs)
    if model_offload == "cpu" and deepspeed:
        raise ValueError(
            "model_offload='cpu' is FSDP2's host offload; DeepSpeed's Ulysses runs under ZeRO-3, whose own "
            "offload this planner does not model: leave --model-offload out with --impl deepspeed."
        )
    if model_offload == "cpu":
        return [offloaded(p) for p in pairs]
    if model_offload == "none" or deepspeed:
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
    return (
        f"model offload (FSDP2's host offload of the parameter, gradient and optimizer shards) costs a predicted "
        f"{cost:.2%} of the step"
        + ("" if chosen.model_offload == "cpu" else "; not chosen (over 2%)")
    )


def _check_layout(config, gpus, nodes, sp_size, ring_size, impl, settings) -> tuple[int, int, int]:
    """(SP degree, world size, the unit a length must be a multiple of), or ValueError with the numbers and the
    fix: the GPUs, the ring and the model's head geometry must fit together."""
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
    the `heads_ranks` ranks UPipe's heads split over (`hf_upipe.planning.ladder.candidates`)."""
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
