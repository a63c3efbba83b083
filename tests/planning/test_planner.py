"""The planner: its predictions against real runs, its choices, its search, its command line and its errors.

(a) Validation: for one configuration of `test_train_step.CASES` (fused with offload at SP 2 with two SP groups),
    the plan of a 5-layer model, extrapolated from 3- and 4-layer simulations, is within 5% of the tracked peak of a
    real 4-rank gloo FSDP2 step of that 5-layer model (in practice it is within a few bytes); `test_train_step`
    checks every case's simulation (LoRA and registered ones too) against those real runs.
(b) Choice: with the GPU memory set between two rungs of the ladder, the plan picks the first rung that fits.
(c) Llama3-8B on 8 x 80 GiB: UPipe fits 5M tokens (2**20 each); Ulysses mode (same code, all heads) does not.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random

import pytest
import torch

from hf_upipe.cli import main
from hf_upipe.planning.planner import Margin, candidates, ladder, parse_bytes, plan, search_max
from hf_upipe.planning.step_time import step_time
from hf_upipe.planning.train_step import StepSettings
from hf_upipe.planning.train_step import device_twin as twin
from tests.planning.test_train_step import CASES, LAYERS, TINY, WORLD, S, real_runs

PLANNED = (0,)


@pytest.mark.slow
def test_plan_within_5_percent_of_real_gloo_runs(monkeypatch):
    import hf_upipe.ops.tiled_loss as tiled_loss

    real = real_runs(PLANNED)
    monkeypatch.setattr(tiled_loss, "_BLOCK_BYTES", 4096)  # as in the workers
    five = dict(TINY, num_hidden_layers=LAYERS)
    # one of the five cases (fused + offload at SP 2, two SP groups): its plan simulates 3 and 4 layers and
    # extrapolates; every case's simulation is checked against the same real runs in test_train_step
    for i in PLANNED:
        settings, sp, dtype, lora = CASES[i]
        measured = real[i][0]
        p = plan(
            five,
            gpus=WORLD,
            sp_size=sp,
            seq_len=S,
            settings=settings,
            dtype=dtype,
            gpu_memory="1GiB",
            lora=lora,
        )
        assert not p.exact
        assert abs(p.tensor_peak - measured) <= 0.05 * measured, (
            settings,
            sp,
            p.tensor_peak,
            measured,
        )


def _tiny_model():
    """8 query / 2 k/v heads, a wide MLP: every rung of the ladder saves memory at 16K tokens on 2 ranks. Four
    layers: the planner simulates them all (no extrapolation), one simulation per length and setting."""
    return dict(
        TINY,
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=4,
        vocab_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    )


@pytest.mark.slow
def test_the_ladder_saves_memory():
    cfg, seq = _tiny_model(), 16384
    rungs = ladder(cfg, 2)
    # the offload rungs' disk twins close the ladder (chosen only where the host memory binds)
    assert rungs[6:] == [dataclasses.replace(r, offload="disk") for r in rungs[2:6]]
    rungs = rungs[:6]
    assert [r.heads_per_chunk for r in rungs] == [None, None, None, 2, 1, 1]
    assert (rungs[0].tiled_mlp, rungs[0].offload, rungs[1].tiled_mlp, rungs[2].offload) == (
        False,
        "none",
        True,
        "cpu",
    )
    assert (
        rungs[-1].mlp_chunk_tokens == 16 and rungs[-1].loss_chunk_tokens == 2**24 // 128
    )  # a quarter of the defaults
    pairs = [(c, r) for c, r in candidates(cfg, 2) if c.offload != "disk"]
    # every rung, its save-mode variant, and with several stages (c = 2, 1) the overlapped ones in both modes
    assert len(pairs) == 3 * 2 + 3 * 4 and [c for c, r in pairs if c == r] == rungs
    assert all(
        r in rungs and (c.fused_backward, c.overlap) != ("recompute", False)
        for c, r in pairs
        if c != r
    )

    def need(c):
        return plan(
            cfg,
            gpus=2,
            seq_len=seq,
            settings=c,
            margin=Margin(0.0, 0),
            gpu_memory=2**40,
            headroom=0,
        ).required

    # each rung saves memory on this model (that a variant needs at least its rung's memory, which lets the planner
    # skip a variant whose rung does not fit, is checked on the attention block in tests/planning/
    # test_attention_block.py: save above recompute, overlapped above synchronous)
    assert need(rungs[0]) > need(rungs[1]) > need(rungs[2]) > need(rungs[3]) > need(rungs[4])


def test_plan_picks_the_fastest_candidate_that_fits(monkeypatch):
    """The choice, against every candidate's memory: simulated bytes replaced by a table (each rung less than the one
    before, each variant more than its rung), so every budget can be checked exhaustively in no time."""
    import hf_upipe.planning.planner as planner

    cfg, seq = _tiny_model(), 16384
    pairs = candidates(cfg, 2)
    rung_index = {r: k for k, r in enumerate(r for c, r in pairs if c == r)}
    rng = random.Random(3)
    table = {
        c: (10 - rung_index[r]) * 10**6 + (0 if c == r else rng.randint(1, 3 * 10**6))
        for c, r in pairs
    }
    monkeypatch.setattr(
        planner,
        "step_reserved",
        lambda config, settings, **kw: {
            "by_category": {"attention": table[settings]},
            "peak": table[settings],
            "reserved": {"default": table[settings], "expandable": table[settings]},
        },
    )
    monkeypatch.setattr(
        planner, "_SIMULATIONS", collections.OrderedDict()
    )  # none of the real ones cached before

    def secs(c):
        return step_time(cfg, c, seq_len=seq, sp_size=2, world=2, gpus_per_node=2).seconds

    margin = Margin(0.0, 0)
    for memory in sorted(set(table.values())) + [min(table.values()) - 1]:
        p = plan(
            cfg,
            gpus=2,
            seq_len=seq,
            margin=margin,
            gpu_memory=memory,
            headroom=0,
            model_offload="none",
        )
        # fastest first, the disk candidates (the device memory of their "cpu" twins) after all others
        judged = [(c.offload == "disk", t) for c, _, _, t in p.tried]
        assert judged == sorted(judged)
        fitting = [c for c in table if c.offload != "disk" and table[c] <= memory]
        if not fitting:  # nor their disk twins: the last rung without disk is reported
            kept = [r for c, r in pairs if c == r and c.offload != "disk"]
            assert not p.fits and p.settings == kept[-1] and len(p.tried) == len(pairs)
            continue
        assert p.fits and secs(p.settings) == min(secs(c) for c in fitting), (
            memory
        )  # the fastest that fits
        assert p.tried[-1][0] == p.settings and p.tried[-1][3] == secs(p.settings)
        # what was judged before it does not fit; what was not simulated has a rung that does not fit
        rung_of = dict(pairs)
        for c, need, _, _ in p.tried[:-1]:
            assert need > memory if need is not None else table[twin(rung_of[c])] > memory


def test_max_context_search_equals_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        a, b, q = rng.uniform(0, 100), rng.uniform(0.1, 10), rng.uniform(0, 0.05)
        limit, steps = rng.uniform(0, 800) * 1000, rng.randint(1, 400)

        def required(length):
            return int(1000 * (a + b * length + q * length * length))

        want = max([k for k in range(1, steps + 1) if required(k) <= limit] or [0])
        assert search_max(required, limit, 1, steps) == want


@pytest.mark.slow
def test_max_context_is_the_edge_of_fitting():
    cfg = _tiny_model()
    settings = StepSettings("fused", 1)
    kw = dict(gpus=2, settings=settings, gpu_memory="120MiB", margin=Margin(0.1, 2**20))
    p = plan(cfg, max_context=True, step=2048, **kw)
    assert p.max_seq_len > 2048 and p.fits and p.seq_len == p.max_seq_len
    assert p.required <= 0.95 * p.gpu_memory  # the default headroom: 5% of the GPU stays free
    assert not plan(cfg, seq_len=p.max_seq_len + 2048, **kw).fits


@pytest.mark.slow
def test_llama3_8b_upipe_fits_5m_where_ulysses_mode_does_not():
    five = 5 * 2**20
    stack = dict(tiled_mlp=True, offload="cpu")
    upipe = plan(
        "llama3-8b",
        gpus=8,
        gpu_memory="80GiB",
        seq_len=five,
        settings=StepSettings("fused", 1, **stack),
    )
    ulysses = plan(
        "llama3-8b",
        gpus=8,
        gpu_memory="80GiB",
        seq_len=five,
        settings=StepSettings("fused", None, **stack),
    )
    assert upipe.fits and not ulysses.fits
    assert upipe.by_category["attention"] < 0.6 * ulysses.by_category["attention"]
    # tensor peaks only go down: issuing the recompute backward's output and d a all-to-alls together once added a
    # [S, c, D] bf16 buffer (5 GiB here, c = 4 local heads) to Ulysses mode's peak; the tiled backward's float32
    # dk/dv sums (Ulysses mode on this GQA model) and dq sum (UPipe) are in these figures (33.91 and 17.60 GiB of
    # attention measured)
    assert ulysses.by_category["attention"] <= 36_406_568_960, ulysses.by_category
    assert upipe.tensor_peak <= 55_903_378_580, upipe.tensor_peak
    assert upipe.host_bytes_per_gpu == 31 * (five // 8) * 4096 * 2


def test_parse_bytes():
    assert (
        parse_bytes("80GiB") == 80 * 2**30
        and parse_bytes("80 GB") == 80 * 10**9
        and parse_bytes(1024) == 1024
    )
    assert parse_bytes("1.5MiB") == 3 * 2**19
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("eighty")


def test_bad_inputs_name_the_numbers_and_the_fix():
    cfg = _tiny_model()  # 4 query heads, 2 k/v heads
    with pytest.raises(ValueError, match="seq_len .* or max_context"):
        plan(cfg, gpus=2)
    with pytest.raises(ValueError, match=r"sp_size=3 .*valid"):
        plan(cfg, gpus=3, seq_len=3 * 1024)
    with pytest.raises(ValueError, match="not divisible by sp_size=2; round it to 1000"):
        plan(cfg, gpus=2, seq_len=1001)
    with pytest.raises(ValueError, match="does not divide the 4 GPUs"):
        plan(cfg, gpus=2, nodes=2, sp_size=3, seq_len=3 * 1024)
    with pytest.raises(ValueError, match="not a preset"):
        plan("no-such-model", gpus=2, seq_len=1024)


@pytest.mark.slow
def test_command_line(tmp_path, capsys):
    from transformers import LlamaConfig

    cfg = _tiny_model()
    LlamaConfig(**cfg, tie_word_embeddings=False).save_pretrained(tmp_path)
    base = ["plan", "--model", str(tmp_path / "config.json"), "--gpus", "2"]
    assert main(base + ["--seq-len", "16384", "--gpu-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    launch = next(line for line in out.splitlines() if line.startswith("launch: "))
    assert "FITS" in out and "per-GPU peak" in out and " UPIPE_SP_SIZE=2 " in launch
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert rows.index("tensors") < rows.index("reserved") < rows.index("allowance")
    assert (
        main(
            base
            + ["--seq-len", "16384", "--gpu-memory", "8MiB", "--heads-per-chunk", "1", "--json"]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["margin"] is None
    assert data["required"] == data["predicted_reserved"] + data["allowance"] > data["tensor_peak"]
    flat = base + ["--seq-len", "16384", "--margin", "0.1", "--reserved", "1MiB", "--json"]
    assert main(flat) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["required"] == data["tensor_peak"] + data["margin"]
        and data["predicted_reserved"] is None
    )
    assert (
        main(
            base + ["--seq-len", "16384", "--heads-per-chunk", "all", "--offload", "none", "--json"]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["heads_per_chunk"] is None and data["settings"]["offload"] == "none"
    assert data["tried"] == []  # fixed settings: nothing chosen
    assert (
        main(
            base
            + [
                "--seq-len",
                "16384",
                "--heads-per-chunk",
                "all",
                "--offload",
                "none",
                "--json",
                "--lora-rank",
                "4",
                "--lora-targets",
                "q_proj,v_proj",
            ]
        )
        == 0
    )
    lora = json.loads(capsys.readouterr().out)
    assert lora["lora"] == {"rank": 4, "targets": ["q_proj", "v_proj"]}
    # frozen bf16 base: half the parameter shards of fp32 master weights, and Adam states for the adapters only
    assert lora["by_category"]["optimizer"] < 0.1 * data["by_category"]["optimizer"]
    assert main(base + ["--seq-len", "1001"]) == 2
    assert "round it to 1000" in capsys.readouterr().err


def test_plan_settings_become_an_upipe_config():
    p = plan(_tiny_model(), gpus=2, seq_len=16384, gpu_memory="64GiB", margin=Margin(0.1, 0))
    cfg, s = p.upipe_config(), p.settings
    assert (
        cfg.sp_size == 2
        and cfg.heads_per_chunk == (s.heads_per_chunk or "all")
        and cfg.offload == s.offload
    )
    assert (cfg.tiled_mlp, cfg.fused_backward, cfg.overlap_comm) == (
        s.tiled_mlp,
        s.fused_backward,
        s.overlap,
    )
    assert (
        cfg.fused_attention and p.fits and p.tried[0][0] == s
    )  # the fastest candidate fits 64 GiB
    assert p.required == p.tensor_peak + int(0.1 * p.tensor_peak)
    assert torch.bfloat16 == p.dtype


def test_host_memory_for_offload_is_checked():
    cfg, settings = _tiny_model(), StepSettings("fused", 1)  # offloads to host
    kw = dict(gpus=2, settings=settings, gpu_memory="64GiB")
    p = plan(cfg, seq_len=16384, **kw)
    node = p.host_bytes_per_gpu * 2
    assert (
        node == 2 * 3 * 8192 * 64 * 2
    )  # 2 GPUs x 3 offloaded layers (the last stays) x [8192, 64] bf16
    assert plan(cfg, seq_len=16384, host_memory=node, **kw).fits
    short = plan(cfg, seq_len=16384, host_memory=node - 1, **kw)
    assert not short.fits and short.required <= short.gpu_memory and not short.host_fits
    assert plan(cfg, max_context=True, host_memory=node, step=2048, **kw).max_seq_len == 16384


@pytest.mark.slow
def test_a_ring_plans_sp_across_nodes_beyond_the_heads():
    """ring_size: SP = gpus x ring by default, the ladder's head chunks over the U = sp / ring ranks of a ring
    shard, the ring in every candidate, in the UPipeConfig and the launch line; the heads are checked against U
    (`test_a_fixed_ring_plan_carries_the_ring` in the fast tier)."""
    from hf_upipe.ops.head_layout import valid_heads_per_chunk

    cfg = _tiny_model()  # 8 query heads, 2 k/v heads
    p = plan(cfg, gpus=2, nodes=2, ring_size=2, seq_len=4096, gpu_memory="64GiB")
    assert p.sp_size == 4 and p.fits and p.settings.ring_size == 2
    assert all(s.ring_size == 2 for s, *_ in p.tried) and p.settings.heads_per_chunk in (
        None,
        *valid_heads_per_chunk(8, 2, 2),
    )
    assert p.upipe_config().ring_size == 2 and "UPIPE_RING_SIZE=2" in p.launch()
    assert "SP 4 (UPipe over 2 x a ring of 2)" in p.table() and p.step_time.parts["ring"] >= 0


def test_a_fixed_ring_plan_carries_the_ring(capsys):
    """One plan of fixed settings (no ladder) over 2 nodes with a ring of 2: SP = gpus x ring, the ring in the
    settings, the UPipeConfig, the launch line and the table; the heads are checked against U = sp / ring."""
    cfg = _tiny_model()  # 8 query heads, 2 k/v heads
    fixed = StepSettings("fused", 2, offload="none")  # 2 heads per chunk: 4 of U = 2 ranks' heads
    two = dict(cfg, num_hidden_layers=2)  # two layers: a quick simulation
    p = plan(two, gpus=2, nodes=2, ring_size=2, seq_len=512, settings=fixed, gpu_memory="64GiB")
    assert (
        p.sp_size == 4 and p.fits and p.settings.ring_size == 2 and p.settings.heads_per_chunk == 2
    )
    assert p.upipe_config().ring_size == 2 and "UPIPE_RING_SIZE=2" in p.launch()
    assert "SP 4 (UPipe over 2 x a ring of 2)" in p.table() and p.step_time.parts["ring"] > 0
    with pytest.raises(
        ValueError,
        match="sp_size=6 / ring_size=2 = 3 ranks per ring shard does not fit 8 query / 2",
    ):
        plan(cfg, gpus=3, nodes=2, ring_size=2, seq_len=6144)
    with pytest.raises(ValueError, match=r"not divisible by sp_size=4 x 2 .*round it to 4088"):
        plan(cfg, gpus=2, nodes=2, ring_size=2, seq_len=4092)
    with pytest.raises(ValueError, match="DeepSpeed's Ulysses has none"):
        plan(cfg, gpus=2, nodes=2, ring_size=2, seq_len=4096, impl="deepspeed")
    assert (
        main(
            [
                "plan",
                "--model",
                "llama3-8b",
                "--gpus",
                "8",
                "--nodes",
                "2",
                "--ring",
                "2",
                "--seq-len",
                "8M",
                "--sp-size",
                "12",
            ]
        )
        == 2
    )
    assert "sp_size=12 does not divide the 16 GPUs" in capsys.readouterr().err


def test_plans_deepspeeds_ulysses_next_to_ours():
    """The peer is planned as it runs (DeepSpeed's attention module in each layer, FSDP2 around them; hf_upipe's
    guard does not refuse it), with the same stack as ours, and its own attention."""
    pytest.importorskip("deepspeed")
    cfg = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        vocab_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    )
    stack = dict(tiled_mlp=True, offload="cpu")
    kw = dict(gpus=4, seq_len=8192, gpu_memory="80GiB")
    peer = plan(cfg, settings=StepSettings("deepspeed", None, **stack), **kw)
    ours = plan(cfg, settings=StepSettings("fused", None, **stack), **kw)
    assert peer.fits and ours.fits
    assert peer.by_category["attention"] > 0 and ours.by_category["attention"] > 0
    assert peer.by_category["attention"] != ours.by_category["attention"]
