"""The whole FSDP2 training step: the fake simulation equals real gloo runs, category by category.

(a) `simulate_train_step` (rank 0 of a fake 4-rank world) against rank 0 of a real 4-rank gloo run of
    `measure_train_step` on real tensors, a 5-layer model: FSDP2 over the 4 ranks, AdamW, checkpointing, SP 2
    (two SP groups) and SP 4; fused, registered and Ulysses-mode attention; tiled MLP and loss with many chunks (so
    the simulation's abbreviated chunk loops are checked against full ones); offload to host; fp32 and bf16
    compute; full fine-tuning and LoRA (PEFT adapters on a frozen base, AdamW on the adapters); ring attention
    (UPipe over 2 ranks x a ring of 2). The peaks and
    every category agree to within 64 bytes per layer (a few bytes of collective
    bookkeeping differ between gloo and the fake backend in one case; the others are byte-exact).
(b) The per-layer slope: the peak of an L-layer step is the 4-layer peak plus (L - 4) times the 3-to-4-layer
    difference, which is how the planner extrapolates; checked at 6 layers without offload (with offload: the
    planner's validation against a real 5-layer run).
(c) The categories add up to the peak, and without offload "checkpoints" holds one layer input per layer.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_upipe.planning.train_step import (
    CATEGORIES,
    StepCase,
    StepSettings,
    measure_train_step,
    simulate_train_step,
)
from tests._dist import run_distributed, settle_collectives

TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=256,
)
S, WORLD, LAYERS = 1024, 4, 5
LORA = (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
CASES = [  # (settings, sp_size, dtype, lora)
    (
        StepSettings(impl="fused", offload="cpu", mlp_chunk_tokens=32, loss_chunk_tokens=32),
        2,
        torch.float32,
        None,
    ),
    (
        StepSettings(impl="ulysses", heads_per_chunk=None, tiled_mlp=False, offload="none"),
        2,
        torch.float32,
        None,
    ),
    (StepSettings(impl="upipe", offload="none", loss_chunk_tokens=48), 4, torch.float32, None),
    (
        StepSettings(impl="fused", offload="cpu", mlp_chunk_tokens=40, loss_chunk_tokens=24),
        4,
        torch.bfloat16,
        None,
    ),
    (StepSettings(impl="fused", offload="none", mlp_chunk_tokens=32), 2, torch.float32, LORA),
    # UPipe over 2 ranks x a ring of 2: the ring's k/v blocks and dk/dv accumulators in flight
    (
        StepSettings(impl="fused", offload="none", loss_chunk_tokens=48, ring_size=2),
        4,
        torch.float32,
        None,
    ),
]
TOLERANCE = (
    64 * LAYERS
)  # bytes: in the fused SP-4 bf16 case the fake backend's collectives keep 32 bytes per layer
# more than gloo's (a few int64 of bookkeeping); every other case is byte-exact


def _small_blocks():
    """Blockwise [V, Dm] passes of 4 KiB, so that the bf16 case runs many blocks (the real run all of them)."""
    import hf_upipe.ops.tiled_loss as tiled_loss

    tiled_loss._BLOCK_BYTES = 4096


def _real(rank, world, cases):
    import hf_upipe.training.offload as offload

    settle_collectives()
    _small_blocks()
    # CPU tensors are already in host memory, so the "cpu" target would keep them: force its host-copy path, the
    # one a GPU takes. A first step fills the host buffer pool, which later steps reuse, as in training.
    offload.OffloadStore.stays = lambda self, t: t.numel() * t.element_size() < self.min_bytes
    out = {}
    for i in cases:
        settings, sp, dtype, lora = CASES[i]
        case = StepCase(TINY, S, sp, LAYERS, dtype=dtype, lora=lora)
        if settings.offload == "cpu":  # fill the host buffer pool first
            measure_train_step(case, settings)
        r = measure_train_step(case, settings)
        out[i] = (r["peak"], r["by_category"], r["phase_peaks"])
    return out


@functools.lru_cache(maxsize=2)
def real_runs(cases: tuple = tuple(range(len(CASES)))) -> dict:
    """{case index: (peak, by_category, phase_peaks)} of rank 0 of real 4-rank gloo steps of a `LAYERS`-layer model,
    for the given `CASES` indices (run once per process; the planner's validation in test_planner.py runs the one
    case it plans)."""
    return run_distributed(_real, WORLD, cases)[0]


@pytest.mark.slow
def test_simulated_step_equals_real_gloo_step(monkeypatch):
    import hf_upipe.ops.tiled_loss as tiled_loss

    real = real_runs()
    monkeypatch.setattr(tiled_loss, "_BLOCK_BYTES", 4096)  # as _small_blocks() in the workers
    for i, (settings, sp, dtype, lora) in enumerate(CASES):
        peak, by_category, phases = real[i]
        sim = simulate_train_step(
            StepCase(TINY, S, sp, LAYERS, dtype=dtype, lora=lora), settings, world_size=WORLD
        )
        case = f"{settings} sp={sp} {dtype} lora={lora}"
        assert abs(sim["peak"] - peak) <= TOLERANCE, (case, sim["peak"], peak)
        for name in ("forward", "backward", "optimizer"):
            assert abs(sim["phase_peaks"][name] - phases[name]) <= TOLERANCE, (case, name)
        assert set(sim["by_category"]) == set(by_category), case
        for category, nbytes in by_category.items():
            assert abs(sim["by_category"][category] - nbytes) <= TOLERANCE, (case, category)


@pytest.mark.slow
def test_peak_grows_linearly_with_depth():
    """Without offload (every layer's checkpoint on the GPU); with offload, the planner's validation
    (test_planner.py, case 0) checks the same extrapolation against a real 5-layer run."""
    cfg = dict(TINY, hidden_size=128, intermediate_size=256, vocab_size=512)
    settings = StepSettings(impl="fused", offload="none")
    peaks = {
        n: simulate_train_step(StepCase(cfg, 8192, 4, layers=n), settings, world_size=4)
        for n in (3, 4, 6)
    }
    slope = peaks[4]["peak"] - peaks[3]["peak"]
    assert peaks[6]["peak"] == peaks[4]["peak"] + 2 * slope
    for category in CATEGORIES:
        c = {n: peaks[n]["by_category"].get(category, 0) for n in peaks}
        assert c[6] == c[4] + 2 * (c[4] - c[3]), category


def test_categories_add_up_and_count_checkpoints():
    cfg = dict(TINY, hidden_size=128, intermediate_size=256, vocab_size=512)
    s = 8192 // 2
    for layers in (3, 5):
        r = simulate_train_step(
            StepCase(cfg, 8192, 2, layers=layers),
            StepSettings(impl="ulysses", heads_per_chunk=None, offload="none"),
            world_size=2,
        )
        assert sum(r["by_category"].values()) == r["peak"]
        assert set(r["by_category"]) <= set(CATEGORIES)
        assert (
            r["by_category"]["checkpoints"] == layers * s * 128 * 2
        )  # bf16 layer inputs, all still on device
        params = r["static"]["parameters"]
        assert (
            params > 0 and 0 <= r["static"]["optimizer"] - 2 * params < 1024
        )  # Adam's m and v, and step counts


@pytest.mark.parametrize("impl,offload", [("fused", "cpu"), ("ulysses", "none")])
def test_labeling_does_not_change_the_memory_it_measures(impl, offload):
    """Categories are kept in the autograd nodes' own metadata and nothing of the step is referenced from outside, so
    the peak with labels equals the peak without."""
    from hf_upipe.planning.activation_step import simulate_model_step

    cfg = dict(
        TINY, hidden_size=128, intermediate_size=256, vocab_size=64
    )  # the peak is in the backward
    peaks = [
        simulate_model_step(
            StepCase(cfg, 8192, 2, layers=3),
            StepSettings(impl, None if impl == "ulysses" else 1, offload=offload),
            categories=labels,
        )["peak"]
        for labels in (False, True)
    ]
    assert peaks[0] == peaks[1]
