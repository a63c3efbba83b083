"""`hf-upipe selftest`: the command line of the self-test (`hf_upipe.selftest`) and the table it prints.

Entry points:
- `hf-upipe selftest --model <name | config.json | model dir | org/name> [--sp 2] [--ring 1] [--lora]`: the names of
  `hf_upipe.models` (presets run at a tiny width and depth with their own head geometry); a reduced copy of the
  architecture unless `--full-size` (`hf_upipe.selftest_size`). Exit codes: `EXIT_CODES`.
  `add_arguments(parser)` declares its flags, `run(args)` runs it (`hf_upipe.cli`).
- `format_table(checks)`: the pass/fail table the command prints.
"""

from __future__ import annotations

import argparse
import sys

from hf_upipe.models import runnable_config
from hf_upipe.selftest import Check, RanksFailed, run_selftest
from hf_upipe.selftest_size import DoesNotFit

__all__ = ["EXIT_CODES", "add_arguments", "format_table", "run"]

EXIT_CODES = {  # docs/selftest.md lists them
    0: "every check passed",
    1: "a numerical mismatch: a check failed",
    2: "bad input, or a model hf_upipe refuses to run under sequence parallelism",
    3: "does not fit: the model needs more memory than this machine has available; nothing was built",
    4: "a rank failed: it died (killed by a signal: 9 is SIGKILL, likely out of memory), exited, raised an error "
    "hf_upipe does not own, or did not answer in time; no numerical verdict",
}


def format_table(checks: list[Check]) -> str:
    rows = [
        "| model | batch | check | max rel. error | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        if c.refused:
            continue
        rows.append(
            f"| {c.model} | {c.batch} | {c.name} | {c.error:.2e} | {c.tolerance:.0e} | "
            f"{'PASS' if c.passed else 'FAIL'}{' (' + c.note + ')' if c.note and not c.passed else ''} |"
        )
    failed = sum(not c.passed and not c.refused for c in checks)
    rows.append(
        f"\n{len(checks) - failed - sum(bool(c.refused) for c in checks)} passed, {failed} failed"
    )
    rows += [
        f"{c.model}: cannot run under sequence parallelism: {c.refused}"
        for c in checks
        if c.refused
    ]
    rows += [
        f"{m}: not in hf_upipe's architecture registry; these checks verify it for this configuration: train "
        "it with UPipeConfig(allow_unverified=True) or UPIPE_ALLOW_UNVERIFIED=1"
        for m in _unverified(
            {c.model for c in checks if c.passed} - {c.model for c in checks if not c.passed}
        )
    ]
    return "\n".join(rows)


def _unverified(models) -> list[str]:
    """The model names among `models` whose model_type the registry does not list as verified."""
    from hf_upipe.architectures import ARCHITECTURES

    out = []
    for name in sorted(models):
        try:
            model_type = runnable_config(name)[0].model_type
        except Exception:  # noqa: BLE001  (only a note: a name that does not resolve here gets none)
            continue
        if not (ARCHITECTURES.get(model_type) and ARCHITECTURES[model_type].verified):
            out.append(name)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="comma-separated: names `hf-upipe plan --model` takes (presets run at a tiny width and depth with "
        "their own type and head geometry), tiny-<model_type> (any causal-LM type built tiny, e.g. tiny-llama), a "
        "config.json, a model folder, or a Hub id 'org/name'",
    )
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks to launch")
    parser.add_argument(
        "--ring",
        type=int,
        default=1,
        help="ring attention over this many ring shards of the --sp ranks (1: none)",
    )
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="test the model at its own size (loading a folder's weights), refused when this machine's free "
        "memory cannot hold it; without it: a reduced copy of the same architecture (fewer layers, narrower), "
        "which runs the same code",
    )
    parser.add_argument(
        "--lora", action="store_true", help="check a LoRA (PEFT) model on all linear layers"
    )
    parser.add_argument(
        "--seq-len", type=int, default=61, help="sequence length (odd: pads under SP)"
    )
    parser.add_argument(
        "--heads-per-chunk", default="1", help="UPipe head chunk, or 'all' (Ulysses mode)"
    )
    parser.add_argument(
        "--registered",
        action="store_true",
        help="check the registered attention, not the fused one",
    )
    parser.add_argument(
        "--break", dest="breakage", choices=["shard-shift"], help="deliberately break the sharding"
    )


def run(args: argparse.Namespace) -> int:
    """The self-test; its exit code (`EXIT_CODES`)."""
    try:
        hpc = None if args.heads_per_chunk == "all" else int(args.heads_per_chunk)
        checks = run_selftest(
            args.model.split(","),
            sp=args.sp,
            lora=args.lora,
            seq_len=args.seq_len,
            heads_per_chunk=hpc,
            fused=not args.registered,
            breakage=args.breakage,
            ring=args.ring,
            full_size=args.full_size,
            report=lambda line: print(f"hf-upipe selftest: {line}", flush=True),
        )
    except DoesNotFit as err:
        print(f"hf-upipe selftest: does not fit: {err}", file=sys.stderr)
        return 3
    except ValueError as err:
        print(f"hf-upipe selftest: error: {err}", file=sys.stderr)
        return 2
    except RanksFailed as err:
        print(f"{err}\n\nhf-upipe selftest: {_failure_line(err)}", file=sys.stderr)
        return 4
    print(format_table(checks))
    if any(c.refused for c in checks):
        return 2
    return 0 if all(c.passed for c in checks) else 1


def _failure_line(err: RanksFailed) -> str:
    """One line naming the failed ranks and how each failed (the tracebacks are above it)."""
    from hf_upipe.testing import death_cause

    said = [f"rank {r} {death_cause(code)}" for r, code in sorted(err.died.items())]
    raised = [r for r in err.ranks if r not in err.died]
    if raised:
        said.append(
            f"rank{'s' if len(raised) > 1 else ''} {', '.join(map(str, raised))} raised an error (above)"
        )
    if not said:
        said.append("no rank answered in time")
    return "a rank failed, no numerical verdict: " + "; ".join(said) + " (exit 4)"
