"""The architecture matrix: every causal-LM type of the installed transformers, built tiny, under sequence
parallelism: exact, refused with a clear error, or (what must never happen) wrong, crashed or hung.

Entry points:
- `causal_lm_types()`: the model types of transformers' causal-LM mapping.
- `single_process(model_type)`: builds the tiny model (`hf_upipe.models.presets.tiny_config`); is it a causal decoder
  (changing the last token changes no earlier logit; encoders are left out); is attn_implementation="upipe"
  without SP exactly its reference ("sdpa", or "eager" for a model without sdpa) or refused.
- `matrix_rank(rank, world, types, opt_in=False)`: one rank of a single multi-process job over many types:
  `single_process`, then `hf_upipe.tools.selftest.check_model` at SP `world` (logits, training loss, every gradient,
  eval
  loss; a padded and a packed batch), classified by `classify` (or `verdict` opted in). The test suite runs all
  types in one job (imports shared), as a user would: the support gate refuses the unverified ones.
- `classify(checks)`: "exact", "refused" (hf_upipe's own error, the same on every rank), "wrong" or "crashed".
- `verdict(model_type, checks)`: the checks are run opted in (`allow_unverified=True`, as the self-test runs); the
  row keeps that outcome ("opt_in") and what a user gets by default ("sp2": an unverified type is refused by the
  support gate). "wrong" by default must never happen; "wrong" opted in is what the self-test shows as FAIL.
- `summary(results)`: the counts of one run; `support_table(reports)`: the counts and the per-type table of one
  or more runs (one per transformers release), as docs/models.md shows them (`benchmarks/support_table.py`).

`benchmarks/architecture_matrix.py` runs it type by type in isolated processes (a hang is then one type's
"hung"), writes `benchmarks/results/architecture_matrix.json` and prints the table. The vision-language
(image-text-to-text) types, run with images, are `hf_upipe.tools.vlm_matrix`'s rows of the same report.
"""

from __future__ import annotations

import torch

__all__ = [
    "OUTCOMES",
    "causal_lm_types",
    "classify",
    "matrix_rank",
    "single_process",
    "summary",
    "support_table",
    "verdict",
]

OUTCOMES = ("exact", "refused", "wrong", "crashed", "hung")
MAX_TINY_PARAMETERS = 100_000_000  # a type whose config ignores SMALL's sizes does not "build tiny"


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _build(model_type: str):
    """(config, reference model, its attention implementation): "sdpa", or "eager" where sdpa is unsupported."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.models.presets import tiny_config

    config = tiny_config(model_type)
    with torch.device(
        "meta"
    ):  # count first: some types ignore the small sizes (blt: 4.6B parameters)
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_TINY_PARAMETERS:
        raise ValueError(
            f"its tiny config still has {size / 1e6:.0f}M parameters (limit: "
            f"{MAX_TINY_PARAMETERS / 1e6:.0f}M)"
        )
    for reference in ("sdpa", "eager"):
        try:
            torch.manual_seed(0)
            return (
                config,
                AutoModelForCausalLM.from_config(
                    config, attn_implementation=reference, dtype=torch.float32
                ),
                reference,
            )
        except ValueError:
            if reference == "eager":
                raise
    raise AssertionError("unreachable")


def single_process(model_type: str) -> dict:
    """See the module docstring (runs without sequence parallelism)."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.distributed import set_sequence_parallel_state

    previous = set_sequence_parallel_state(None)
    try:
        try:
            config, ref, reference = _build(model_type)
            vocab = min(ref.get_output_embeddings().weight.shape[0], 128)
            ids = torch.randint(3, vocab, (1, 24), generator=torch.Generator().manual_seed(1))
            ref.eval()
            with torch.no_grad():
                logits = ref(input_ids=ids).logits
                changed = ids.clone()
                changed[0, -1] = 3 + (int(changed[0, -1]) - 2) % (vocab - 3)
                other = ref(input_ids=changed).logits
        except Exception as err:  # noqa: BLE001  (any failure: the type does not build or run this small)
            return {"builds": False, "why": f"{type(err).__name__}: {str(err)[:200]}"}
        if not torch.allclose(logits[:, :-1], other[:, :-1], atol=1e-5):
            return {"builds": True, "decoder": False}
        out = {"builds": True, "decoder": True, "reference": reference}
        try:
            # (a model that picks attention classes from its own table is refused by name here:
            # hf_upipe.attention.registered)
            upipe = AutoModelForCausalLM.from_config(
                config, attn_implementation="upipe", dtype=torch.float32
            )
            upipe.load_state_dict(ref.state_dict())
            results = []
            for model in (ref, upipe):
                model.train()
                model.zero_grad()
                output = model(input_ids=ids, labels=ids)
                output.loss.backward()
                results.append(
                    (
                        output.logits.detach(),
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                    )
                )
            (want, want_grads), (got, got_grads) = results
            error = max(
                [_rel(got, want)]
                + [_rel(got_grads[n], g) for n, g in want_grads.items() if n in got_grads]
            )
            exact = error <= 1e-5 and got_grads.keys() == want_grads.keys()
            out.update(sp1="exact" if exact else "wrong", sp1_error=error)
        except (ValueError, NotImplementedError) as err:
            out.update(sp1="refused", sp1_why=f"{type(err).__name__}: {err}")
        except Exception as err:  # noqa: BLE001
            out.update(sp1="crashed", sp1_why=f"{type(err).__name__}: {str(err)[:300]}")
        return out
    finally:
        set_sequence_parallel_state(previous)


def classify(checks) -> dict:
    """One type's selftest checks -> {"sp2": outcome, "sp2_why" or "sp2_error": ...}."""
    refused = [c.refused for c in checks if c.refused]
    crashed = [c.crashed for c in checks if c.crashed]
    failed = [
        f"{c.batch} {c.name}: {c.error:.1e}"
        for c in checks
        if not (c.refused or c.crashed or c.passed)
    ]
    if refused:
        return {"sp2": "refused", "sp2_why": refused[0]}
    if crashed:
        return {"sp2": "crashed", "sp2_why": crashed[0][:600]}
    if failed:
        return {"sp2": "wrong", "sp2_why": "; ".join(failed)}
    return {"sp2": "exact", "sp2_error": max(c.error for c in checks)}


def verdict(model_type: str, checks) -> dict:
    """The row of a type measured with `allow_unverified=True` (what `hf-upipe selftest` runs):
    {"opt_in": outcome, "opt_in_why"/"opt_in_error", "sp2": what a user gets by default, "sp2_why"/"sp2_error"}.

    For a verified architecture both are the measurement. For an unverified one the default is the support gate's
    refusal (`config_refusal` of the tiny config, its real message: the gate runs first); its opted-in outcome is
    what the self-test reports to a user who checks it.
    """
    from hf_upipe.adapters.support import config_refusal, refusal_error
    from hf_upipe.models.architectures import ARCHITECTURES
    from hf_upipe.models.presets import tiny_config

    measured = classify(checks)
    row = {k.replace("sp2", "opt_in"): v for k, v in measured.items()}
    arch = ARCHITECTURES.get(model_type)
    reason = None if arch is not None and arch.verified else config_refusal(tiny_config(model_type))
    if reason is None:
        row.update(measured)
    else:
        row.update(
            sp2="refused",
            sp2_why=f"{type(refusal_error(reason)).__name__}: {refusal_error(reason)}",
        )
    return row


def matrix_rank(
    rank: int, world: int, types: list[str], seq_len: int = 29, opt_in: bool = False
) -> dict:
    """One rank of a job over `types` (the ranks share the one-process checks, then every rank runs every type
    under SP; each rank returns its own rows).

    By default as a user runs it: the support gate refuses an unverified type before any collective, so only the
    verified types are compared (the test suite's matrix). `opt_in=True` runs every type opted in and classifies
    it with `verdict` (the benchmark's matrix)."""
    import hf_upipe
    from hf_upipe.tools.selftest import Check, check_model, raised_by_hf_upipe

    hf_upipe.init_sequence_parallel(world, allow_unverified=opt_in)
    mine = {
        t: single_process(t) for t in types[rank::world]
    }  # the one-process checks, split over the ranks
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    rows = {t: row for part in every for t, row in part.items()}
    results = {}
    for model_type in types:
        row = rows[model_type]
        if row.get("builds") and row.get("decoder"):
            spec = dict(lora=False, seq_len=seq_len, heads_per_chunk=1, fused=True, breakage=None)
            try:
                checks = check_model(model_type, spec, rank, world)
            except Exception as err:  # noqa: BLE001  (classified, not raised: the job goes on)
                said = f"{type(err).__name__}: {err}"
                refused = isinstance(err, (ValueError, NotImplementedError)) and raised_by_hf_upipe(
                    err
                )
                checks = [
                    Check(
                        model_type,
                        "-",
                        "runs under SP",
                        float("nan"),
                        0.0,
                        **({"refused": said} if refused else {"crashed": said}),
                    )
                ]
            row.update(verdict(model_type, checks) if opt_in else classify(checks))
        results[model_type] = row
    return results


def summary(results: dict) -> dict:
    decoders = {t: r for t, r in results.items() if r.get("builds") and r.get("decoder")}
    return {
        "types": len(results),
        "decoder_only_tiny": len(decoders),
        **{
            key: {o: sum(r.get(key) == o for r in decoders.values()) for o in OUTCOMES}
            for key in ("sp1", "sp2", "opt_in")
        },
    }


def _path(model_type: str, row: dict) -> str:
    """How a type runs under SP: "fused", "registered" (exact on the registered path) or "" (refused); a
    multimodal type verified for text input only runs its language model's path."""
    from hf_upipe.models.architectures import ARCHITECTURES, TEXT_MODEL_TYPES

    arch = ARCHITECTURES.get(model_type)
    prefix = ""
    if arch is not None and arch.text_only:  # its language model's attention decides the path
        arch = ARCHITECTURES.get(TEXT_MODEL_TYPES.get(model_type, "")) or arch
        prefix = "text only, "
    if arch is not None and arch.fused:
        return prefix + "fused"
    return prefix + "registered" if row.get("sp2") == "exact" else ""


def _why(row: dict) -> str:
    """The first sentence of a refusal, without the common preamble."""
    if row.get("sp2") == "exact":
        return ""
    return (row.get("sp2_why") or "").split("hf_upipe: ", 1)[-1].split(". ")[0].replace("|", "/")


def _cell(results: dict, model_type: str) -> str:
    row = results.get(model_type)
    if row is None:
        return "not in this release"
    if not row.get("builds"):
        return "does not build tiny"
    return row.get("sp2") if row.get("decoder") else "not a decoder"


def support_table(reports: list[dict]) -> str:
    """Markdown: the counts of each report (`benchmarks/architecture_matrix.py`'s JSON, one per transformers
    release, newest first), then one row per type that builds tiny as a decoder in any of them: its SP 2 outcome
    on each release, and its path, opted-in outcome (when it differs) and refusal on the newest release that
    has it. A pure function of the reports and the registry (docs/models.md is generated from it)."""
    versions = [r["transformers"] for r in reports]
    lines = []
    for r in reports:
        n = r["summary"]
        sp2 = ", ".join(f"{n['sp2'][o]} {o}" for o in OUTCOMES)
        lines.append(
            f"- transformers {r['transformers']}: {n['types']} causal-LM types, "
            f"{n['decoder_only_tiny']} build tiny as decoders; at SP 2: {sp2}."
        )
    lines += [
        "",
        "| model_type | "
        + " | ".join(f"SP 2, transformers {v}" for v in versions)
        + " | path | opted in (selftest) | why refused |",
        "|---|" + "---|" * (len(versions) + 3),
    ]
    decoders = sorted(
        {
            t
            for r in reports
            for t, row in r["results"].items()
            if row.get("builds") and row.get("decoder")
        }
    )
    for model_type in decoders:
        newest = next(
            r["results"][model_type]
            for r in reports
            if r["results"].get(model_type, {}).get("decoder")
        )
        opt_in = newest.get("opt_in") if newest.get("opt_in") != newest.get("sp2") else ""
        cells = [model_type, *(_cell(r["results"], model_type) for r in reports)]
        cells += [_path(model_type, newest), opt_in, _why(newest)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
