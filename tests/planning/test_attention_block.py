"""Attention-block memory: the fake simulation equals real gloo runs, and memory follows the op's closed form.

(a) `simulate_attention_block` (rank 0 of a fake world, fake tensors) gives exactly the tracked peaks of rank 0 of
    a real 2-rank gloo run on real fp32 tensors, for UPipe (heads_per_chunk 1, 2, None) and DeepSpeed-Ulysses.
(b) Forward peaks derived by hand from `hf_upipe/ops/upipe_attention.py` (and transformers' RoPE) match the
    simulation to the byte. The op's own forward peak falls strictly with heads_per_chunk; the block's forward
    peak cannot fall below the RoPE floor (transformers' `apply_rotary_pos_emb`, outside the op), so there only
    the fwd+bwd peak falls strictly at every step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_upipe  # noqa: F401  (registers attn_implementation="upipe")
from hf_upipe.distributed import get_sequence_parallel_state
from hf_upipe.ops.upipe_attention import upipe_attention
from hf_upipe.planning import MemoryTracker, fake_tensors, simulated_world
from hf_upipe.planning.attention_block import measure_attention_block, simulate_attention_block
from tests._dist import run_distributed, settle_collectives

SMALL = dict(hidden=128, heads=8, kv_heads=2, head_dim=16, seq_len=2048)  # P = 2: s = 1024
CHUNKS = (1, 2, None)


def _real_worker(rank, world, impl, chunks, dims):
    """Real fp32 tensors on a gloo group: (forward_peak, peak, unit) per heads_per_chunk, the least of two runs: a
    gloo worker thread can free a tensor later than the program does (on a busy machine), never earlier."""
    settle_collectives()
    out = []
    for c in chunks:
        runs = [
            measure_attention_block(
                impl,
                **dims,
                sp_size=world,
                dtype=torch.float32,
                group=dist.group.WORLD,
                heads_per_chunk=c,
            )
            for _ in range(2)
        ]
        out.append(
            (min(r["forward_peak"] for r in runs), min(r["peak"] for r in runs), runs[0]["unit"])
        )
    assert get_sequence_parallel_state() is None  # measure restored the (absent) SP defaults
    return out


def _simulated(impl, chunks, dims):
    out = []
    for c in chunks:
        r = simulate_attention_block(
            impl, **dims, sp_size=2, dtype=torch.float32, heads_per_chunk=c
        )
        out.append((r["forward_peak"], r["peak"], r["unit"]))
    return out


def test_upipe_simulation_equals_real_gloo_run() -> None:
    real = run_distributed(_real_worker, 2, "upipe", CHUNKS, SMALL)
    sim = _simulated("upipe", CHUNKS, SMALL)
    # Exact: the tracker counts op outputs, whose storages have the same bytes on fake and real tensors. The real
    # run's layout check (a tiny all-gather, skipped on fake tensors) happens after RoPE, below every peak. Without
    # `settle_collectives` the real peak is sometimes one send buffer higher (gloo's thread frees it late).
    assert real[0] == sim
    assert real[1] == real[0]  # both ranks hold the same buffers
    unit = 1024 * 128 * 4
    assert sim[0][2] == unit
    assert all(2 * unit < fwd < peak < 20 * unit for fwd, peak, _ in sim)


def _require_deepspeed() -> None:
    """Skip a test that compares with DeepSpeed's Ulysses where DeepSpeed is not installed (the README's test command
    installs `.[test]` only; `.[bench]` brings it)."""
    pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")


def test_deepspeed_simulation_equals_real_gloo_run() -> None:
    _require_deepspeed()
    real = run_distributed(_real_worker, 2, "deepspeed", (None,), SMALL)
    sim = _simulated("deepspeed", (None,), SMALL)
    assert real[0] == sim  # includes DeepSpeed's all-gather of position_ids (8 bytes per token)
    fwd, peak, unit = sim[0]
    assert (
        4 * unit < fwd <= peak < 12 * unit
    )  # with the incoming gradient not counted, DS peaks in forward


def test_simulation_rejects_bad_input_and_always_resets() -> None:
    with pytest.raises(ValueError, match="impl"):
        simulate_attention_block("ring", **SMALL, sp_size=2)
    with pytest.raises(
        ValueError, match="heads_per_chunk=3"
    ):  # 4 query heads per rank: 3 does not divide them
        simulate_attention_block("upipe", **SMALL, sp_size=2, heads_per_chunk=3)
    assert get_sequence_parallel_state() is None and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="simulate_attention_block"):
        measure_attention_block("upipe", **SMALL, sp_size=2, dtype=torch.float32)


# ---------------------------------------------------------------- (b) closed forms
# Mid-size GQA geometry: P = 4 ranks, 8 query heads and 2 k/v heads per rank (4 query heads per k/v head), bf16.
MID = dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, seq_len=65536)
P, BYTES = 4, 2


def _stage_heads(c: int | None) -> tuple[int, int]:
    """(query heads c, k/v heads kc) one stage moves per rank; Hk >= P here, so no k/v replication."""
    H, Hk = MID["heads"], MID["kv_heads"]
    q_per_rank, group = H // P, H // Hk
    c = q_per_rank if c is None else c
    return c, max(1, c // group)


def _predicted_op_forward(c: int | None) -> int:
    """Forward peak of `upipe_attention_forward` alone (inputs not counted), read off its stage loop.

    Live at the last stage's kernel call: out [s, H, D] (preallocated); kh, vh [S, kc, D] of EVERY k/v chunk so
    far, i.e. all Hk/P of this rank's k/v heads (kept for the backward, which then sends no k/v again);
    qh [S, c, D] (the q receive buffer; its send buffer died with `seq_to_head`) and the kernel's oh [S, c, D];
    every stage's lse [c, S] fp32, i.e. H/P * S * 4 bytes in all. Earlier moments hold at most as much: the q
    exchange holds send + recv (2 buffers of c heads), the output exchange oh + its receive buffer (oh is already
    in the [S, B, c, D] send layout: no copy), a k/v exchange the kept chunks + send + recv (kc <= c).
    """
    H, Hk, D, S = MID["heads"], MID["kv_heads"], MID["head_dim"], MID["seq_len"]
    c, _ = _stage_heads(c)
    out = S // P * H * D * BYTES
    q_stage, kv_kept = S * c * D * BYTES, S * (Hk // P) * D * BYTES
    lses = H // P * S * 4
    return out + 2 * kv_kept + 2 * q_stage + lses


def _rope_floor() -> int:
    """Forward peak of transformers' `apply_rotary_pos_emb` in LlamaAttention (x and cos/sin not counted).

    While q is rotated: k and v projections, q, q*cos, rotate_half(q) (a cat), rotate_half(q)*sin -> 4 q-sized
    tensors + k + v. While k is rotated: q (still referenced by the caller), q_embed, v, k, k*cos, ... -> 2 q + 5 k.
    """
    s = MID["seq_len"] // P
    q = s * MID["heads"] * MID["head_dim"] * BYTES
    kv = s * MID["kv_heads"] * MID["head_dim"] * BYTES
    return max(4 * q + 2 * kv, 2 * q + 5 * kv)


def _predicted_block_forward(c: int | None) -> int:
    """Block forward peak: RoPE, or the stage loop on top of the saved q_embed, k_embed and v (the projections
    themselves are dead by then: RoPE's multiplications save only cos/sin)."""
    s = MID["seq_len"] // P
    saved = s * (MID["heads"] + 2 * MID["kv_heads"]) * MID["head_dim"] * BYTES
    return max(_rope_floor(), saved + _predicted_op_forward(c))


def _op_forward_peak(c: int | None) -> int:
    H, Hk, D, S = MID["heads"], MID["kv_heads"], MID["head_dim"], MID["seq_len"]
    with simulated_world(P) as world, fake_tensors(torch.bfloat16):
        q = torch.empty(1, S // P, H, D, requires_grad=True)
        k, v = (torch.empty(1, S // P, Hk, D, requires_grad=True) for _ in range(2))
        with MemoryTracker() as tracker:
            upipe_attention(q, k, v, group=world, heads_per_chunk=c)
        return tracker.peak_bytes


MID_CHUNKS = (None, 4, 2, 1)


def test_op_forward_peak_matches_closed_form_and_falls_strictly() -> None:
    measured = [_op_forward_peak(c) for c in MID_CHUNKS]
    assert measured == [_predicted_op_forward(c) for c in MID_CHUNKS]
    # the differences: 2 (q send/recv, or kernel output + output recv) q-stage buffers per query head moved
    D, S = MID["head_dim"], MID["seq_len"]
    for (c1, m1), (c2, m2) in zip(zip(MID_CHUNKS, measured), zip(MID_CHUNKS[1:], measured[1:])):
        (h1, _), (h2, _) = _stage_heads(c1), _stage_heads(c2)
        assert m1 - m2 == 2 * S * D * BYTES * (h1 - h2) > 0
    MiB = 2**20
    assert [m / MiB for m in measured] == [226.0, 162.0, 130.0, 114.0]


def test_block_memory_falls_with_heads_per_chunk() -> None:
    results = [
        simulate_attention_block("upipe", **MID, sp_size=P, heads_per_chunk=c) for c in MID_CHUNKS
    ]
    forward = [r["forward_peak"] for r in results]
    assert forward == [_predicted_block_forward(c) for c in MID_CHUNKS]
    unit = results[0]["unit"]
    assert unit == MID["seq_len"] // P * MID["hidden"] * BYTES
    # Ulysses mode sits above the RoPE floor (4.5 u); every chunked setting is held at it.
    assert (
        forward[0]
        == _predicted_block_forward(None)
        > forward[1]
        == forward[2]
        == forward[3]
        == _rope_floor()
    )
    assert _rope_floor() == 4.5 * unit
    MiB = 2**20
    assert [f / MiB for f in forward] == [322.0, 288.0, 288.0, 288.0]
    peaks = [r["peak"] for r in results]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks  # fwd+bwd falls at every step


# ---------------------------------------------------------------- (c) the fused block
def test_fused_simulation_equals_real_gloo_run() -> None:
    real = run_distributed(_real_worker, 2, "fused", CHUNKS, SMALL)
    assert real[0] == _simulated("fused", CHUNKS, SMALL)


def test_fused_block_is_below_the_registered_path_as_designed() -> None:
    """The fused block never holds the local q, the local attention output or its gradient (three full-width
    tensors the registered path needs), so its fwd+bwd peak is the floor the design names: the block output y and
    dx (2 u), the weight gradients, and a few one-stage buffers that scale with the chunk, not with all heads."""
    H, Hk, D, S, hidden = (
        MID["heads"],
        MID["kv_heads"],
        MID["head_dim"],
        MID["seq_len"],
        MID["hidden"],
    )
    weights_grad = (2 * H + 2 * Hk) * D * hidden * BYTES  # q, o: H*D x hidden; k, v: Hk*D x hidden
    for c in (1, 2):
        fused = simulate_attention_block("fused", **MID, sp_size=P, heads_per_chunk=c)
        registered = simulate_attention_block("upipe", **MID, sp_size=P, heads_per_chunk=c)
        unit = fused["unit"]
        stage = (
            S * (c + _stage_heads(c)[1]) * D * BYTES
        )  # one stage's q + k/v heads over the full sequence
        floor = 2 * unit + weights_grad
        assert floor < fused["peak"] <= floor + 6 * stage, (c, fused["peak"] / unit)
        assert registered["peak"] - fused["peak"] >= 3 * unit - weights_grad, (
            registered["peak"] / unit,
            fused["peak"] / unit,
        )
        assert fused["forward_peak"] < registered["forward_peak"]


@pytest.mark.slow
def test_fused_save_mode_simulation_equals_real_gloo_run_and_keeps_one_attention_output() -> None:
    """Save mode (`UPipeConfig(fused_backward="save")`): the simulation is exact, and it holds at most what it keeps
    more than the recompute mode: every stage's kernel output (together one local attention output, s*H*D) and
    log-sum-exp (S*H/P fp32), plus the summed dk/dv of one k/v chunk; and at one head per stage less than
    DeepSpeed's Ulysses (with all heads in one stage it is above: that is not the setting for memory)."""
    _require_deepspeed()
    real = run_distributed(_real_worker, 2, "fused_save", CHUNKS, SMALL)
    save = _simulated("fused_save", CHUNKS, SMALL)
    assert real[0] == save
    recompute = _simulated("fused", CHUNKS, SMALL)
    deepspeed = _simulated("deepspeed", (None,), SMALL)[0]
    s, H, Hk, D = SMALL["seq_len"] // 2, SMALL["heads"], SMALL["kv_heads"], SMALL["head_dim"]
    kept = s * H * D * 4 + SMALL["seq_len"] * H // 2 * 4  # outputs + log-sum-exps, fp32
    sums = 2 * SMALL["seq_len"] * (Hk // 2) * D * 4  # dk, dv of one k/v chunk
    for (fwd, peak, _), (fwd0, peak0, _) in zip(save, recompute):
        assert peak0 < peak <= peak0 + kept + sums, (peak, peak0, kept)
    assert save[0][1] < 0.85 * deepspeed[1], (save[0][1], deepspeed[1])  # heads_per_chunk=1


def test_fused_overlap_simulation_equals_real_gloo_run_and_holds_one_stage_in_flight() -> None:
    """Overlap (`UPipeConfig(overlap_comm=True)`): the simulation is exact, and what it holds beyond the synchronous
    schedule is bounded by the buffers in flight: the next stage's q, k, v, d a and output and the previous stage's
    output and dq, dk, dv, each as a send and a receive buffer of one stage's heads over the full sequence."""
    real = run_distributed(_real_worker, 2, "fused_save_overlap", CHUNKS, SMALL)
    overlap = _simulated("fused_save_overlap", CHUNKS, SMALL)
    assert real[0] == overlap
    sync = _simulated("fused_save", CHUNKS, SMALL)
    S, D, H, Hk = SMALL["seq_len"], SMALL["head_dim"], SMALL["heads"], SMALL["kv_heads"]
    for c, (fwd, peak, _), (fwd0, peak0, _) in zip(CHUNKS, overlap, sync):
        q = S * (c or H // 2) * D * 4  # one stage's query heads over the full sequence, fp32
        kv = S * max(1, (c or H // 2) // (H // Hk)) * D * 4
        assert peak0 < peak <= peak0 + 2 * (6 * q + 4 * kv), (c, peak - peak0, q)


def test_llama3_8b_at_3m_tokens_save_mode_stays_under_the_memory_bound(monkeypatch) -> None:
    """Issue 17's bound, at its geometry (Llama3-8B attention, 3M tokens, P = 8, bf16, one head per stage): the
    save mode's fwd+bwd peak at most 0.8x DeepSpeed's (measured: 0.75x, 5.29 u; the order in which the backward
    issues its all-to-alls moves it, e.g. the stage output's sent before q's projection: 0.79x), and the recompute
    mode's at its 4.16 u. Tensors against tensors, with the kernel's backward in one call as DeepSpeed's
    (`UPIPE_BACKWARD_BLOCK=0`). Tiled (the default), the tensors gain the float32 dq of one stage, [S, 1, D], and
    the kernel workspace the planner adds beside them falls from the whole sequence's to one tile's."""
    from hf_upipe.ops.tiled_backward import ENV
    from hf_upipe.planning.reserved import UNSEEN_PER_TOKEN

    _require_deepspeed()
    geometry = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, seq_len=3 * 2**20, sp_size=8)
    monkeypatch.setenv(ENV, "0")
    peaks = {
        impl: simulate_attention_block(impl, **geometry, heads_per_chunk=1)
        for impl in ("deepspeed", "fused_save", "fused")
    }
    unit = peaks["fused"]["unit"]
    assert peaks["fused_save"]["peak"] <= 0.76 * peaks["deepspeed"]["peak"], (
        peaks["fused_save"]["peak"] / unit,
        peaks["deepspeed"]["peak"] / unit,
    )
    assert peaks["fused"]["peak"] <= 4.17 * unit, peaks["fused"]["peak"] / unit
    monkeypatch.delenv(ENV)
    S, rate = geometry["seq_len"], UNSEEN_PER_TOKEN[("fused", 1)]
    dq32 = S * geometry["head_dim"] * 4
    for impl in ("fused_save", "fused"):
        tiled = simulate_attention_block(impl, **geometry, heads_per_chunk=1)["peak"]
        assert peaks[impl]["peak"] < tiled <= peaks[impl]["peak"] + dq32, (impl, tiled / unit)
        assert tiled + 2**18 * rate < peaks[impl]["peak"] + S * rate - 3 * dq32, impl
