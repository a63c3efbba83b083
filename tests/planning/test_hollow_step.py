"""A training step with a hollow attention kernel (hf_upipe.planning.hollow_step) allocates what the real one does.

On CPU the hollow twin of the "sdpa" kernel is exact (tests/ops/test_kernels_hollow.py), so the whole step's
allocation trace (`record_step_trace`: build, FSDP2, AdamW, the step) must be identical, event for event, for
hf_upipe's impls; DeepSpeed's Ulysses, whose torch SDPA is replaced, must reach the same peak. Outside
`hollow_attention()` the same steps refuse to run, which also shows that the hollow kernel is the one used.
"""

import pytest
import torch

from hf_upipe.ops.kernels_hollow import hollow_attention
from hf_upipe.planning.hollow_step import hollow_torch_sdpa, hollow_twin, step_attention
from hf_upipe.planning.reserved import record_step_trace
from hf_upipe.planning.train_step import StepCase, StepSettings

TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    vocab_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=12,
)
STEP = dict(seq_len=256, sp_size=4, layers=2)
WORLD = 4


def _normalised(events):
    """Allocations (bytes, stream) and frees (by allocation number), storage keys left out."""
    index, out, n = {}, [], 0
    for ev in events:
        if ev[0] == "a":
            index[ev[1]], n = n, n + 1
            out.append(("a", ev[2], ev[3]))
        elif ev[0] == "f":
            if ev[1] in index:  # (allocations of 0 bytes are not logged)
                out.append(("f", index.pop(ev[1])))
        else:
            out.append(ev)
    return out


@pytest.mark.parametrize("impl,hpc", [("fused", 1), ("upipe", 2), ("ulysses", None)])
def test_hollow_step_trace_equals_real(impl, hpc):
    settings = StepSettings(impl, hpc)
    real, real_result = record_step_trace(StepCase(TINY, **STEP), settings, world_size=WORLD)
    with hollow_attention():
        hollow, hollow_result = record_step_trace(
            StepCase(TINY, **STEP, kernel="hollow-sdpa"), settings, world_size=WORLD
        )
    assert _normalised(hollow) == _normalised(real)
    assert hollow_result["peak"] == real_result["peak"] > 0
    assert hollow_result["by_category"] == real_result["by_category"]
    with pytest.raises(ValueError, match="memory measurement only"):
        record_step_trace(StepCase(TINY, **STEP, kernel="hollow-sdpa"), settings, world_size=WORLD)


def test_hollow_deepspeed_step_reaches_the_same_peak():
    pytest.importorskip("deepspeed")
    settings = StepSettings("deepspeed", None, offload="none")
    original = torch.nn.functional.scaled_dot_product_attention
    _, real = record_step_trace(StepCase(TINY, **STEP), settings, world_size=WORLD)
    with hollow_attention():
        _, hollow = record_step_trace(
            StepCase(TINY, **STEP, kernel="hollow-sdpa"), settings, world_size=WORLD
        )
    assert hollow["peak"] == real["peak"] > 0
    assert torch.nn.functional.scaled_dot_product_attention is original  # restored
    with pytest.raises(RuntimeError, match="memory measurement only"):
        record_step_trace(StepCase(TINY, **STEP, kernel="hollow-sdpa"), settings, world_size=WORLD)


def test_step_attention_choices():
    assert hollow_twin("auto", "cpu", torch.float32) == "hollow-sdpa"
    assert hollow_twin("hollow-cudnn", "cuda", torch.bfloat16) == "hollow-cudnn"
    with pytest.raises(ValueError, match="DeepSpeed's Ulysses runs torch's own SDPA"):
        step_attention("deepspeed", "sdpa")
    q = torch.randn(1, 4, 8, 8, requires_grad=True)  # [B, h, S, D]
    k, v = (torch.randn(1, 1, 8, 8, requires_grad=True) for _ in range(2))  # one k/v head
    with hollow_attention(), hollow_torch_sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        assert out.shape == q.shape
        assert out.stride() == (256, 8, 32, 1)  # a view of a contiguous [B, S, h, D] tensor
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == v.grad.shape == k.shape  # not expanded
        with pytest.raises(NotImplementedError, match="causal attention without a mask"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        with pytest.raises(ValueError, match="enable_gqa"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with hollow_torch_sdpa(), pytest.raises(RuntimeError, match="memory measurement only"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
