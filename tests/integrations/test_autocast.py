"""Under autocast to another dtype than the weights' (bf16 autocast over an fp32 model, as `TrainingArguments(
bf16=True)` runs one), the SP attention computes as transformers does on one device: the "upipe" attention casts
q, k and v to the autocast dtype, as `scaled_dot_product_attention` does, and a fused-block model takes the
registered path for the call. Against the one-device model under the same autocast: logits and every gradient
within bf16 rounding, on a rank of its own (`local_sequence_parallel`), plain and fused, for two families.
"""

import pytest
import torch

import hf_upipe
from hf_upipe.attention.fused import count_fused
from hf_upipe.attention.state import local_sequence_parallel
from hf_upipe.distributed import without_sequence_parallel
from tests.integrations._models import build_pair, tiny_config


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    (logits.float() ** 2).mean().backward()
    return logits.float().detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fused", [False, True], ids=["registered", "fused"])
def test_bf16_autocast_over_fp32_weights_is_one_device_arithmetic(arch, fused):
    ref, model = build_pair(tiny_config(arch), "upipe", seed=4)
    if fused:
        hf_upipe.prepare_model(model)
        assert count_fused(model) == 2
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(5))
    with without_sequence_parallel():
        want, want_grads = _run(ref, ids)
        with local_sequence_parallel():
            got, got_grads = _run(model, ids)
    assert got.dtype == want.dtype and _rel(got, want) < 2e-2, _rel(got, want)
    for name, grad in want_grads.items():
        assert got_grads[name].dtype == torch.float32 and _rel(got_grads[name], grad) < 5e-2, name
