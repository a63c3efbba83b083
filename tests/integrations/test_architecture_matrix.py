"""The architecture matrix as a test: every causal-LM type of the installed transformers, built tiny, at SP 1 and SP 2
against one process, as a user runs it (the support gate on): exact or refused with hf_upipe's own error on every
rank, never wrong and never hung.

One 2-rank job runs every type (`hf_upipe.tools.matrix.matrix_rank`); the gate refuses an unverified type before any
collective, so only the verified ones are compared in full. `benchmarks/architecture_matrix.py` also runs every
unverified type opted in (what `hf-upipe selftest` shows a user) and writes the results that docs/models.md's
support table is generated from.
Checked here:
- no type is "wrong" (a silent mismatch) or "crashed" at SP 1 or SP 2, and the job finishes (no hang);
- both ranks reach the same outcome for every type (a refusal is raised on every rank);
- every architecture the registry lists as verified is exact at SP 2 (a transformers upgrade that breaks one fails
  here), and every exact one is in the registry;
- no decoder is refused only as "not verified": the support gate names the mechanism that refuses it;
- no type that the committed matrix found exact is refused now, and the types that build tiny and are decoders are
  those of the committed matrix (a transformers upgrade that adds or changes one fails here: re-run the benchmark
  and review the registry). Both compare like with like: on another transformers release than the committed
  matrix's they are skipped.
"""

import json
import os

import pytest
import transformers
from packaging.version import Version

from hf_upipe.models.architectures import ARCHITECTURES
from hf_upipe.tools.matrix import causal_lm_types, matrix_rank, summary
from tests._dist import run_distributed

pytestmark = pytest.mark.slow

COMMITTED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "results",
    "architecture_matrix.json",
)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(matrix_rank, 2, causal_lm_types(), timeout=1200)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks[0]


# verified where their attention goes through transformers' attention interface (transformers 5.24); 5.23's
# bypasses it, and the support gate refuses them there by that mechanism
_INTERFACE_FROM = {"codegen": "5.24", "gptj": "5.24"}


@pytest.fixture(scope="module")
def committed():
    """The committed matrix of the installed transformers: the newest release's in architecture_matrix.json, the
    pinned one's beside it (architecture_matrix-<version>.json); a release with neither has nothing to compare."""
    for path in (COMMITTED, COMMITTED.replace(".json", f"-{transformers.__version__}.json")):
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
            if report["transformers"] == transformers.__version__:
                return report["results"]
    pytest.skip(
        f"no committed matrix of transformers {transformers.__version__}: run "
        "benchmarks/architecture_matrix.py to compare"
    )


def _decoders(results):
    return {t for t, r in results.items() if r.get("builds") and r.get("decoder")}


def test_nothing_is_silently_wrong_or_crashed(results):
    bad = {
        t: (r.get("sp1"), r.get("sp2"), r.get("sp2_why") or r.get("sp1_why"))
        for t, r in results.items()
        if {"wrong", "crashed"} & {r.get("sp1"), r.get("sp2")}
    }
    assert not bad, bad
    print("\n", summary(results))


def test_every_rank_reaches_the_same_outcome(ranks):
    first, second = ranks
    assert first.keys() == second.keys()
    differ = {
        t: (first[t].get("sp2"), second[t].get("sp2"))
        for t in first
        if first[t].get("sp2") != second[t].get("sp2")
    }
    assert not differ, differ


def _refused_before(model_type, row) -> bool:
    since = _INTERFACE_FROM.get(model_type)
    return (
        since is not None
        and Version(transformers.__version__) < Version(since)
        and row.get("sp2") == "refused"
        and "does not go through transformers' attention interface" in row.get("sp2_why", "")
    )


def test_the_registry_is_what_the_matrix_finds_exact(results):
    exact = {t for t, r in results.items() if r.get("sp2") == "exact" or _refused_before(t, r)}
    verified = {t for t, a in ARCHITECTURES.items() if a.verified}
    assert verified & _decoders(results) <= exact, sorted((verified & _decoders(results)) - exact)
    assert exact <= verified, sorted(exact - verified)
    for t in _decoders(results) - exact:
        assert results[t]["sp2"] == "refused" and "hf_upipe" in results[t]["sp2_why"], (
            t,
            results[t],
        )


def test_no_decoder_is_refused_only_as_not_verified(results):
    """Every refusal names its mechanism (`hf_upipe.adapters.support.config_refusal`)."""
    unnamed = {
        t: r.get("sp2_why")
        for t, r in results.items()
        if t in _decoders(results)
        and r.get("sp2") == "refused"
        and "has not verified" in r.get("sp2_why", "")
    }
    assert not unnamed, sorted(unnamed)


def test_nothing_exact_before_is_refused_now(results, committed):
    was_exact = {t for t, r in committed.items() if r.get("sp2") == "exact"}
    assert {t for t in was_exact if results[t].get("sp2") != "exact"} == set()


def test_the_decoders_are_those_of_the_committed_matrix(results, committed):
    assert sorted(_decoders(results)) == sorted(_decoders(committed))
