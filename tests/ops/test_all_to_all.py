"""All-to-all layouts and their autograd, on spawned gloo ranks.

Layout: every rank builds the same full tensor [B, S, H, D]; after seq_to_head rank r must hold all S tokens of
heads [r*H/P, (r+1)*H/P), and head_to_seq must invert it. Autograd: the global adjoint identity
sum_r <A x_r, w_r> == sum_r <x_r, A^T w_r> in float64 (gradcheck is unusable on collectives: every rank perturbs
its input at once).
"""

import pytest
import torch
import torch.distributed as dist

from hf_upipe.ops.all_to_all import all_to_all_head_to_seq, all_to_all_seq_to_head, head_to_seq, seq_to_head
from tests._dist import run_distributed


def _worker(rank, world):
    group = dist.group.WORLD
    errors = {}
    for B, S, H, D in [(1, 8 * world, 2 * world, 3), (2, 4 * world, world, 5)]:
        gen = torch.Generator().manual_seed(S * H + B)
        full = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
        s, h = S // world, H // world
        local = full[:, rank * s:(rank + 1) * s]  # [B, s, H, D], a strided view
        heads = seq_to_head(local.view(B, s, world, h, D), group)  # [B, S, h, D]
        errors[f"seq_to_head {B,S,H,D}"] = (heads - full[:, :, rank * h:(rank + 1) * h]).abs().max().item()
        back = head_to_seq(heads, group).reshape(B, s, H, D)
        errors[f"head_to_seq {B,S,H,D}"] = (back - local).abs().max().item()

        # global adjoint test of the autograd Functions (forward A, backward must be A^T)
        x = local.clone().requires_grad_()
        y = all_to_all_seq_to_head(x, group)
        w = torch.randn(y.shape, generator=gen, dtype=torch.float64)
        (y * w).sum().backward()
        t = torch.stack([(y.detach() * w).sum(), (x.detach() * x.grad).sum()])
        dist.all_reduce(t)
        errors[f"adjoint seq_to_head {B,S,H,D}"] = (t[0] - t[1]).abs().item() / t[0].abs().item()

        z = heads.clone().requires_grad_()
        u = all_to_all_head_to_seq(z, group)
        w2 = torch.randn(u.shape, generator=gen, dtype=torch.float64)
        (u * w2).sum().backward()
        t = torch.stack([(u.detach() * w2).sum(), (z.detach() * z.grad).sum()])
        dist.all_reduce(t)
        errors[f"adjoint head_to_seq {B,S,H,D}"] = (t[0] - t[1]).abs().item() / t[0].abs().item()
        errors[f"roundtrip {B,S,H,D}"] = (u.detach() - local).abs().max().item()
    # a split that does not divide raises on every rank, before any collective
    try:
        all_to_all_seq_to_head(torch.zeros(1, 4, 2 * world + 1, 2), group)
        errors["uneven heads raised"] = 1.0
    except ValueError as err:
        errors["uneven heads raised"] = 0.0 if f"cannot be split over {world} ranks" in str(err) else 1.0
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_and_adjoint(world):
    for rank, errors in enumerate(run_distributed(_worker, world)):
        for name, err in errors.items():
            assert err < 1e-12, f"rank {rank}: {name} error {err}"

