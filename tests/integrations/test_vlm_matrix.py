"""The architecture matrix's vision-language rows as a test: every image-text-to-text type of the installed
transformers at SP 2 with images, as a user runs it (the support gate on): exact against one process, or refused
with hf_upipe's own error on every rank; never wrong, crashed or hung.

One 2-rank job runs every type (`hf_upipe.tools.vlm_matrix.vlm_rank`): the verified types (`hf_upipe.vlm.VISION_TYPES`)
tiny with weights against one process, every other type built on the meta device and run through prepare_model,
shard_multimodal_batch and the forward with pixel inputs. `benchmarks/architecture_matrix.py` writes the same rows
type by type under the committed JSON's "vlm" key, from which docs/models.md's table is generated.
Checked here:
- no type that builds is "wrong" or "crashed", and the job finishes (no hang);
- both ranks reach the same outcome, with the same reason, for every type;
- the exact types are the verified ones, each compared (its worst relative error below the self-test's tolerance);
- a multimodal type verified for text input only refuses images both in shard_multimodal_batch and in its forward;
- the committed rows of the installed release: nothing exact there is refused now, and the same types build.
"""

import json
import os

import pytest
import transformers

from hf_upipe.models.architectures import ARCHITECTURES
from hf_upipe.tools.vlm_matrix import vlm_rank, vlm_summary, vlm_types
from hf_upipe.vlm import VISION_TYPES
from tests._dist import run_distributed

pytestmark = pytest.mark.slow

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "benchmarks",
    "results",
)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(vlm_rank, 2, vlm_types(), timeout=900)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks[0]


@pytest.fixture(scope="module")
def committed():
    """The committed "vlm" rows of the installed transformers release, if any."""
    for name in (
        "architecture_matrix.json",
        f"architecture_matrix-{transformers.__version__}.json",
    ):
        path = os.path.join(RESULTS, name)
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
            if report["transformers"] == transformers.__version__ and "vlm" in report:
                return report["vlm"]["results"]
    pytest.skip(f"no committed vision-language matrix of transformers {transformers.__version__}")


def test_nothing_is_silently_wrong_or_crashed(results):
    bad = {
        t: (r["sp2"], r["sp2_why"])
        for t, r in results.items()
        if r.get("builds") and r["sp2"] not in ("exact", "refused")
    }
    assert not bad, bad
    print("\n", vlm_summary(results))


def test_every_rank_reaches_the_same_outcome(ranks):
    first, second = (
        {t: (r.get("sp2"), r.get("sp2_why")) for t, r in rows.items()} for rows in ranks
    )
    assert first == second


def test_the_exact_types_are_the_verified_ones(results):
    exact = {t: r["sp2_error"] for t, r in results.items() if r.get("sp2") == "exact"}
    assert set(exact) == set(VISION_TYPES) & set(results), exact
    assert all(0 <= e < 1e-5 for e in exact.values()), exact
    for t, r in results.items():
        if r.get("builds") and t not in exact:
            assert r["sp2_why"].startswith(("NotImplementedError: ", "ValueError: ")), (t, r)


def test_text_only_types_refuse_images_on_both_ways_in(results):
    text_only = [
        t for t, a in ARCHITECTURES.items() if a.text_only and results.get(t, {}).get("builds")
    ]
    assert text_only, "no multimodal type verified for text input only builds here"
    for t in text_only:
        refusals = results[t]["refusals"]
        assert list(refusals) == ["shard_multimodal_batch", "forward with pixel_values"], (
            t,
            refusals,
        )
        assert "for text input only" in refusals["forward with pixel_values"], (t, refusals)


def test_nothing_exact_before_is_refused_now(results, committed):
    was_exact = {t for t, r in committed.items() if r.get("sp2") == "exact"}
    assert {t for t in was_exact if results[t].get("sp2") != "exact"} == set()


def test_the_types_that_build_are_those_of_the_committed_matrix(results, committed):
    def built(rows):
        return sorted(t for t, r in rows.items() if r.get("builds"))

    assert built(results) == built(committed)
