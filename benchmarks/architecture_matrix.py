"""Every decoder-only causal LM of the installed transformers, built tiny: exact under sequence parallelism, refused
with a clear error, or (what must never happen) wrong, crashed or hung? (`hf_upipe.tools.matrix` says how each is
judged.)
And every vision-language (image-text-to-text) type, with images (`hf_upipe.tools.vlm_matrix`).

    python benchmarks/architecture_matrix.py [--types gpt2,llama,...] [--sp 2] [--timeout 60]
    python benchmarks/architecture_matrix.py --vlm-only [--vlm-types qwen2_vl,llava,...]

Type by type, each in its own processes (a model that builds too large, or a run that hangs, is that type's verdict
only): the single-process checks (builds tiny, is a causal decoder, "upipe" without SP against its reference), then
`hf-upipe selftest`'s comparison on --sp gloo ranks. Writes benchmarks/results/architecture_matrix.json and prints
its support table; `python benchmarks/support_table.py` then writes docs/models.md's table from the committed JSON.
The vision-language rows (SP 2 only: the tiny batch's image crosses that shard boundary) go under the report's "vlm"
key, each type in its own 2 gloo ranks; `--vlm-only` re-runs only them and keeps the causal-LM rows of `--out`
(which must be of the installed transformers release).
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

from hf_upipe.tools.matrix import causal_lm_types, single_process, summary, support_table, verdict  # noqa: E402
from hf_upipe.tools.testing import DistributedFailure, run_distributed  # noqa: E402
from hf_upipe.tools.vlm_matrix import (  # noqa: E402
    vlm_rank,
    vlm_summary,
    vlm_support_table,
    vlm_types,
)

RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "architecture_matrix.json"
)


def _single(rank: int, world: int, model_type: str) -> dict:
    return single_process(model_type)


def isolated(model_type: str, sp: int, timeout: float) -> dict:
    from hf_upipe.tools.selftest import run_selftest

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
            full_size=True,  # the tiny config as it is (no reduction: it is the matrix's own size)
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


def _vlm(rank: int, world: int, model_type: str) -> dict:
    return vlm_rank(rank, world, [model_type])[model_type]


def isolated_vlm(model_type: str, timeout: float) -> dict:
    """One vision-language type's row at SP 2 in its own ranks; ranks that disagree are "crashed"."""
    try:
        rows = run_distributed(_vlm, 2, model_type, timeout=timeout, start_method="forkserver")
    except DistributedFailure as err:
        outcome = "hung" if "timed out" in str(err) else "crashed"
        return {"builds": True, "sp2": outcome, "sp2_why": str(err)[-600:]}
    first, *others = ({k: v for k, v in r.items() if k != "seconds"} for r in rows)
    if any(other != first for other in others):
        return {"builds": True, "sp2": "crashed", "sp2_why": f"the ranks disagree: {rows}"[:600]}
    return rows[0]


def vlm_part(types: list[str], timeout: float) -> dict:
    started = time.perf_counter()
    results = {}
    for model_type in types:
        results[model_type] = isolated_vlm(model_type, timeout)
        print(
            model_type, {k: v for k, v in results[model_type].items() if "why" not in k}, flush=True
        )
    return {
        "summary": vlm_summary(results),
        "results": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _failed(report: dict) -> int:
    sp2, sp1, opt_in = (report["summary"][k] for k in ("sp2", "sp1", "opt_in"))
    vlm = report["vlm"]["summary"]["sp2"]
    bad = sp2["wrong"] + sp2["hung"] + sp1["wrong"] + opt_in["hung"]
    return bad + vlm["wrong"] + vlm["crashed"] + vlm["hung"]


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
    ap.add_argument(
        "--vlm-types",
        default=None,
        help="comma-separated vision-language types (default: every image-text-to-text type)",
    )
    ap.add_argument(
        "--vlm-only",
        action="store_true",
        help="re-run only the vision-language rows, keeping the causal-LM rows of --out",
    )
    args = ap.parse_args()
    multiprocessing.set_forkserver_preload(
        [
            "torch",
            "transformers",
            "transformers.modeling_utils",
            "hf_upipe",
            "hf_upipe.tools.selftest",
            "hf_upipe.tools.matrix",
            "hf_upipe.tools.vlm_matrix",
        ]
    )
    import transformers

    vlm = args.vlm_types.split(",") if args.vlm_types else vlm_types()
    if args.vlm_only:
        with open(args.out) as f:
            report = json.load(f)
        if report["transformers"] != transformers.__version__:
            raise SystemExit(f"{args.out} is of transformers {report['transformers']}")
        report["vlm"] = vlm_part(vlm, args.timeout)
        return _write(report, args.out)
    started = time.perf_counter()
    results = {}
    for model_type in args.types.split(",") if args.types else causal_lm_types():
        results[model_type] = isolated(model_type, args.sp, args.timeout)
        print(
            model_type,
            {k: v for k, v in results[model_type].items() if not k.endswith("why")},
            flush=True,
        )
    report = {
        "transformers": transformers.__version__,
        "summary": summary(results),
        "results": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report["vlm"] = vlm_part(vlm, args.timeout)
    return _write(report, args.out)


def _write(report: dict, out: str) -> int:
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(support_table([report]), vlm_support_table([report]), sep="\n\n")
    print(json.dumps(report["summary"]), json.dumps(report["vlm"]["summary"]))
    print(
        f"wrote {out}; causal LMs {report['wall_s']:.0f} s, vision-language {report['vlm']['wall_s']:.0f} s"
    )
    return 1 if _failed(report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
