"""`hf-upipe plan`: the command's flags and body (registered in `hf_upipe.cli`).

Entry points:
- `add_arguments(parser)`: the flags.
- `run(args)`: plans and prints the table (or JSON); exit 0 if it fits, 1 if not (no launch line then: the longest
  length that fits and what would fit the length asked, `advice`), 2 on bad input (the whole message on stderr;
  argparse reports bad flag values the same way). While it plans, a line on stderr for each length tried and
  each candidate judged, with the elapsed time (`hf_upipe.planning.progress`; off under `--json` unless
  `--progress`, and off with `--no-progress`).
- `advice(model, request, result)`: what a plan that does not fit says instead of a launch line, as lines for
  `Plan.advice`, from more plans of the same request (`request`: the `hf_upipe.planning.planner.PlanRequest`
  `result` was planned for; `result`: its `Plan`, which did not fit).

What `advice` tries: the longest length the same GPUs fit (`max_context=True`, the planner's own `--max`); then, at the
length asked, with the most memory-saving settings of the ladder (one candidate each: a rung that does not fit
rules out every faster one), twice and four times the nodes with a ring across them (`--nodes`, `--ring`), a LoRA
fine-tune of rank 16 instead of a full one, and expandable segments for the allocator. Each line names the flags;
`hf-upipe plan` with them then chooses the fastest settings that fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from hf_upipe.attention.fused import fused_unavailable
from hf_upipe.models.presets import model_names
from hf_upipe.planning.plan_result import LORA_TARGETS, describe
from hf_upipe.planning.planner import (
    DEFAULT_HEADROOM,
    DEFAULT_HOST_MEMORY,
    Margin,
    PlanRequest,
    candidates,
    default_impl,
    plan,
    resolve_model,
)
from hf_upipe.planning.progress import reporting
from hf_upipe.planning.tracker import GiB
from hf_upipe.planning.train_step import StepSettings
from hf_upipe.units import argument_type, format_tokens, parse_size, parse_tokens

__all__ = ["add_arguments", "advice", "run"]


def _host(text):
    return None if text.lower() in ("none", "unchecked") else parse_size(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `hf-upipe plan`, in the order `--help` lists them."""
    _add_model_and_hardware(parser)
    _add_parallelism(parser)
    _add_step_settings(parser)
    _add_memory(parser)
    _add_search_and_output(parser)


def _add_model_and_hardware(parser: argparse.ArgumentParser) -> None:
    """The model, the hardware and the length to judge (or --max)."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"a preset (a real model's published shape): {', '.join(model_names())}; a config.json or a "
        "local model folder; or a Hugging Face Hub id 'org/name' (its config is read from the Hub, which is said "
        "first); tiny test models: tiny-<model_type>, e.g. tiny-llama",
    )
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument(
        "--gpu-memory",
        default="80GiB",
        type=argument_type(parse_size),
        help="memory of one GPU with its unit: 80GiB, 80GB, 141GB (default 80GiB; a bare number is "
        "refused)",
    )
    parser.add_argument("--nodes", type=int, default=1)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--seq-len",
        type=argument_type(parse_tokens),
        help="tokens per sequence, e.g. 1048576, 1024K or 1M (K = 1024, M = 1048576): does it fit, "
        "with which settings?",
    )
    what.add_argument(
        "--max", action="store_true", help="the longest sequence that fits, and its settings"
    )


def _add_parallelism(parser: argparse.ArgumentParser) -> None:
    """The sequence-parallel layout and the attention implementation."""
    parser.add_argument(
        "--sp-size", type=int, help="sequence-parallel degree (default: --gpus, x --ring)"
    )
    parser.add_argument(
        "--ring",
        type=int,
        default=1,
        help="ring attention across this many ring shards of the SP group, UPipe inside each (e.g. "
        "--nodes 2 --ring 2: UPipe over a node's GPUs, a ring across the nodes; default 1)",
    )
    parser.add_argument(
        "--impl",
        choices=("fused", "upipe", "ulysses", "deepspeed"),
        help="attention implementation (default: fused where supported); 'ulysses' plans our Ulysses "
        "mode, 'deepspeed' the peer",
    )


def _add_step_settings(parser: argparse.ArgumentParser) -> None:
    """Fixed step settings instead of the planner's choice."""
    parser.add_argument(
        "--heads-per-chunk", help="fix the head chunk (a number or 'all') instead of choosing it"
    )
    parser.add_argument(
        "--tiled-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix the tiled MLP on or off instead of choosing it",
    )
    parser.add_argument(
        "--offload", choices=("none", "cpu", "disk"), help="fix the offload instead of choosing it"
    )
    parser.add_argument(
        "--fused-backward",
        choices=("recompute", "save"),
        help="fix the fused block's backward mode instead of choosing it",
    )
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix whether the fused block's all-to-alls are overlapped instead of choosing it",
    )
    parser.add_argument(
        "--model-offload",
        choices=("cpu", "none"),
        help="fix FSDP2's host offload of the parameter, gradient and optimizer shards (UPIPE_MODEL_OFFLOAD) "
        "instead of choosing it (default: chosen where nothing else fits, and for --max where it lengthens "
        "the fit at under 2%% of the predicted step)",
    )
    parser.add_argument("--mlp-chunk-tokens", type=int)
    parser.add_argument("--loss-chunk-tokens", type=int)


def _add_memory(parser: argparse.ArgumentParser) -> None:
    """What is added to the tensor peak, the headroom and the host memory."""
    parser.add_argument(
        "--allocator",
        choices=("default", "expandable"),
        help="the CUDA caching allocator's mode the reserve is predicted for, and the launch line sets "
        "(default: expandable, which hf_upipe sets before CUDA initialises; UPIPE_ALLOCATOR=default or keep "
        "changes it: keep plans for what PYTORCH_CUDA_ALLOC_CONF says)",
    )
    parser.add_argument(
        "--margin",
        type=float,
        help="instead of predicting the allocator's reserve: a flat share of the tensor peak (with --reserved)",
    )
    parser.add_argument(
        "--reserved",
        type=argument_type(parse_size),
        help="with --margin: non-tensor GPU memory (default 2GiB)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help=f"share of each GPU kept free beyond the margin (default {DEFAULT_HEADROOM}: a length at "
        "the very edge of memory is not recommended)",
    )
    parser.add_argument(
        "--host-memory",
        default=DEFAULT_HOST_MEMORY,
        type=argument_type(_host),
        help=f"host memory of one node for offloaded checkpoints and model state (default {DEFAULT_HOST_MEMORY}, a "
        "DGX H100's; 'none' to not check)",
    )


def _add_search_and_output(parser: argparse.ArgumentParser) -> None:
    """The --max search, the simulation, the kind of fine-tune and the output."""
    parser.add_argument(
        "--step",
        type=argument_type(parse_tokens),
        default=2**17,
        help="granularity of --max, tokens (default 128K)",
    )
    parser.add_argument(
        "--exact", action="store_true", help="simulate every layer instead of extrapolating"
    )
    parser.add_argument(
        "--lora-rank", type=int, help="plan a LoRA fine-tune of this rank (default: full fine-tune)"
    )
    parser.add_argument(
        "--lora-targets",
        default=",".join(LORA_TARGETS),
        help="comma-separated module names that get adapters (default: every projection)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a line on stderr for each length tried and each candidate judged, with the elapsed time "
        "(default: on, off with --json)",
    )


def _fixed_settings(args, config, sp_size):
    """StepSettings from the flags, or None to let the planner choose (no setting flag given)."""
    if all(
        getattr(args, k) is None
        for k in (
            "heads_per_chunk",
            "tiled_mlp",
            "offload",
            "mlp_chunk_tokens",
            "loss_chunk_tokens",
            "fused_backward",
            "overlap",
        )
    ):
        return None
    impl = args.impl or default_impl(config)
    hpc = args.heads_per_chunk or ("all" if impl in ("ulysses", "deepspeed") else "1")
    return StepSettings(
        impl=impl,
        heads_per_chunk=None if hpc == "all" else int(hpc),
        tiled_mlp=args.tiled_mlp is not False,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        loss_chunk_tokens=args.loss_chunk_tokens,
        offload=args.offload or "cpu",
        fused_backward=args.fused_backward or "recompute",
        overlap=bool(args.overlap),
    )


def _fused_flags_error(args, config) -> str | None:
    """The flags that ask for the fused block where this plan cannot use it, with why and the fix; else None.
    Only flags the user typed are named: the planner's own default (fused where a run installs it) never is."""
    why = fused_unavailable(config)
    if args.impl == "fused" and why is not None:
        return f"--impl fused: {why}. Plan the registered path: --impl upipe (or leave --impl out)."
    impl = args.impl or default_impl(config)
    flags = (["--overlap"] if args.overlap else []) + (
        [f"--fused-backward {args.fused_backward}"] if args.fused_backward is not None else []
    )
    if impl == "fused" or not flags:
        return None
    cause = (
        f"--impl {impl} plans another attention"
        if args.impl
        else f"without --impl the planner plans the registered 'upipe' path here, as a run would use it: {why}"
    )
    return (
        f"{' and '.join(flags)} {'is a setting' if len(flags) == 1 else 'are settings'} of the fused attention "
        f"block, which this plan does not use ({cause}). Leave {' and '.join(f.split()[0] for f in flags)} out."
    )


def run(args: argparse.Namespace) -> int:
    try:
        _, config = resolve_model(args.model)
        if (error := _fused_flags_error(args, config)) is not None:
            raise ValueError(error)
        request = PlanRequest(
            gpus=args.gpus,
            gpu_memory=args.gpu_memory,
            nodes=args.nodes,
            seq_len=args.seq_len,
            max_context=args.max,
            settings=_fixed_settings(args, config, args.sp_size or args.gpus),
            impl=args.impl,
            sp_size=args.sp_size,
            margin=None
            if args.margin is None and args.reserved is None
            else Margin(
                0.10 if args.margin is None else args.margin,
                2 * 2**30 if args.reserved is None else args.reserved,
            ),
            allocator=args.allocator,
            step=args.step,
            exact=args.exact,
            host_memory=args.host_memory,
            headroom=args.headroom,
            ring_size=args.ring,
            lora=None if not args.lora_rank else (args.lora_rank, args.lora_targets.split(",")),
            model_offload=args.model_offload,
        )
        shown = not args.json if args.progress is None else args.progress
        with reporting(sys.stderr) if shown else contextlib.nullcontext():
            result = plan(args.model, request)
            # no launch line on a no-fit: the longest that fits and what fits the length asked (not for --json:
            # auto settings' child stays quick)
            if not result.fits and not args.json:
                result.advice = advice(args.model, request, result)
    except ValueError as err:
        print(f"hf-upipe plan: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0 if result.fits else 1


# ---- what a plan that does not fit says instead of a launch line
_LORA = (16, LORA_TARGETS)


def _longest(model, request: PlanRequest) -> str:
    best = plan(model, request, seq_len=None, max_context=True)
    if not best.max_seq_len:
        return "nothing fits on these GPUs, not even the shortest step (--step)"
    return (
        f"longest that fits on these GPUs: {best.max_seq_len:,} tokens ({format_tokens(best.max_seq_len)}), "
        f"required {best.required / GiB:,.2f} GiB: hf-upipe plan ... --seq-len {format_tokens(best.max_seq_len)}"
    )


def _alternatives(request: PlanRequest) -> list[tuple[str, dict]]:
    """(flags, the `PlanRequest` fields they change) of what may fit the length asked."""
    nodes, ring = request.nodes, request.ring_size
    out = []
    if request.sp_size is None and request.impl != "deepspeed":
        for k in (2, 4):
            out.append(
                (
                    f"--nodes {nodes * k} --ring {ring * k}",
                    {"nodes": nodes * k, "ring_size": ring * k},
                )
            )
    if request.lora is None:
        out.append((f"--lora-rank {_LORA[0]}", {"lora": _LORA}))
    if request.allocator in (None, "default") and request.margin is None:
        out.append(
            (
                "--allocator expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
                {"allocator": "expandable"},
            )
        )
    return out


def advice(model, request: PlanRequest | dict, result) -> list[str]:
    """See the module docstring (`request`: the `PlanRequest` of `result`, or `plan`'s keywords as a dict).
    Alternatives that raise (e.g. a ring the heads or the model refuse) are skipped."""
    if isinstance(request, dict):
        request = PlanRequest(**request)
    lines = [_longest(model, request)]
    rung = result.settings if request.settings is not None else _last_rung(result, request.impl)
    fits = []
    for flags, change in _alternatives(request):
        try:
            p = plan(model, request, settings=rung, **change)
        except ValueError:
            continue
        if p.fits:
            fits.append(
                f"{flags} (required {p.required / GiB:,.2f} GiB with {describe(p.settings)})"
            )
    what = format_tokens(result.seq_len)
    lines.append(
        f"fits {what} with: " + "; or ".join(fits)
        if fits
        else f"{what} fits none of: more nodes with a ring (--nodes, --ring), LoRA, expandable segments"
    )
    return lines


def _last_rung(result, impl):
    """The most memory-saving settings the plan judged (the ladder's last rung)."""
    pairs = candidates(result.config, result.sp_size // result.settings.ring_size, impl)
    return [r for c, r in pairs if c == r][-1]
