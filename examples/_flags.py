"""The examples' flags, checked before torch, transformers or hf_upipe is imported (this module imports none).

Entry points:
- `add_common_flags(ap, help_of, kernels)`: the flags the two fine-tuning examples share (`_common` adds the
  settings' help and the kernels' names; without them, as `preflight` parses, any kernel name passes here).
- `grpo_flags(ap)`: the GRPO example's flags.
- `check_flags(args, example)`: impossible values refused with a `ValueError` naming the flag and what it takes.
- `run_dir(args, example)`: the run's folder; an earlier run there is refused without --overwrite or --resume.
- `latest_checkpoint(output_dir, example)` / `finished(args, output_dir, example)`: the newest checkpoint of a
  run, and the one line a `--resume` of a run already at `--steps` prints instead of training again.
- `preflight(argv, example)`: what a script runs first, as `__main__`: a bad flag or an earlier run is one line
  `error: ...` on stderr and exit status 2, a resume with nothing to train one line and exit status 0, before the
  heavy imports and before anything is written; `--help` is left to the script's full parser. Under a launcher
  only the first rank (`RANK` 0) prints, and every rank exits half a second later, together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

EXAMPLES = ("long_context", "trainer", "trl", "grpo_passkey")
RESUMABLE_HELP = (
    "a checkpoint folder, or 'latest' (a run already at --steps is left as it is: raise --steps)"
)


def add_common_flags(ap, help_of=lambda name: "", kernels=None) -> None:
    flag = argparse.BooleanOptionalAction
    ap.add_argument(
        "--model",
        default=None,
        help="config.json or local model dir (default: a tiny 1-layer Llama)",
    )
    ap.add_argument(
        "--data",
        default=None,
        help="local .txt, or .json/.jsonl whose records have a 'text' field "
        "(examples/sample.jsonl); default: the built-in passkey task",
    )
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per row (default 1024)")
    ap.add_argument(
        "--rows", type=int, default=512, help="training rows of the built-in passkey task"
    )
    ap.add_argument(
        "--eval-rows",
        type=int,
        default=32,
        help="held-out passkey rows the accuracy is measured on",
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate (default 1.5e-3)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=30,
        help="linear warmup steps, then cosine decay to 10%% of --lr",
    )
    ap.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="gradient clipping (default 1.0)"
    )
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument(
        "--full", action=flag, default=False, help="full fine-tune instead of LoRA through PEFT"
    )
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument(
        "--checkpointing",
        action=flag,
        default=False,
        help="activation checkpointing (non-reentrant)",
    )
    _run_flags(ap, "runs/<example>-<lora|full>")
    ap.add_argument(
        "--log-json", default=None, help="write the per-step losses and the accuracy here (rank 0)"
    )
    _settings_flags(ap, help_of, kernels)


def _run_flags(ap, default_dir: str) -> None:
    """--output-dir, --overwrite, --save-every, --resume, --seed: where a run goes and how it continues."""
    ap.add_argument(
        "--output-dir",
        default=None,
        help=f"the run's folder (default: {default_dir}); an earlier run there is refused unless "
        "--overwrite or --resume",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run in --output-dir before training (default: refuse to overwrite it)",
    )
    ap.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)"
    )
    ap.add_argument("--resume", default=None, help=RESUMABLE_HELP)
    ap.add_argument("--seed", type=int, default=0)


def _settings_flags(ap, help_of, kernels) -> None:
    """The UPipe settings' flags (each falls back to its UPIPE_* variable, then the built-in default)."""
    flag = argparse.BooleanOptionalAction
    defaults = " (default: UPIPE_{} or the built-in default)"
    ap.add_argument(
        "--sp-size", type=int, default=None, help=help_of("sp_size") + defaults.format("SP_SIZE")
    )
    ap.add_argument(
        "--heads-per-chunk",
        type=_heads_per_chunk,
        default=None,
        help=help_of("heads_per_chunk")
        + " A number or 'all'."
        + defaults.format("HEADS_PER_CHUNK"),
    )
    ap.add_argument(
        "--kernel",
        choices=None if kernels is None else ["auto", *kernels],
        default=None,
        help=help_of("kernel") + defaults.format("KERNEL"),
    )
    ap.add_argument(
        "--tiled-mlp",
        action=flag,
        default=None,
        help=help_of("tiled_mlp") + defaults.format("TILED_MLP"),
    )
    ap.add_argument(
        "--offload",
        choices=["none", "cpu", "disk"],
        default=None,
        help=help_of("offload") + " Needs --checkpointing." + defaults.format("OFFLOAD"),
    )
    ap.add_argument(
        "--offload-path",
        default=None,
        help=help_of("offload_path") + defaults.format("OFFLOAD_PATH"),
    )


def _heads_per_chunk(text: str):
    if text.lower() == "all":
        return "all"
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number nor 'all'")


def trainer_flags(ap) -> None:
    """The Trainer example's own flags: --trl, --report-to."""
    ap.add_argument(
        "--trl",
        action="store_true",
        help="train with TRL's SFTTrainer (hf_upipe.trl.UPipeSFTTrainer, an SFTConfig); needs trl",
    )
    ap.add_argument(
        "--report-to",
        nargs="+",
        default=["none"],
        help="the Trainer's trackers: none, all, or names such as tensorboard wandb (installed separately; "
        "default: none)",
    )


def grpo_flags(ap) -> None:
    """The GRPO example's flags."""
    ap.add_argument("--steps", type=int, default=300, help="GRPO optimizer steps (default 300)")
    ap.add_argument("--prompt-len", type=int, default=64, help="bytes per prompt (default 64)")
    ap.add_argument(
        "--prompts-per-step", type=int, default=8, help="new prompts per step (default 8)"
    )
    ap.add_argument(
        "--num-generations", type=int, default=8, help="answers sampled per prompt (default 8)"
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    ap.add_argument(
        "--format-steps",
        type=int,
        default=40,
        help="SFT warm-up steps on the answer's format (random digits) before GRPO (default 40; 0: none)",
    )
    ap.add_argument("--format-batch", type=int, default=32, help="rows per warm-up step")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--sp-size", type=int, default=None, help="default: every process")
    ap.add_argument("--output-dir", default=None, help="default: runs/grpo_passkey-lora")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier run there")
    ap.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)"
    )
    ap.add_argument("--resume", default=None, help=RESUMABLE_HELP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-json", default=None, help="write the per-step rewards here (rank 0)")


# (flag, smallest value, what it is): each value below its smallest is refused
_AT_LEAST = {
    "common": [
        ("steps", 1, "optimizer steps"),
        ("seq_len", 16, "tokens per row (a passkey row needs 16)"),
        ("rows", 1, "training rows"),
        ("eval_rows", 0, "held-out rows (0: no accuracy)"),
        ("warmup", 0, "warmup steps"),
        ("grad_accum", 1, "micro-batches per optimizer step"),
        ("lora_rank", 1, "the LoRA rank"),
        ("save_every", 0, "steps between checkpoints (0: only at the end)"),
        ("sp_size", 1, "processes per sequence-parallel group"),
    ],
    "grpo_passkey": [
        ("steps", 1, "optimizer steps"),
        ("prompt_len", 8, "bytes per prompt (passkey and question)"),
        ("prompts_per_step", 1, "new prompts per step"),
        ("num_generations", 2, "answers per prompt (GRPO compares them)"),
        ("format_steps", 0, "warm-up steps (0: none)"),
        ("format_batch", 1, "rows per warm-up step"),
        ("lora_rank", 1, "the LoRA rank"),
        ("save_every", 0, "steps between checkpoints (0: only at the end)"),
        ("sp_size", 1, "processes per sequence-parallel group"),
    ],
}


def check_flags(args, example: str) -> None:
    """Refuses impossible values, each by its flag, before anything is imported, built or written.

    Raises:
        ValueError: the first impossible value: a count below its smallest, a learning rate that is not a
            positive number, a negative --max-grad-norm, --offload without --checkpointing, --overwrite with
            --resume, a --data file or a --resume folder that does not exist.
    """
    for name, least, what in _AT_LEAST["grpo_passkey" if example == "grpo_passkey" else "common"]:
        value = getattr(args, name, None)
        if value is not None and value < least:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value}: {what}, at least {least}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr}: the learning rate must be a positive number, e.g. 1e-3")
    norm = getattr(args, "max_grad_norm", 0.0)
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"--max-grad-norm {norm}: a positive number, or 0 for no clipping")
    offload = getattr(args, "offload", None)
    if offload not in (None, "none") and not args.checkpointing:
        raise ValueError(
            f"--offload {offload} offloads what activation checkpointing keeps: add --checkpointing "
            "(or --offload none)"
        )
    if args.overwrite and args.resume is not None:
        raise ValueError(
            f"--overwrite with --resume {args.resume}: --overwrite deletes the run that --resume continues; pass "
            "one of them"
        )
    data = getattr(args, "data", None)
    if data and not os.path.isfile(data):
        raise ValueError(f"--data {data}: no such file")
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        raise ValueError(
            f"--resume {args.resume}: no such folder; pass a checkpoint folder of the run, or 'latest'"
        )


def run_dir(args, example: str) -> str:
    """The run's folder: --output-dir, or runs/<example>-<lora|full>.

    Raises:
        ValueError: the folder holds an earlier run (anything in it) and neither --overwrite nor --resume was
            given; the same on every rank, before any process group exists.
    """
    path = args.output_dir or os.path.join("runs", f"{example}-{'full' if args.full else 'lora'}")
    found = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if found and not (args.overwrite or args.resume):
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(
            f"--output-dir {path} holds an earlier run ({shown}): pass --overwrite to replace it, --resume "
            "latest to continue it, or another --output-dir"
        )
    return path


def latest_checkpoint(output_dir: str, example: str) -> str | None:
    """The run's newest complete checkpoint folder (`step-N` of the custom loop, `checkpoint-N` of the Trainer
    examples), or None."""
    prefix = "step-" if example == "long_context" else "checkpoint-"
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = [
        int(d[len(prefix) :]) for d in names if d.startswith(prefix) and d[len(prefix) :].isdigit()
    ]
    return os.path.join(output_dir, f"{prefix}{max(steps)}") if steps else None


def checkpoint_step(folder: str) -> int | None:
    """The optimizer step a checkpoint was saved at (`step.json`, or the Trainer's `trainer_state.json`)."""
    for name, key in (("step.json", "step"), ("trainer_state.json", "global_step")):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                return int(json.load(f)[key])
    return None


def finished(args, output_dir: str, example: str) -> str | None:
    """With --resume, the line saying the run is already at --steps (nothing to train, nothing to write), or None
    (no earlier run, which --resume latest then starts, or steps left to train).

    Raises:
        ValueError: --resume latest on a folder that holds files but no checkpoint to continue from.
    """
    if args.resume is None:
        return None
    folder = latest_checkpoint(output_dir, example) if args.resume == "latest" else args.resume
    if folder is None and os.path.isdir(output_dir) and os.listdir(output_dir):
        raise ValueError(
            f"--resume latest: {output_dir} holds no checkpoint to continue from; pass --overwrite instead to "
            "start again, or another --output-dir"
        )
    step = checkpoint_step(folder) if folder else None
    if step is None or step < args.steps:
        return None
    return (
        f"already at step {step} of {args.steps} ({folder}): nothing to train, nothing written; pass a "
        f"larger --steps to continue it"
    )


def parse(argv, example: str, full_parser=None):
    """The flags of `example` (with `full_parser`, the script's own parser, else a light one) and their checks."""
    if full_parser is None:
        full_parser = argparse.ArgumentParser(add_help=False)
        if example == "grpo_passkey":
            grpo_flags(full_parser)
        else:
            add_common_flags(full_parser)
        if example == "trainer":
            trainer_flags(full_parser)
    args = full_parser.parse_args(argv)
    if example == "grpo_passkey":
        args.full, args.model = False, None  # what the shared helpers read
    elif example == "trainer" and args.trl:
        example = "trl"
    check_flags(args, example)
    return args, example


def preflight(argv, example: str) -> None:
    """Run by a script as `__main__`, before its heavy imports: exit 2 with one line for a bad flag or an earlier
    run; exit 0 with one line when a resume has nothing to train; else return (the script parses again)."""
    if any(a in ("-h", "--help") for a in argv):
        return
    first = os.environ.get("RANK", "0") == "0"
    try:
        args, example = parse(argv, example)
        output_dir = run_dir(args, example)
        line = finished(args, output_dir, example)
    except ValueError as err:
        _exit(f"error: {err}", 2, first)
    if line is not None:
        _exit(line, 0, first)


def _exit(line: str, code: int, first: bool) -> None:
    """The line from the first rank (an error also into the launcher's error file, which its summary quotes, as
    `hf_upipe.exits.record_line` writes it), then every rank exits together: a launcher stops the ranks still
    running once one has exited with an error."""
    if first:
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if code and path:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                message = {"py_callstack": line, "timestamp": str(int(time.time()))}
                json.dump({"message": {"message": line, "extraInfo": message}}, f)
        except OSError:
            pass
    if "LOCAL_RANK" in os.environ:  # under a launcher: the ranks, started together, exit together
        time.sleep(0.5)
    raise SystemExit(code)
