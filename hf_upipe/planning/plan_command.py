"""`hf-upipe plan`: the command's flags and body (registered in `hf_upipe.cli`).

Entry points:
- `add_arguments(parser)`: the flags.
- `run(args)`: plans and prints the table (or JSON); exit 0 if it fits, 1 if not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from hf_upipe.planning.plan_report import LORA_TARGETS
from hf_upipe.planning.planner import Margin, default_impl, parse_bytes, plan, resolve_model
from hf_upipe.planning.train_step import StepSettings

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset (llama3-8b, qwen3-32b-shape, llama3-70b), a config.json or a local model folder")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU (default 80GiB)")
    parser.add_argument("--nodes", type=int, default=1)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--seq-len", type=int, help="tokens per sequence: does it fit, with which settings?")
    what.add_argument("--max", action="store_true", help="the longest sequence that fits, and its settings")
    parser.add_argument("--sp-size", type=int, help="sequence-parallel degree (default: --gpus)")
    parser.add_argument("--impl", choices=("fused", "upipe", "ulysses", "deepspeed"),
                        help="attention implementation (default: fused where supported); 'ulysses' plans our Ulysses "
                             "mode, 'deepspeed' the peer")
    parser.add_argument("--heads-per-chunk", help="fix the head chunk (a number or 'all') instead of choosing it")
    parser.add_argument("--tiled-mlp", choices=("true", "false"), help="fix the tiled MLP instead of choosing it")
    parser.add_argument("--offload", choices=("none", "cpu"), help="fix the offload instead of choosing it")
    parser.add_argument("--mlp-chunk-tokens", type=int)
    parser.add_argument("--loss-chunk-tokens", type=int)
    parser.add_argument("--margin", type=float, default=0.10, help="allocator share of the tensor peak (default 0.10)")
    parser.add_argument("--reserved", default="2GiB", help="non-tensor GPU memory (default 2GiB)")
    parser.add_argument("--step", type=int, default=2**17, help="granularity of --max, tokens (default 131072)")
    parser.add_argument("--exact", action="store_true", help="simulate every layer instead of extrapolating")
    parser.add_argument("--lora-rank", type=int, help="plan a LoRA fine-tune of this rank (default: full fine-tune)")
    parser.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                        help="comma-separated module names that get adapters (default: every projection)")
    parser.add_argument("--host-memory", help="host memory of one node for offloaded checkpoints, e.g. 2TiB "
                                              "(default: not checked)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _fixed_settings(args, config, sp_size):
    """StepSettings from the flags, or None to let the planner choose (no setting flag given)."""
    if all(getattr(args, k) is None for k in ("heads_per_chunk", "tiled_mlp", "offload", "mlp_chunk_tokens",
                                              "loss_chunk_tokens")):
        return None
    impl = args.impl or default_impl(config)
    hpc = args.heads_per_chunk or ("all" if impl in ("ulysses", "deepspeed") else "1")
    return StepSettings(impl=impl, heads_per_chunk=None if hpc == "all" else int(hpc),
                        tiled_mlp=args.tiled_mlp != "false", mlp_chunk_tokens=args.mlp_chunk_tokens,
                        loss_chunk_tokens=args.loss_chunk_tokens, offload=args.offload or "cpu")


def run(args: argparse.Namespace) -> int:
    try:
        _, config = resolve_model(args.model)
        result = plan(args.model, gpus=args.gpus,
                      gpu_memory=args.gpu_memory, nodes=args.nodes, seq_len=args.seq_len, max_context=args.max,
                      settings=_fixed_settings(args, config, args.sp_size or args.gpus), impl=args.impl,
                      sp_size=args.sp_size, margin=Margin(args.margin, parse_bytes(args.reserved)), step=args.step,
                      exact=args.exact, host_memory=args.host_memory,
                      lora=None if not args.lora_rank else (args.lora_rank, args.lora_targets.split(",")))
    except ValueError as err:
        print(f"hf-upipe plan: {err}")
        return 2
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.table())
    return 0 if result.fits else 1
