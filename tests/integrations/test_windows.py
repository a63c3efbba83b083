"""Sliding windows shorter than the sequence under sequence parallelism, against one process ("sdpa", whose window
lives in its mask): the loss, the logits of every shard and every parameter gradient, on 2 gloo ranks.

Cases: Mistral on the fused block and on the registered path (window in the config and the call), Qwen2 with its
window switched on, Qwen2-MoE (window in the mask only), Gemma-3-text (sliding and full layers alternating), and
Mistral with LoRA; fp32 with a tight tolerance and bf16 with a loose one. The window (5) is shorter than a shard
(12 tokens) and than the sequence (24), so windows cross shard boundaries.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hf_upipe
from hf_upipe.data import shard_batch
from hf_upipe.models import tiny_config as any_tiny
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config

S, WINDOW = 24, 5


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pair(case, dtype):
    from transformers import AutoModelForCausalLM

    if case in ("mistral fused", "mistral registered", "mistral lora"):
        return build_pair(tiny_config("mistral", sliding_window=WINDOW), "upipe", seed=0, dtype=dtype)
    if case == "qwen2":
        return build_pair(tiny_config("qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0),
                          "upipe", seed=1, dtype=dtype)
    config = any_tiny(case)  # qwen2_moe (window in the mask only), gemma3_text (sliding and full layers)
    config.sliding_window = WINDOW
    if case == "qwen2_moe":
        config.use_sliding_window, config.max_window_layers = True, 0
    torch.manual_seed(2)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="upipe", dtype=dtype)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _worker(rank, world, cases, dtype):
    hf_upipe.init_sequence_parallel(world)
    results = {}
    for case in cases:
        ref, model = _pair(case, dtype)
        if case == "mistral lora":
            from peft import LoraConfig

            from hf_upipe.integrations.peft import get_peft_model

            lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
            torch.manual_seed(5)
            ref = get_peft_model(ref, lora)
            torch.manual_seed(5)
            model = get_peft_model(model, copy.deepcopy(lora))
            model.load_state_dict(ref.state_dict())
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(fused_attention=case != "mistral registered"))
        vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else 96
        ids = torch.randint(3, min(vocab, 96), (2, S), generator=torch.Generator().manual_seed(7))
        ref.zero_grad()
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
        kw = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens", "labels")}
        model.zero_grad()
        got = model(**kw, labels=shard["shift_labels"], shift_labels=shard["shift_labels"],
                    num_items_in_batch=shard["num_label_tokens"])
        got.loss.backward()
        loss = got.loss.detach().float().clone()
        dist.all_reduce(loss)
        s = S // world
        errors = {"loss": _rel(loss, out.loss.detach()),
                  "logits": _rel(got.logits.detach(), out.logits.detach()[:, rank * s:(rank + 1) * s])}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.float().clone()
            dist.all_reduce(g)
            errors[name] = _rel(g, ref_grads[name])
        results[case] = max(errors.values()), max(errors, key=errors.get)
    hf_upipe.reset_sequence_parallel()
    return results


CASES = ["mistral fused", "mistral registered", "qwen2", "qwen2_moe", "gemma3_text", "mistral lora"]


def test_windows_shorter_than_the_sequence_are_exact_fp32():
    for rank, results in enumerate(run_distributed(_worker, 2, CASES, torch.float32, timeout=300)):
        for case, (error, where) in results.items():
            assert error < 2e-5, (rank, case, where, error)


@pytest.mark.slow
def test_windows_in_bf16():
    for rank, results in enumerate(run_distributed(_worker, 2, ["mistral fused", "qwen2_moe"], torch.bfloat16)):
        for case, (error, where) in results.items():
            assert error < 6e-2, (rank, case, where, error)
