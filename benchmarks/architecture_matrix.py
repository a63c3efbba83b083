"""Every decoder-only causal LM of the installed transformers, built tiny: exact under sequence parallelism, refused
with a clear error, or (what must never happen) wrong, crashed or hung?

    python benchmarks/architecture_matrix.py [--types gpt2,llama,...] [--sp 2] [--timeout 120]

For each model_type of transformers' causal-LM mapping that builds at a tiny size (`hf_upipe.models.tiny_config`):
- decoder-only: the tiny "sdpa" model is causal (changing the last token changes no earlier logit); encoders and
  encoder-decoders' decoders are left out, as are models that do not build this small;
- SP 1: attn_implementation="upipe" without sequence parallelism against "sdpa" on one process (logits, loss and
  every gradient): "exact" or "refused";
- SP 2: `hf-upipe selftest`'s comparison on 2 gloo ranks (logits of every real token, training loss, every
  gradient, eval loss; a right-padded and a packed batch): "exact", "refused" (hf_upipe's own error, the same on
  every rank), "wrong" (a mismatch), "crashed" (another error) or "hung" (no answer within --timeout).
Writes benchmarks/results/architecture_matrix.json and prints the support table of README.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "architecture_matrix.json")
OUTCOMES = ("exact", "refused", "wrong", "crashed", "hung")


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def single_process(model_type: str) -> dict:
    """Builds the tiny model; is it a causal decoder; is "upipe" without SP exactly "sdpa" (or refused)?"""
    from transformers import AutoModelForCausalLM

    import hf_upipe  # noqa: F401  (registers "upipe")
    from hf_upipe.models import tiny_config

    try:
        config = tiny_config(model_type)
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except Exception as err:  # noqa: BLE001  (anything: the type does not build this small)
        return {"builds": False, "why": f"{type(err).__name__}: {str(err)[:160]}"}
    vocab = ref.get_output_embeddings().weight.shape[0] if ref.get_output_embeddings() is not None else 128
    ids = torch.randint(3, min(vocab, 128), (1, 24), generator=torch.Generator().manual_seed(1))
    try:
        ref.eval()
        with torch.no_grad():
            logits = ref(input_ids=ids).logits
            changed = ids.clone()
            changed[0, -1] = (changed[0, -1] + 1) % min(vocab, 128) + 3 if changed[0, -1] < 120 else 3
            other = ref(input_ids=changed).logits
    except Exception as err:  # noqa: BLE001
        return {"builds": False, "why": f"does not run: {type(err).__name__}: {str(err)[:160]}"}
    if not torch.allclose(logits[:, :-1], other[:, :-1], atol=1e-5):
        return {"builds": True, "decoder": False}
    out = {"builds": True, "decoder": True}
    try:
        up = AutoModelForCausalLM.from_config(config, attn_implementation="upipe", dtype=torch.float32)
        up.load_state_dict(ref.state_dict())
        ref.train()
        up.train()
        results = []
        for model in (ref, up):
            model.zero_grad()
            output = model(input_ids=ids, labels=ids)
            output.loss.backward()
            results.append((output.logits.detach(), {n: p.grad for n, p in model.named_parameters()
                                                     if p.grad is not None}))
        (want, want_grads), (got, got_grads) = results
        error = max([_rel(got, want)] + [_rel(got_grads[n], g) for n, g in want_grads.items() if n in got_grads])
        out["sp1"] = "exact" if error <= 1e-5 and got_grads.keys() == want_grads.keys() else "wrong"
        out["sp1_error"] = error
    except (ValueError, NotImplementedError) as err:
        out["sp1"], out["sp1_why"] = "refused", f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001
        out["sp1"], out["sp1_why"] = "crashed", f"{type(err).__name__}: {str(err)[:300]}"
    return out


def sequence_parallel(model_type: str, sp: int, timeout: float) -> dict:
    """`hf-upipe selftest` of the tiny model on `sp` ranks, classified."""
    from hf_upipe.selftest import run_selftest

    started = time.perf_counter()
    try:
        checks = run_selftest([model_type], sp=sp, seq_len=29, timeout=timeout, tolerant=True,
                              start_method="forkserver")
    except ValueError as err:  # its inputs cannot work (e.g. heads that do not split): a clear refusal
        return {"sp2": "refused", "sp2_why": f"ValueError: {err}"}
    except RuntimeError as err:
        hung = "timed out" in str(err)
        return {"sp2": "hung" if hung else "crashed", "sp2_why": str(err)[-600:],
                "seconds": round(time.perf_counter() - started, 1)}
    refused = [c.refused for c in checks if c.refused]
    crashed = [c.crashed for c in checks if c.crashed]
    failed = [f"{c.batch} {c.name}: {c.error:.1e}" for c in checks if not c.refused and not c.crashed
              and not c.passed]
    out = {"seconds": round(time.perf_counter() - started, 1)}
    if refused:
        out.update(sp2="refused", sp2_why=refused[0])
    elif crashed:
        out.update(sp2="crashed", sp2_why=crashed[0][:600])
    elif failed:
        out.update(sp2="wrong", sp2_why="; ".join(failed))
    else:
        out.update(sp2="exact", sp2_error=max(c.error for c in checks))
    return out


def run_matrix(types: list[str], sp: int = 2, timeout: float = 120) -> dict:
    multiprocessing.set_forkserver_preload(["torch", "transformers", "transformers.modeling_utils", "hf_upipe",
                                            "hf_upipe.selftest"])
    results = {}
    for model_type in types:
        row = single_process(model_type)
        if row.get("builds") and row.get("decoder"):
            row.update(sequence_parallel(model_type, sp, timeout))
        results[model_type] = row
        print(model_type, {k: v for k, v in row.items() if not k.endswith("why")}, flush=True)
    return results


def table(results: dict) -> str:
    rows = ["| architecture (model_type) | SP 1 | SP 2 | why (refused) |", "|---|---|---|---|"]
    for model_type, r in sorted(results.items()):
        if not (r.get("builds") and r.get("decoder")):
            continue
        why = r.get("sp2_why", "") if r.get("sp2") != "exact" else ""
        why = why.split(": ", 1)[-1].split(". ")[0][:140]
        rows.append(f"| {model_type} | {r.get('sp1')} | {r.get('sp2')} | {why} |")
    return "\n".join(rows)


def summary(results: dict) -> dict:
    decoders = {t: r for t, r in results.items() if r.get("builds") and r.get("decoder")}
    count = {o: sum(r.get("sp2") == o for r in decoders.values()) for o in OUTCOMES}
    count_sp1 = {o: sum(r.get("sp1") == o for r in decoders.values()) for o in OUTCOMES}
    return {"types": len(results), "decoder_only_tiny": len(decoders), "sp2": count, "sp1": count_sp1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=None, help="comma-separated model types (default: every causal LM type)")
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120, help="seconds before a run counts as hung")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    started = time.perf_counter()
    types = args.types.split(",") if args.types else causal_lm_types()
    results = run_matrix(types, args.sp, args.timeout)
    import transformers

    report = {"transformers": transformers.__version__, "summary": summary(results), "results": results,
              "wall_s": round(time.perf_counter() - started, 1)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(results))
    print(json.dumps(report["summary"]), f"\nwrote {args.out}; {report['wall_s']:.0f} s")
    bad = report["summary"]["sp2"]["wrong"] + report["summary"]["sp2"]["hung"] + report["summary"]["sp1"]["wrong"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
