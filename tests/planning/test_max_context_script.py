"""benchmarks/gpu/max_context.py on CPU: its search, and its whole control flow as a dry run (toy model, real
measuring subprocesses of benchmarks/gpu/max_context_step.py, the planner's predictions, the JSON), which is all a
machine without a GPU can check."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def script():
    path = os.path.join(ROOT, "benchmarks", "gpu", "max_context.py")
    spec = importlib.util.spec_from_file_location("max_context_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Fits:
    """A search whose GPU holds lengths up to `longest` tokens; records what was probed."""

    def __init__(self, longest):
        self.longest, self.probed = longest, []

    def probe(self, impl, settings, seq_len):
        self.probed.append(seq_len)
        return {"fits": seq_len <= self.longest}


@pytest.mark.parametrize("longest", [0, 1, 2, 3, 7, 8, 9, 20, 37])
@pytest.mark.parametrize("start", [1, 5, 8, 30])
def test_bisect_finds_the_longest(script, longest, start):
    search = _Fits(longest * 10)
    found = script.bisect(search, "upipe", {}, start * 10, 10, max_probes=20)
    assert found["longest"] == longest * 10 and found["exact"]
    assert len(set(search.probed)) == len(search.probed) == found["probes"]
    assert found["probes"] <= 2 + 2 * max(1, abs(longest - start)).bit_length()


def test_bisect_stops_at_max_probes_and_on_failures(script):
    search = _Fits(1000)
    found = script.bisect(search, "upipe", {}, 10, 10, max_probes=3)
    assert found["probes"] == 3 and not found["exact"] and found["longest"] == 40  # 10, 20, 40
    assert found["bracket_tokens"] == [40, None]

    class Failing:
        def probe(self, *a):
            return {"fits": None}

    assert script.bisect(Failing(), "upipe", {}, 10, 10, 5)["longest"] is None


def test_refused_without_cuda_unless_dry_run(script):
    with pytest.raises(SystemExit) as exc:
        script.main(["--out", "/nonexistent"])
    assert exc.value.code == 2


@pytest.mark.slow
def test_dry_run_everything(script, tmp_path, monkeypatch):
    """Both of hf_upipe's implementations, the real-vs-hollow check (on CPU the hollow twin is exact: no difference)
    and the search with its ratio to our Ulysses mode. (DeepSpeed's Ulysses runs through the same probe, one process
    per measurement, with its own step: tests/training/test_deepspeed.py checks that step.)

    The bisection: the toy GPU holds the tensors of 3 units, so each implementation's two hollow probes (2 units,
    then 3) both fit, each measured in its own process with the planner's prediction beside it; --resume measures
    nothing again. (The fast tier runs this script's main, bisection and --resume through
    tests/planning/test_verify_script.py's dry run, its children in that process, and `bisect` above.)"""
    out = str(tmp_path)
    args = ["--cpu-dry-run", "--impls", "upipe,ulysses", "--max-probes", "2", "--out", out]
    assert script.main(args) == 0
    doc = json.load(open(os.path.join(out, "cpu-dry-run", "max_context.json")))
    impls = {row["impl"] for row in doc["sections"]["check"]}
    assert {"upipe", "ulysses"} <= impls
    for row in doc["sections"]["check"]:
        assert row["max_allocated_diff"] == 0 and row["max_allocated_real"] > 0
    found = doc["sections"]["max_context"]
    for impl in impls:
        assert found[f"{impl}@2"]["longest"] > 0
    assert found["upipe@2"]["longest"] == 3 * 1024  # the toy GPU's 3 units
    assert found["ulysses@2"]["ratio_to_ulysses"] == 1.0
    assert found["upipe@2"]["planner_max"] > 0 and found["upipe@2"]["bracket_tokens"] == [
        3072,
        None,
    ]
    probes = [p for p in doc["sections"]["probes"] if p["impl"] == "upipe" and p["hollow"]]
    assert [p["seq_len"] for p in probes] == [2048, 3072] and [p["fits"] for p in probes] == [
        True,
        True,
    ]
    for p in probes:
        assert p["kernel"] == "hollow-sdpa" and p["settings"]["impl"] == "fused"
        assert p["max_reserved"] == p["tracked_peak"] > 0 and p["predicted"]["required"] > 0
    assert doc["environment"]["command"] and doc["environment"]["torch"]
    monkeypatch.setattr(script, "run_child", lambda *a: pytest.fail("measured again"))
    assert script.main(args + ["--resume"]) == 0


def test_shared_host_pool_hands_one_buffer_per_shape(script):
    import torch
    from max_context_step import SharedHostPool  # (the script put its folder on sys.path)

    pool = SharedHostPool()
    a = pool.take((4, 8), torch.bfloat16)
    pool.give(a)
    assert pool.take((4, 8), torch.bfloat16) is a
    assert pool.take((4, 8), torch.float32) is not a and pool.take((2, 8), torch.bfloat16) is not a
    assert a.device.type == "cpu" and a.shape == (4, 8)
