"""QLoRA under sequence parallelism (docs/kernels.md): a 4-bit base with PEFT LoRA. The fused block leaves every
attention module with quantized projections on the registered "upipe" path (one log line names them), the tiled
MLP runs the quantized layers chunk by chunk, and SP 2 is exact against the same quantized model in one process:
loss, logits and every LoRA gradient. Simulated in CI (`FakeLinear4bit`, an nn.Linear subclass as bitsandbytes'
Linear4bit is); with bitsandbytes installed, the same on a model loaded with `BitsAndBytesConfig(load_in_4bit=True)`
(its CPU backend)."""

import importlib.util
import logging

import pytest
import torch
from peft import LoraConfig

import hf_upipe
from hf_upipe.attention.fused import count_fused, unfused_reason
from hf_upipe.models.peft import get_peft_model
from tests._dist import run_distributed
from tests.integrations import _kernels as K
from tests.integrations._models import build_pair, sharded_errors, tiny_config

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, seed):
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero B, so that both A and B get gradients
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def test_quantized_projections_keep_the_registered_path(caplog):
    model = _lora(K.quantize(build_pair(tiny_config("llama"), "upipe", 0)[1]), 1)
    attention = model.get_base_model().model.layers[0].self_attn
    assert unfused_reason(attention) == "FakeLinear4bit projections (quantized or custom layers)"
    with caplog.at_level(logging.INFO, logger="hf_upipe"):
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=True))
    assert count_fused(model) == 0
    assert (
        "['LlamaAttention'] keep the registered 'upipe' path, not the fused block: FakeLinear4bit "
        "projections" in caplog.text
    )
    hf_upipe.unprepare_model(model)


def _bnb_pair(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    return tuple(
        AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quant, dtype=torch.float32, attn_implementation=impl
        )
        for impl in ("sdpa", "upipe")
    )


def _qlora_case(rank, world, how, path, tiled):
    if how == "bnb":
        ref, model = _bnb_pair(path)
    else:
        ref, model = build_pair(tiny_config("llama", heads=4, kv_heads=2), "upipe", 2)
        ref = K.quantize(ref)
        model = K.quantize(model)
    ref, model = _lora(ref, 5).train(), _lora(model, 5).train()  # as a Trainer runs them
    kinds = {type(m.get_base_layer()).__name__ for m in model.modules() if hasattr(m, "lora_A")}
    hf_upipe.init_sequence_parallel()
    try:
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=tiled, mlp_chunk_tokens=3))
        fused = count_fused(model)
        ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(6))
        errors, n = sharded_errors(ref, model, ids, rank, world)
    finally:
        hf_upipe.reset_sequence_parallel()
    return errors, n, fused, kinds


def _qlora_worker(rank, world, cases):
    return [_qlora_case(rank, world, *c) for c in cases]


def _check(results, kind):
    for errors, n, fused, kinds in results:
        assert kinds == {kind} and fused == 0 and n == 2 * 2 * len(TARGETS), (kinds, fused, n)
        bad = {k: v for k, v in errors.items() if not v <= 2e-5}
        assert not bad, bad


@pytest.mark.slow  # a 2-rank run: 7 to 25 s on 2 busy cores
def test_simulated_qlora_is_exact_under_sp():
    results = run_distributed(_qlora_worker, 2, [("fake", None, True), ("fake", None, False)])
    _check([r for rank in results for r in rank], "FakeLinear4bit")


@pytest.mark.skipif(
    not HAS_BNB, reason="bitsandbytes is not installed (the simulated test above runs)"
)
def test_bitsandbytes_4bit_qlora_is_exact_under_sp(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # bitsandbytes' CPU backend packs 4-bit weights in blocks: widths of 64 (the probe's 32-wide o_proj fails)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    results = run_distributed(
        _qlora_worker, 2, [("bnb", str(tmp_path), True), ("bnb", str(tmp_path), False)], timeout=300
    )
    _check([r for rank in results for r in rank], "Linear4bit")
