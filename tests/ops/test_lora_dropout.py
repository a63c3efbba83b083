"""The fused block's LoRA dropout masks (`hf_upipe.ops.lora_dropout`): drawn per global token position, so shards
draw one process's mask, two shards never repeat each other's, and the fraction dropped is p.

The hash is deterministic, so the statistical bounds below are fixed outcomes, not chances: 6 sigma of a binomial
fraction over about a million draws."""

import math

import pytest
import torch
import torch.distributed as dist

from hf_upipe.ops.fused_attention import (
    AttentionWeights,
    LoraAdapter,
    Projection,
    fused_upipe_attention,
)
from hf_upipe.ops.lora_dropout import LoraDropout, keep_mask
from hf_upipe.ops.ring import ring_positions
from tests._dist import run_distributed
from tests.ops.test_fused_attention import _make, _tables


def _six_sigma(p: float, n: int) -> float:
    return 6 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9])
def test_fraction_dropped_is_p_overall_per_row_block_and_per_column_block(p):
    B, S, F = 2, 512, 1024  # 2^20 draws
    keep = keep_mask(12345, 3, p, B, torch.arange(S), torch.arange(F))
    assert keep.shape == (B, S, F) and keep.dtype == torch.bool
    dropped = 1.0 - keep.double().mean().item()
    assert abs(dropped - p) < _six_sigma(p, keep.numel()), dropped
    # no structure along positions or features: every block of 64 positions (2^17 draws) and of 64 features
    by_pos = 1.0 - keep.double().view(B, S // 64, 64, F).mean((0, 2, 3))
    by_feat = 1.0 - keep.double().view(B, S, F // 64, 64).mean((0, 1, 3))
    n_block = keep.numel() // 8 // 2  # draws per block: B*64*F or B*S*64 (the smaller of the two)
    bound = _six_sigma(p, min(n_block, B * S * 64))
    assert (by_pos - p).abs().max() < bound and (by_feat - p).abs().max() < bound


def test_shards_draw_one_process_mask_and_never_repeat_each_other():
    """Contiguous and ring layouts: the shards' masks are the slices of the whole sequence's; two shards holding
    the same local positions agree only as often as independent masks would (p^2 + (1-p)^2), not always."""
    p, B, S, F, seed = 0.25, 2, 1024, 256, 99
    cols = torch.arange(F)
    whole = keep_mask(seed, 0, p, B, torch.arange(S), cols)  # [B, S, F]
    for P, R in ((2, 1), (4, 1), (4, 2)):
        s = S // P
        shards = [keep_mask(seed, 0, p, B, ring_positions(r, s, P, R), cols) for r in range(P)]
        for r, mask in enumerate(shards):
            assert torch.equal(mask, whole[:, ring_positions(r, s, P, R)])
        agree = (shards[0] == shards[1]).double().mean().item()
        expected = p * p + (1 - p) * (1 - p)
        assert abs(agree - expected) < _six_sigma(expected, shards[0].numel()), (P, R, agree)
    # another stream, seed or batch row: another mask
    for other in (
        keep_mask(seed, 1, p, B, torch.arange(S), cols),
        keep_mask(seed + 1, 0, p, B, torch.arange(S), cols),
    ):
        agree = (other == whole).double().mean().item()
        assert abs(agree - (p * p + (1 - p) ** 2)) < _six_sigma(0.625, whole.numel())
    assert (whole[0] == whole[1]).double().mean().item() < 0.7


def test_output_columns_follow_the_model_not_the_stage():
    """o_proj's adapter input: a stage's columns draw the whole output's mask at those columns, so the head
    chunking and the number of ranks change nothing."""
    positions = torch.arange(40, 56)  # a shard of 16 tokens
    drop = LoraDropout(7, positions)
    t = torch.ones(3 * 16, 64)  # [B*s, H*D]: B = 3
    whole = drop.output(t, 0.4, 1, torch.arange(64))
    cols = torch.tensor([8, 9, 10, 11, 40, 41, 42, 43])  # two heads of D = 4 from two ranks
    assert torch.equal(drop.output(t[:, cols], 0.4, 1, cols), whole[:, cols])
    assert torch.equal(whole.unique(), torch.tensor([0.0, 1 / 0.6]))
    assert not torch.equal(whole, drop.output(t, 0.4, 0, torch.arange(64)))  # adapters apart
    x = torch.ones(3, 16, 64)
    assert torch.equal(drop.inputs(x, 0.4, 2).view(48, 64), drop.inputs(x.view(48, 64), 0.4, 2))
    assert drop.inputs(x, 0.0, 2) is x


def _weights(gen, dropout):
    build = _make(gen, 24, 8, 2, 8, True, True, True, False, torch.float64)
    w, leaves = build(torch.float64)
    w = AttentionWeights(
        **{
            n: Projection(
                p.weight,
                p.bias,
                tuple(LoraAdapter(a.A, a.B, a.scaling, dropout) for a in p.adapters),
            )
            for n, p in (("q", w.q), ("k", w.k), ("v", w.v), ("o", w.o))
        },
        q_norm=w.q_norm,
        k_norm=w.k_norm,
    )
    return w, [t for t in leaves if t.requires_grad]


def _block(x, cos, sin, w, group, **opts):
    torch.manual_seed(
        11
    )  # the block draws its masks' seed from torch's generator: every rank alike
    return fused_upipe_attention(
        x, cos, sin, w, num_heads=8, num_kv_heads=2, head_dim=8, group=group, **opts
    )


def _sharded_worker(rank, world):
    """The block on this rank's shard, with LoRA dropout, in every backward mode; float64, so that one process's
    result (the same masks) is matched to rounding."""
    gen = torch.Generator().manual_seed(3)
    w, leaves = _weights(gen, 0.3)
    S = 16
    x = torch.randn(2, S, 24, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, S, 24, generator=gen, dtype=torch.float64)
    cos, sin = _tables(S, 8, gen)
    one = _block(x.clone().requires_grad_(), cos, sin, w, None)
    xw = x.clone().requires_grad_()
    ref = [one, *torch.autograd.grad(_block(xw, cos, sin, w, None), [xw, *leaves], dy)]
    s = S // world
    mine = slice(rank * s, (rank + 1) * s)
    errors = {}
    for opts in (
        {"heads_per_chunk": 1},
        {"heads_per_chunk": None},
        {"heads_per_chunk": 1, "save_attention": True, "overlap": True},
    ):
        xl = x[:, mine].clone().requires_grad_()
        y = _block(xl, cos[:, mine], sin[:, mine], w, dist.group.WORLD, **opts)
        grads = list(torch.autograd.grad(y, [xl, *leaves], dy[:, mine]))
        for g in grads[1:]:
            dist.all_reduce(g)
        got = [y, *grads]
        want = [ref[0][:, mine], ref[1][:, mine], *ref[2:]]
        errors[str(opts)] = max(
            ((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)
        )
    # and dropout is on: without it the output is another one
    w0, _ = _weights(torch.Generator().manual_seed(3), 0.0)
    plain = _block(x[:, mine], cos[:, mine], sin[:, mine], w0, dist.group.WORLD)
    errors["without dropout"] = ((plain - ref[0][:, mine]).norm() / ref[0].norm()).item()
    return errors


def test_sharded_block_with_lora_dropout_equals_one_process():
    for errors in run_distributed(_sharded_worker, 2):
        assert errors.pop("without dropout") > 1e-2
        assert max(errors.values()) < 1e-12, errors
