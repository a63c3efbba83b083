"""All-to-all layouts and their autograd, on spawned gloo ranks.

Layout: every rank builds the same full tensor [B, S, H, D]; after seq_to_head rank r must hold all S tokens of
heads [r*H/P, (r+1)*H/P), and head_to_seq must invert it. Autograd: the global adjoint identity
sum_r <A x_r, w_r> == sum_r <x_r, A^T w_r> in float64 (gradcheck is unusable on collectives: every rank perturbs
its input at once).
"""

import pytest
import torch
import torch.distributed as dist

from hf_upipe.ops.all_to_all import (
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
    head_to_seq,
    seq_to_head,
)
from tests._dist import run_distributed


def _adjoint_gap(fn, x0, group, gen):
    """Relative gap between sum_r <A x, w> and sum_r <x, A^T w> for A = fn, and A x."""
    x = x0.clone().requires_grad_()
    y = fn(x, group)
    w = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (y * w).sum().backward()
    t = torch.stack([(y.detach() * w).sum(), (x.detach() * x.grad).sum()])
    dist.all_reduce(t)
    return (t[0] - t[1]).abs().item() / t[0].abs().item(), y.detach()


def _worker(rank, world):
    group = dist.group.WORLD
    errors = {}
    for B, S, H, D in [(1, 8 * world, 2 * world, 3), (2, 4 * world, world, 5)]:
        gen = torch.Generator().manual_seed(S * H + B)
        full = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
        s, h = S // world, H // world
        local = full[:, rank * s : (rank + 1) * s]  # [B, s, H, D], a strided view
        heads = seq_to_head(local.view(B, s, world, h, D), group)  # [B, S, h, D]
        errors[f"seq_to_head {B, S, H, D}"] = (
            (heads - full[:, :, rank * h : (rank + 1) * h]).abs().max().item()
        )
        back = head_to_seq(heads, group).reshape(B, s, H, D)
        errors[f"head_to_seq {B, S, H, D}"] = (back - local).abs().max().item()

        # global adjoint test of the autograd Functions (forward A, backward must be A^T)
        errors[f"adjoint seq_to_head {B, S, H, D}"], _ = _adjoint_gap(
            all_to_all_seq_to_head, local, group, gen
        )
        errors[f"adjoint head_to_seq {B, S, H, D}"], u = _adjoint_gap(
            all_to_all_head_to_seq, heads, group, gen
        )
        errors[f"roundtrip {B, S, H, D}"] = (u - local).abs().max().item()
    # a split that does not divide raises on every rank, before any collective
    try:
        all_to_all_seq_to_head(torch.zeros(1, 4, 2 * world + 1, 2), group)
        errors["uneven heads raised"] = 1.0
    except ValueError as err:
        errors["uneven heads raised"] = (
            0.0 if f"cannot be split over {world} ranks" in str(err) else 1.0
        )
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_and_adjoint(world):
    for rank, errors in enumerate(run_distributed(_worker, world)):
        for name, err in errors.items():
            assert err < 1e-12, f"rank {rank}: {name} error {err}"
