"""`hf_upipe.ops.reduce.sum_over_group` on 2 gloo ranks: the sum in forward, P x the gradient in backward."""

import torch

from tests._dist import run_distributed


def _sum_over_group(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from hf_upipe.ops.reduce import sum_over_group

    x = torch.tensor([1.0, -2.0, 0.5]) * (rank + 1) + rank  # a different share on each rank
    x.requires_grad_(True)
    total = sum_over_group(x, dist.group.WORLD)
    weight = torch.tensor([0.3, -1.1, 2.0])  # the same loss on every rank
    (weight * total.square()).sum().backward()
    with torch.no_grad():
        plain = sum_over_group(x, dist.group.WORLD)
    # plain lists: tensors would cross the process boundary as shared memory of an exited process
    return {
        "total": total.tolist(),
        "grad": x.grad.tolist(),
        "plain": plain.tolist(),
        "weight": weight.tolist(),
    }


def test_sum_over_group_sums_values_and_gradients():
    outs = run_distributed(_sum_over_group, 2)
    shares = [torch.tensor([1.0, -2.0, 0.5]) * (r + 1) + r for r in range(2)]
    want = shares[0] + shares[1]
    for out in outs:
        out = {k: torch.tensor(v) for k, v in out.items()}
        assert torch.allclose(out["total"], want) and torch.allclose(out["plain"], want)
        # d/dx_r of the same loss L(total) on both ranks, summed: P x dL/dtotal = 2 x 2 w total
        assert torch.allclose(out["grad"], 2 * 2 * out["weight"] * want)


def test_sum_over_group_without_a_group_is_the_identity():
    from hf_upipe.ops.reduce import sum_over_group

    x = torch.randn(4, requires_grad=True)
    assert sum_over_group(x, None) is x
