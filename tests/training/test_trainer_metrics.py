"""UPipeTrainer's `compute_metrics`, `preprocess_logits_for_metrics` and `predict()` equal transformers' Trainer on
one process.

A tiny random Llama (fp32, no training) evaluates 9 rows of 29 tokens (not a multiple of the SP size: the padding
path runs), right-padded, or packed by `DataCollatorWithFlattening` (documents with position_ids restarting).
Checked against the one-process `transformers.Trainer` with the same global batch: the token accuracy of
`compute_metrics` on the argmax ids, the per-document perplexity from a `preprocess_logits_for_metrics` returning
each position's log-probability of its target (rel 1e-4), `predict()`'s label ids (exactly) and predictions (the
same shape; the same argmax ids and log-probabilities on every real token, -100 on padding), `eval_loss`. The
fast tier runs SP 2; the slow tier SP 2 x DP 2 and SP 2 with a ring of 2, and a `preprocess_logits_for_metrics` that
is not per-token (refused on every rank, and on one process).
"""

import numpy as np
import pytest

from tests._dist import run_distributed
from tests.training._metrics_runs import metrics_runs

RTOL = 1e-4
_TIMINGS = ("_runtime", "_per_second", "_preparation_time")  # not compared

CASES = {
    # name: (world, spec overrides); eval batch is per device; the reference uses batch * dp
    "sp2_padded": (2, dict(sp=2)),
    "sp2_packed": (2, dict(sp=2, packed=True)),
}
SLOW_CASES = {
    "sp2dp2_padded": (4, dict(sp=2)),
    "sp2dp2_packed_lora": (4, dict(sp=2, packed=True, lora=True)),
    "sp2_ring2_padded_plainloss": (2, dict(sp=2, ring=2, tiled=False)),
}


def _runs(root, cases: dict) -> dict:
    keys = sorted(
        {
            (w // spec["sp"], bool(spec.get("packed")), bool(spec.get("lora")))
            for w, spec in cases.values()
        }
    )
    refs = [
        dict(
            trainer=t,
            sp=1,
            batch=2 * dp,
            packed=packed,
            lora=lora,
            output_dir=str(root / f"ref{i}"),
        )
        for i, (dp, packed, lora) in enumerate(keys)
        for t in ("hf", "upipe")
    ]
    ref_out = run_distributed(metrics_runs, 1, refs, timeout=300)[0]
    ref = {
        (k, t): ref_out[2 * i + j]
        for i, k in enumerate(keys)
        for j, t in enumerate(("hf", "upipe"))
    }
    got = {}
    for world in sorted({w for w, _ in cases.values()}):
        names = [n for n, (w, _) in cases.items() if w == world]
        specs = [
            dict(trainer="upipe", batch=2, output_dir=str(root / n), **cases[n][1]) for n in names
        ]
        outs = run_distributed(metrics_runs, world, specs, timeout=400)
        for i, name in enumerate(names):
            world_, spec = cases[name]
            key = (world_ // spec["sp"], bool(spec.get("packed")), bool(spec.get("lora")))
            got[name] = ([rank_out[i] for rank_out in outs], ref[(key, "hf")], ref[(key, "upipe")])
    return got


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= RTOL * abs(want) + 1e-12, f"{what}: {got} vs {want}"


def _check(ranks: list, ref: dict, same_rows: bool) -> None:
    for out in ranks:  # every rank reports the same
        for setup in ("accuracy", "ppl"):
            mine, want = out[setup], ref[setup]
            for which in ("metrics", "predict_metrics"):
                m, w = mine[which], want[which]
                keys = [k for k in w if not k.endswith(_TIMINGS)]
                assert sorted(keys) == sorted(k for k in m if not k.endswith(_TIMINGS))
                for k in keys:
                    _close(m[k], w[k], f"{setup} {which} {k}")
            if (
                not same_rows
            ):  # packed rows hold other documents per batch: only the metrics compare
                continue
            assert mine["predictions"].shape == want["predictions"].shape
            np.testing.assert_array_equal(mine["label_ids"], want["label_ids"])
            real = want["label_ids"] != -100
            want_pad = mine["mask"] == 0  # padding: -100 (packed rows have none)
            pred, ref_pred = mine["predictions"], want["predictions"]
            if setup == "accuracy":
                np.testing.assert_array_equal(pred[real], ref_pred[real])
            else:
                np.testing.assert_allclose(pred[real], ref_pred[real], rtol=RTOL, atol=1e-5)
            if isinstance(
                want_pad, np.ndarray
            ):  # right padding: -100 (the Trainer's: the pad's argmax)
                assert (pred[want_pad] == -100).all() and (pred[~want_pad] != -100).all()
            elif (
                setup == "accuracy"
            ):  # packed: -100 only where the Trainer pads batches to concatenate
                np.testing.assert_array_equal(pred == -100, ref_pred == -100)


def _check_case(got, name, cases):
    ranks, hf, upipe_one = got[name]
    world, spec = cases[name]
    same_rows = not (spec.get("packed") and world // spec["sp"] > 1)
    assert hf["accuracy"]["metrics"]["eval_targets"] > 100
    assert hf["ppl"]["metrics"]["eval_docs"] >= 9
    _check([upipe_one], hf, same_rows=True)  # UPipeTrainer on one process: aligned targets too
    _check(ranks, hf, same_rows)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _runs(tmp_path_factory.mktemp("metrics"), CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_metrics_equal_one_process(fast, name):
    _check_case(fast, name, CASES)


@pytest.mark.slow
def test_metrics_equal_one_process_dp_and_ring(tmp_path_factory):
    got = _runs(tmp_path_factory.mktemp("metrics_slow"), SLOW_CASES)
    for name in SLOW_CASES:
        _check_case(got, name, SLOW_CASES)


@pytest.mark.slow
def test_preprocess_that_is_not_per_token_is_refused_on_every_rank(tmp_path):
    spec = dict(trainer="upipe", sp=2, batch=2, bad=True, output_dir=str(tmp_path))
    one = dict(spec, sp=1, output_dir=str(tmp_path / "one"))  # refused alike on one process
    ranks = run_distributed(metrics_runs, 2, [spec], timeout=300)
    for rank in ranks + run_distributed(metrics_runs, 1, [one], timeout=300):
        msg = rank[0]["bad"]
        assert msg.startswith(
            "ValueError: preprocess_logits_for_metrics must return one value per token"
        )
        assert "[B, T, ...]" in msg and "shape ()" in msg
