"""Every decoder-only causal LM of the installed transformers, built tiny: exact under sequence parallelism, refused
with a clear error, or (what must never happen) wrong, crashed or hung? (`hf_upipe.matrix` says how each is judged.)

    python benchmarks/architecture_matrix.py [--types gpt2,llama,...] [--sp 2] [--timeout 60]

Type by type, each in its own processes (a model that builds too large, or a run that hangs, is that type's verdict
only): the single-process checks (builds tiny, is a causal decoder, "upipe" without SP against its reference), then
`hf-upipe selftest`'s comparison on --sp gloo ranks. Writes benchmarks/results/architecture_matrix.json and prints
its support table; `python benchmarks/support_table.py` then writes docs/models.md's table from the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # run from a checkout

from hf_upipe.matrix import causal_lm_types, single_process, summary, support_table, verdict  # noqa: E402
from hf_upipe.testing import DistributedFailure, run_distributed  # noqa: E402

RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "architecture_matrix.json"
)


def _single(rank: int, world: int, model_type: str) -> dict:
    return single_process(model_type)


def isolated(model_type: str, sp: int, timeout: float) -> dict:
    from hf_upipe.selftest import run_selftest

    try:
        row = run_distributed(_single, 1, model_type, timeout=timeout, start_method="forkserver")[0]
    except DistributedFailure as err:
        return {"builds": False, "why": f"gave up: {str(err)[-200:]}"}
    if not (row.get("builds") and row.get("decoder")):
        return row
    started = time.perf_counter()
    try:
        checks = run_selftest(
            [model_type],
            sp=sp,
            seq_len=29,
            timeout=timeout,
            tolerant=True,
            start_method="forkserver",
            allow_unverified=True,
        )
        row.update(verdict(model_type, checks))
    except (
        ValueError
    ) as err:  # its inputs cannot work (e.g. heads that do not split): a clear refusal
        row.update(sp2="refused", sp2_why=f"ValueError: {err}", opt_in="refused")
    except RuntimeError as err:
        outcome = "hung" if "timed out" in str(err) else "crashed"
        row.update(sp2=outcome, sp2_why=str(err)[-600:], opt_in=outcome)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--types", default=None, help="comma-separated model types (default: every causal LM type)"
    )
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60, help="seconds before a run counts as hung")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    multiprocessing.set_forkserver_preload(
        [
            "torch",
            "transformers",
            "transformers.modeling_utils",
            "hf_upipe",
            "hf_upipe.selftest",
            "hf_upipe.matrix",
        ]
    )
    started = time.perf_counter()
    results = {}
    for model_type in args.types.split(",") if args.types else causal_lm_types():
        results[model_type] = isolated(model_type, args.sp, args.timeout)
        print(
            model_type,
            {k: v for k, v in results[model_type].items() if not k.endswith("why")},
            flush=True,
        )
    import transformers

    report = {
        "transformers": transformers.__version__,
        "summary": summary(results),
        "results": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(support_table([report]))
    print(json.dumps(report["summary"]), f"\nwrote {args.out}; {report['wall_s']:.0f} s")
    sp2, sp1, opt_in = (report["summary"][k] for k in ("sp2", "sp1", "opt_in"))
    return 1 if sp2["wrong"] + sp2["hung"] + sp1["wrong"] + opt_in["hung"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
