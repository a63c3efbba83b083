"""Gated-DeltaNet hybrids (Qwen3-Next, OLMo-Hybrid) under sequence parallelism: each rank runs transformers' own
mixer on its shard, continued from the previous rank's convolution halo and recurrent state
(`hf_upipe.integrations.mixers`). Against one process: loss, the logits of every shard and every trainable
gradient, at SP 2 and SP 4, plain and PEFT LoRA, with activation checkpointing (the recompute re-runs the rank
chain inside the backward) and with linear-attention layers between attention layers. Unprepared, such a model is
refused under SP; without the state passing the shards would be wrong (so the test can fail).
"""

import copy

import torch

import hf_upipe
from hf_upipe.integrations import mixers
from hf_upipe.models import tiny_config
from tests._dist import run_distributed
from tests.integrations._models import sharded_errors

S = 32


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pair(model_type):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config.num_hidden_layers = 4
    config.layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="upipe")
    model.load_state_dict(ref.state_dict())
    return ref, model


def _worker(rank, world, cases):
    from peft import LoraConfig

    from hf_upipe.integrations.peft import get_peft_model

    hf_upipe.init_sequence_parallel(world)
    out = {}
    for model_type, lora, ckpt in cases:
        ref, model = _pair(model_type)
        unprepared = _refusal(model, rank, world)
        if lora:
            cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
            torch.manual_seed(5)
            ref = get_peft_model(ref, cfg)
            torch.manual_seed(5)
            model = get_peft_model(model, copy.deepcopy(cfg))
            model.load_state_dict(ref.state_dict())
        hf_upipe.prepare_model(model)
        installed = sum(mixers.is_installed(m) for m in model.modules())
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ref.train()
        ids = torch.randint(3, 96, (2, S), generator=torch.Generator().manual_seed(7))
        errors, trained = sharded_errors(ref, model, ids, rank, world)
        ref_trained = sum(p.grad is not None for p in ref.parameters())
        out[(model_type, lora, ckpt)] = (errors, installed, trained, ref_trained, unprepared)
    hf_upipe.reset_sequence_parallel()
    return out


def _refusal(model, rank, world, length=S):
    """A call on this rank's shard of `length` tokens: the NotImplementedError's message, or "ran" (an unprepared
    hybrid under SP is refused before any layer, by the mask function's gate)."""
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(1))
    shard = hf_upipe.shard_batch({"input_ids": ids}, rank, world)
    try:
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    except NotImplementedError as err:
        return str(err)
    return "ran"


CASES = {2: [("qwen3_next", False, False), ("olmo_hybrid", True, True)],
         4: [("qwen3_next", True, True), ("olmo_hybrid", False, False)]}


def test_gated_deltanet_hybrids_are_exact():
    for world, cases in CASES.items():
        for rank, out in enumerate(run_distributed(_worker, world, cases, timeout=300)):
            for case, (errors, installed, trained, ref_trained, unprepared) in out.items():
                assert installed == 2, (case, installed)  # both linear-attention layers run across shards
                assert trained == ref_trained
                worst = max(errors, key=errors.get)
                assert errors[worst] < 1e-4, (world, rank, case, worst, errors[worst])
                assert "prepare_model" in unprepared and "linear_attention" in unprepared, unprepared


def _shard_alone_worker(rank, world):
    """The same model with the mixers left on their shard (no state passing): the last shard is wrong."""
    ref, model = _pair("qwen3_next")
    hf_upipe.init_sequence_parallel(world)
    try:
        hf_upipe.prepare_model(model)
        mixers.remove_mixers(model)
        mixers._READY[id(model.config)] = __import__("weakref").ref(model.config)  # let the gate pass, to show why
        ids = torch.randint(3, 96, (1, S), generator=torch.Generator().manual_seed(1))
        shard = hf_upipe.shard_batch({"input_ids": ids}, rank, world)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        s = S // world
        return _rel(logits, ref(input_ids=ids).logits[:, rank * s:(rank + 1) * s])
    finally:
        mixers._READY.clear()
        hf_upipe.reset_sequence_parallel()


def test_shards_alone_would_be_wrong():
    errors = run_distributed(_shard_alone_worker, 2)
    assert errors[0] < 1e-5 and errors[1] > 1e-2, errors  # rank 0 starts from zero state either way


def _short_shard_worker(rank, world):
    """Shards shorter than the convolution's reach: the same error on every rank, before any send (no hang)."""
    _, model = _pair("qwen3_next")
    hf_upipe.init_sequence_parallel(world)
    try:
        hf_upipe.prepare_model(model)
        return _refusal(model, rank, world, length=4)
    finally:
        hf_upipe.reset_sequence_parallel()


def test_shards_shorter_than_the_convolution_are_refused_on_every_rank():
    for said in run_distributed(_short_shard_worker, 2, timeout=120):
        assert "a shard of 2 tokens is shorter than the convolution's reach (3 tokens)" in said, said
