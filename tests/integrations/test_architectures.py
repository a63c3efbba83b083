"""The architecture registry (`hf_upipe.models.architectures`) and `prepare_model` / `unprepare_model`.

- Verified sources: on a verified release, the installed source of every replaced forward (and of the RoPE
  helpers the fused block re-implements) has a recorded fingerprint; on any other release, the adapters pass their
  behaviour check (`tests/test_verification.py` tests the check itself).
- Semantics: every replaced forward against the installed original on random inputs, in one process (a one-rank
  group, the fused path forced on): outputs and every gradient, fp32, plain and PEFT LoRA, GQA with several head
  chunks per rank; the tiled MLP/RMSNorm against the untiled model.
- Round trip: a model through `prepare_model` (fused block and tiled MLP) and `unprepare_model` has the original's
  outputs bit for bit, its state_dict keys, its attention implementation, and no attribute of the adapters left.
"""

import copy
import datetime

import pytest
import torch
import torch.distributed as dist

import hf_upipe
from hf_upipe.adapters.tiled_mlp import tiled_verdict
from hf_upipe.attention import fused as fused_call
from hf_upipe.attention import fused as fused_module
from hf_upipe.attention import mask as sp_mask
from hf_upipe.attention import registered as hf_transformers
from hf_upipe.distributed import SequenceParallelState
from hf_upipe.models import architectures
from hf_upipe.models.verification import VERIFIED_RELEASES, installed_release
from tests.integrations._models import ARCHS, build_pair, tiny_config

ARCH_NAMES = sorted(ARCHS)


def test_registry_covers_the_fused_architectures():
    fused = {a.model_type for a in architectures.ARCHITECTURES.values() if a.fused}
    assert sorted(fused) == ARCH_NAMES
    assert set(architectures.fused_attention_classes()) == {
        f"{architectures.ARCHITECTURES[t].prefix}Attention" for t in fused
    }
    assert all(a.verified for a in architectures.ARCHITECTURES.values())


def test_text_model_types_are_the_text_configs_types():
    """`TEXT_MODEL_TYPES` (what the support table's "path" reads) names each multimodal type's text config."""
    from hf_upipe.models.presets import tiny_config as any_tiny_config

    assert set(architectures.TEXT_MODEL_TYPES) == set(architectures.TEXT_ONLY)
    for model_type, text_type in architectures.TEXT_MODEL_TYPES.items():
        try:
            config = any_tiny_config(model_type)
        except (KeyError, ValueError):  # not in this release (gemma4_unified on 5.23)
            continue
        assert config.get_text_config().model_type == text_type, model_type


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("adapter", ["fused", "tiled"])
def test_the_installed_transformers_is_verified(arch, adapter):
    """On a verified release the source is a recorded one (the fast path); on any other, the behaviour check
    passes (`tests/test_verification.py` shows that it can fail)."""
    entry = architectures.ARCHITECTURES[arch]
    got = architectures.source_fingerprint(entry, adapter)
    verdict = (fused_module.fused_verdict if adapter == "fused" else tiled_verdict)(entry)
    if installed_release() in VERIFIED_RELEASES:
        want = entry.fused_fingerprints if adapter == "fused" else entry.tiled_fingerprints
        assert got in want, (
            f"transformers {installed_release()} has another source for the {adapter} adapter of "
            f"{arch} than the one recorded: re-verify the adapter, then record {got!r}"
        )
        assert verdict.how == "fingerprint"
    else:
        assert verdict.ok and verdict.how == "behaviour", verdict


def _lora(model, seed):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            init_lora_weights=False,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "qkv_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "gate_up_proj",
            ],
        ),
    )
    torch.manual_seed(seed)
    return model


def _run(model, ids):
    """Logits and every trainable gradient of a sum-of-logits-squares loss (every output matters)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    (logits.double() ** 2).mean().backward()
    return logits.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad
    }


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process, removed afterwards."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_fused_forward_equals_the_installed_original(arch, lora, one_rank_group, monkeypatch):
    ref, model = build_pair(tiny_config(arch, heads=8, kv_heads=2), "upipe", seed=5)
    if lora:
        ref, model = _lora(ref, 5), _lora(model, 5)
        model.load_state_dict(ref.state_dict())
    hf_upipe.prepare_model(model)
    assert (
        sum("forward" in m.__dict__ for m in model.modules()) == 2
    )  # both layers' attention run fused
    state = SequenceParallelState(
        sp_group=one_rank_group,
        sp_size=1,
        sp_rank=0,
        dp_group=None,
        dp_size=1,
        dp_rank=0,
        heads_per_chunk=1,
        kernel="sdpa",
    )  # 8 stages of one head
    monkeypatch.setattr(
        fused_call, "active_state", lambda: state
    )  # the fused path, even on one rank
    for module in (
        sp_mask,
        hf_transformers,
    ):  # and its mask (a window: Gemma 3), and the registered path
        monkeypatch.setattr(module, "active_state", lambda: state)
    calls = []
    real = fused_call.fused_upipe_attention
    monkeypatch.setattr(
        fused_call, "fused_upipe_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    want_logits, want_grads = _run(ref, ids)
    got_logits, got_grads = _run(model, ids)
    assert len(calls) == 2  # the fused block really ran, once per layer
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tiled_forwards_equal_the_installed_original(arch):
    ref, model = build_pair(tiny_config(arch), "sdpa", seed=6)
    assert (
        hf_upipe.prepare_model(
            model, hf_upipe.UPipeConfig(tiled_mlp=True, mlp_chunk_tokens=4, fused_attention=False)
        )
        is model
    )
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    (want_logits, want_grads), (got_logits, got_grads) = _run(ref, ids), _run(model, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_prepare_then_unprepare_is_exact(arch, lora):
    torch.manual_seed(7)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa")
    if lora:
        model = _lora(model, 7)
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    attributes = {name: set(vars(m)) for name, m in model.named_modules()}
    hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=True, mlp_chunk_tokens=5))
    assert sum("forward" in m.__dict__ for m in model.modules()) > 0
    assert hf_upipe.unprepare_model(model) is model
    assert list(model.state_dict()) == keys
    assert {
        name: set(vars(m)) for name, m in model.named_modules()
    } == attributes  # nothing of ours is left
    base = model.get_base_model() if lora else model
    assert base.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(4))
    (want, want_grads), (got, got_grads) = _run(original, ids), _run(model, ids)
    assert torch.equal(got, want)
    assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
