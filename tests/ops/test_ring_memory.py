"""The ring's memory on a real step (`hf_upipe.ops.ring`), measured by the tracker on 2 gloo ranks.

What the ring holds beyond its inputs is its float32 accumulators and the next k/v block, plus one tile's and one
piece's buffers: each step's kernel backward adds into the accumulators (`tiled_backward(..., into=...)`), the dk/dv
accumulators travel in pieces, and the forward's merge scales and adds the step's output in place. Before, a
backward step also held its own float32 dq and bf16 gradients, the pass held a second copy of both dk/dv
accumulators, and the merge a float32 copy and product of the step's output: the bounds below exclude each.
"""

import os

import pytest
import torch

from tests._dist import run_distributed, settle_collectives

N, D, TILE = 512, 16, 64  # ring shard tokens (2m), head dim, backward tile


def _worker(rank, world):
    import torch.distributed as dist

    from hf_upipe.ops.kernels import get_kernel
    from hf_upipe.ops.ring import RingKernel
    from hf_upipe.planning.tracker import MemoryTracker

    settle_collectives()
    os.environ["UPIPE_BACKWARD_BLOCK"] = str(TILE)
    gen = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, N, 1, D, generator=gen).to(torch.bfloat16) for _ in range(4))
    ring = RingKernel(get_kernel("sdpa", torch.device("cpu"), torch.bfloat16), dist.group.WORLD)
    with MemoryTracker() as fwd:
        out, lse = ring.forward(q, k, v, scale=D**-0.5)
        kept = fwd.current_bytes  # the outputs
    with MemoryTracker() as bwd:
        grads = ring.backward(dout, q, k, v, out, lse, scale=D**-0.5)
        returned = bwd.current_bytes
    return fwd.peak_bytes - kept, bwd.peak_bytes, returned, [g.shape for g in grads]


@pytest.mark.slow
def test_ring_holds_its_accumulators_and_one_k_v_block_beyond_its_inputs():
    A, K = N * D * 4, N * D * 2  # a float32 and a bf16 [1, N, 1, D] tensor
    tile = 8 * TILE * D * 4  # one tile's kernel backward and its float32 sums (generous)
    for fwd_extra, bwd_peak, returned, shapes in run_distributed(_worker, 2, timeout=300):
        assert shapes == [torch.Size([1, N, 1, D])] * 3
        assert returned == 3 * K  # dq, dk, dv in bf16
        # forward: the float32 output and lse are the outputs' source; beyond them the next k/v block (2 K), the
        # step's kernel output (K, or half) and its lse; no float32 copy or product of it (2 A more before)
        assert 2 * K <= fwd_extra <= 2 * K + K + tile, fwd_extra
        # backward: accumulators 3 A, the next k/v block 2 K, one piece of a dk/dv accumulator (A / 8), one tile;
        # before: another 2 A in the pass, or a step's own A + 3 K of gradients
        assert 3 * A + 2 * K <= bwd_peak <= 3 * A + 2 * K + A // 8 + tile, bwd_peak
