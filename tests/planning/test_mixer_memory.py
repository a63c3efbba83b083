"""The simulated memory of one hybrid mixer layer (`hf_upipe.planning.mixer_memory`) equals a real 2-rank gloo run,
byte for byte, per rank: gated DeltaNet (parallel and, on rank 0, sequential), Kimi delta attention, Mamba2 (rank
0) and LFM2's short convolution, against the class's own forward on the shard alone. And what hf_upipe adds on a
shard does not gather the sequence: in sequence it is a constant number of bytes at every length, in parallel the
kernel's d_k extra value columns, linear in the shard."""

import pytest
import torch

from hf_upipe.planning.mixer_memory import mixer_module, mixer_peak
from tests._dist import run_distributed, settle_collectives
from tests.integrations._models import hybrid_config

S = 256
# Each real peak is the least of REPEATS runs. A thread of the backend (gloo) can only make a tensor die later than
# the program says, never earlier, so a late free can only raise a real run's peak: the least of a few runs is the
# program's own lifetimes, which the simulation must equal to the byte. (settle_collectives removes the known
# late frees; this keeps a rare one on a loaded CI machine from failing the check.)
REPEATS = 2
# model type -> the modes measured on every rank, and on rank 0 only
TYPES = {
    "qwen3_next": (("parallel", "alone"), ("sequential",)),
    "bailing_hybrid": (("parallel", "alone"), ()),
    "bamba": (("alone",), ("sequential",)),
    "lfm2": (("parallel", "alone"), ()),
}


def _measure(mixer, config, world, measured, mode):
    """The tracked peak of one forward + backward on a fresh shard, or None where this rank only takes part."""
    from hf_upipe.planning.tracker import MemoryTracker

    x = torch.randn(1, S // world, config.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)
    mixer.zero_grad(set_to_none=True)  # every run allocates its gradients, as a simulation's does
    if not measured:  # takes part in rank 0's run, unmeasured
        mixer(x).backward(dy)
        return None
    with MemoryTracker() as tracker:
        y = type(mixer).forward(mixer, x) if mode == "alone" else mixer(x)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy)
        del y
    return tracker.peak_bytes


def _real_worker(rank, world):
    """The tracked peak of the same forward + backward on real tensors, per (type, mode)."""
    import hf_upipe
    from hf_upipe.adapters.mixers import install_mixers

    settle_collectives()
    hf_upipe.init_sequence_parallel(world)
    out = {}
    try:
        for model_type, (every, first) in TYPES.items():
            torch.manual_seed(0)
            config = hybrid_config(model_type)
            mixer = mixer_module(config)
            for mode in every + first:
                install_mixers(
                    mixer, state_passing="sequential" if mode == "sequential" else "parallel"
                )
                peaks = [
                    _measure(mixer, config, world, measured=mode in every or rank == 0, mode=mode)
                    for _ in range(REPEATS)
                ]
                if mode in every or rank == 0:
                    out[(model_type, mode)] = min(peaks)
    finally:
        hf_upipe.reset_sequence_parallel()
    return out


def test_simulation_equals_real_runs():
    real = run_distributed(_real_worker, 2, timeout=300)
    for rank in (0, 1):
        for (model_type, mode), peak in real[rank].items():
            sim = mixer_peak(hybrid_config(model_type), S, 2, rank, mode, dtype=torch.float32)
            assert sim == peak, (rank, model_type, mode, sim, peak)
    assert len(real[0]) == 9 and len(real[1]) == 7, (sorted(real[0]), sorted(real[1]))


@pytest.mark.slow
def test_the_added_memory_does_not_gather_the_sequence():
    """Rank 3 of 4 in parallel, rank 0 in sequence: hf_upipe's bytes over the shard alone's, at three lengths."""
    config = hybrid_config("qwen3_next")

    def extra(length, rank, mode):
        return mixer_peak(config, length, 4, rank, mode, dtype=torch.float32) - mixer_peak(
            config, length, 4, rank, "alone", dtype=torch.float32
        )

    parallel = [extra(length, 3, "parallel") for length in (2048, 4096, 8192)]
    # the kernel's widened value: linear in the shard (a gather would add P-1 shards of every activation)
    assert parallel[2] - parallel[1] == 2 * (parallel[1] - parallel[0]) > 0, parallel
    assert parallel[2] < 0.06 * mixer_peak(config, 8192, 4, 3, "alone", dtype=torch.float32), (
        parallel
    )
    sequential = [extra(length, 0, "sequential") for length in (512, 2048, 8192)]
    assert len(set(sequential)) == 1 and sequential[0] < 4096, (
        sequential
    )  # the same few bytes at every length
