"""The `hf-upipe` command line.

Entry points:
- `main(argv=None)`: `hf-upipe <command> ...`; the console script of the package.
- `build_parser()`: its argparse parser, one sub-parser per command.
- `register_command(name, help, add_arguments, run)`: how a command plugs in (`env` here; the planner and the
  self-test (`hf_upipe.tools.selftest`) plug in the same way).

Commands:
- `hf-upipe env [--json]`: versions of the stack, devices, distributed backends, the attention kernels usable on
  each device, whether flash-attn is found, and the UPipe settings the `UPIPE_*` variables give.
- `hf-upipe fingerprints [--json] [--no-check]`: each adapter's installed source fingerprint, the fingerprints the
  registry records for it, and how it stands (verified by fingerprint, by behaviour, or not); exit 1 unless every
  adapter is verified. What to compare and record when adding or re-verifying an architecture
  (docs/contributing.md).
- `hf-upipe selftest --model ... [--sp 2] [--lora]`: SP against one device on your model (`hf_upipe.tools.selftest`).
- `hf-upipe plan --model ... --gpus N [--gpu-memory 80GiB] [--nodes M] (--seq-len S | --max)`: per-GPU memory
  by category, whether it fits, the settings to use (`hf_upipe.planning.planner`). Exit 1 if it does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import platform
import sys
from typing import Callable

__all__ = ["build_parser", "collect_env", "main", "register_command"]

_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def register_command(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Add `hf-upipe <name>`: `add_arguments(parser)` declares its flags, `run(args)` returns the exit code."""
    _COMMANDS[name] = (help, add_arguments, run)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_env(checked: bool = True) -> dict:
    """Everything `hf-upipe env` reports, as a dict (`checked`: run the adapters' behaviour checks on a source not
    seen before, `hf_upipe.tools.adapter_status`)."""
    import torch
    import torch.distributed as dist

    import hf_upipe
    from hf_upipe.config import UPipeConfig
    from hf_upipe.ops.kernels import available_kernels
    from hf_upipe.tools.adapter_status import adapter_status

    cuda = torch.cuda.is_available()
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    kernels = {"cpu": available_kernels("cpu", torch.bfloat16)}
    if cuda:
        kernels["cuda"] = available_kernels("cuda", torch.bfloat16)
    try:
        settings = dataclasses.asdict(
            UPipeConfig()
        )  # the fields only: not the config's bookkeeping (_origin)
        settings_error = None
    except ValueError as err:  # a bad UPIPE_* variable: report it instead of failing
        settings, settings_error = None, str(err)
    return {
        "hf_upipe": hf_upipe.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {
            p: _version(p)
            for p in (
                "torch",
                "transformers",
                "accelerate",
                "peft",
                "trl",
                "datasets",
                "deepspeed",
                "flash-attn",
            )
        },
        "flash_attn_found": importlib.util.find_spec("flash_attn") is not None,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "devices": devices,
        "distributed_backends": {
            b: getattr(dist, f"is_{b}_available", lambda: False)() for b in ("nccl", "gloo")
        },
        "attention_kernels_bf16": kernels,
        "upipe_settings": settings,
        "upipe_settings_error": settings_error,
        "adapters": adapter_status(check=checked),
    }


def _env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="do not run the adapters' behaviour checks on a transformers source not seen before",
    )


def _env_run(args: argparse.Namespace) -> int:
    from hf_upipe.tools.adapter_status import format_status

    info = collect_env(checked=args.check)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0 if info["upipe_settings_error"] is None else 1
    print(f"hf_upipe {info['hf_upipe']} | python {info['python']} | {info['platform']}")
    for name, version in ((n, v) for n, v in info["packages"].items() if n != "flash-attn"):
        print(f"  {name:<13} {version or 'not installed'}")
    flash = info["packages"]["flash-attn"] or "found" if info["flash_attn_found"] else None
    print(f"  flash-attn    {flash or 'not found (optional: pip install hf_upipe[flash])'}")
    print(
        f"CUDA: {'yes, ' + str(info['cuda_version']) if info['cuda_available'] else 'no'}; devices: "
        f"{', '.join(info['devices']) or 'none'}"
    )
    print(
        "distributed backends: "
        + ", ".join(
            f"{b} {'yes' if ok else 'no'}" for b, ok in info["distributed_backends"].items()
        )
    )
    for device, names in info["attention_kernels_bf16"].items():
        print(f"attention kernels on {device} (bf16, first = 'auto'): {', '.join(names) or 'none'}")
    print(
        f"adapters on transformers {info['packages']['transformers']} (adapter, subject, source fingerprint, "
        "status):"
    )
    print("\n".join(format_status(info["adapters"])))
    if info["upipe_settings_error"]:
        print(f"UPIPE_* settings: ERROR: {info['upipe_settings_error']}")
        return 1
    print(
        "UPipe settings (UPIPE_* variables, else defaults): "
        + ", ".join(f"{k}={v}" for k, v in info["upipe_settings"].items())
    )
    return 0


register_command(
    "env", "versions, devices, kernels and the UPIPE_* settings in effect", _env_arguments, _env_run
)


def _fingerprints_run(args: argparse.Namespace) -> int:
    from hf_upipe.models.verification import VERIFIED_RELEASES, installed_version
    from hf_upipe.tools.adapter_status import adapter_status

    rows = adapter_status(check=args.check)
    if args.json:
        print(json.dumps({"transformers": installed_version(), "adapters": rows}, indent=1))
    else:
        print(
            f"transformers {installed_version()}; fingerprints recorded for the releases "
            f"{', '.join(VERIFIED_RELEASES)} (adapter, subject, installed, recorded, status):"
        )
        for r in rows:
            recorded = ",".join(r["recorded"]) or "-"
            print(
                f"  {r['adapter']:<6} {r['subject']:<28} {r['fingerprint'] or '-':<16}  "
                f"{recorded:<34}  {r['status']}"
            )
    return 0 if all(r["ok"] for r in rows) else 1


register_command(
    "fingerprints",
    "each adapter's source fingerprint on the installed transformers, those recorded, and its status",
    _env_arguments,
    _fingerprints_run,
)


def _release_check_run(args: argparse.Namespace) -> int:
    from hf_upipe.models.verification import installed_version
    from hf_upipe.tools.adapter_status import adapter_status, format_report, release_report

    report = release_report(adapter_status(check=args.check))
    if args.json:
        print(json.dumps({"transformers": installed_version(), **report}, indent=1))
    else:
        print("\n".join(format_report(report, installed_version())))
    return 0 if report["off"] == 0 else 1


register_command(
    "release-check",
    "family by family, which adapters are on with the installed transformers, which are off, and why "
    "(installs nothing; exit status 1 when one is off)",
    _env_arguments,
    _release_check_run,
)


def _selftest_arguments(parser):
    from hf_upipe.tools.selftest import add_arguments

    add_arguments(parser)


def _selftest_run(args):
    from hf_upipe.tools.selftest import run

    return run(args)


register_command(
    "selftest",
    "prove that sequence-parallel training equals one device on your model",
    _selftest_arguments,
    _selftest_run,
)


def _plan_arguments(parser):
    from hf_upipe.planning.plan_command import add_arguments

    add_arguments(parser)


def _plan_run(args):
    from hf_upipe.planning.plan_command import run

    return run(args)


register_command(
    "plan",
    "before launch: does a length fit, with which settings, and what is the longest that fits",
    _plan_arguments,
    _plan_run,
)


def _calibrate_arguments(parser):
    from hf_upipe.planning.calibrate import add_arguments

    add_arguments(parser)


def _calibrate_run(args):
    from hf_upipe.planning.calibrate import run

    return run(args)


register_command(
    "calibrate",
    "on a GPU: measure what the CUDA caching allocator reserves for the planned step; plan applies it",
    _calibrate_arguments,
    _calibrate_run,
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help ("(default: ...)"), except where the help already says it, or where
    there is none to show (a flag's False, an unset None)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `hf-upipe`, one sub-parser per registered command; with `command`, only that one's flags are
    declared (the others' modules are not imported: `hf-upipe selftest --help` loads no planner, and so on); with
    "", none."""
    parser = argparse.ArgumentParser(
        prog="hf-upipe",
        description="UPipe sequence parallelism for Hugging Face models",
        formatter_class=_HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in _COMMANDS.items():
        child = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=_HelpFormatter
        )
        if command is None or command == name:
            add_arguments(child)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    # `hf-upipe --help` or an unknown command: no command's flags are needed
    args = build_parser(command if command in _COMMANDS else "").parse_args(argv)
    return _COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
