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
from hf_upipe.models.presets import tiny_config as any_tiny
from tests._dist import run_distributed
from tests.integrations._models import build_pair, lora_pair, tiny_config

S, WINDOW = 24, 5


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pair(case, dtype):
    from transformers import AutoModelForCausalLM

    if case in ("mistral fused", "mistral registered", "mistral lora"):
        return build_pair(
            tiny_config("mistral", sliding_window=WINDOW), "upipe", seed=0, dtype=dtype
        )
    if case == "qwen2":
        return build_pair(
            tiny_config(
                "qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0
            ),
            "upipe",
            seed=1,
            dtype=dtype,
        )
    config = any_tiny(
        case
    )  # qwen2_moe (window in the mask only), gemma3_text (sliding and full layers)
    config.sliding_window = WINDOW
    if case == "qwen2_moe":
        config.use_sliding_window, config.max_window_layers = True, 0
    torch.manual_seed(2)
    ref = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype
    )
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="upipe", dtype=dtype
    )
    model.load_state_dict(ref.state_dict())
    return ref, model


def _run(model, kw, labels=None, **extra):
    """Loss and logits of one forward + backward; gradients stay on the parameters."""
    model.zero_grad()
    out = model(**kw, labels=labels, **extra)
    out.loss.backward()
    return out.loss.detach().float(), out.logits.detach()


def _worker(rank, world, cases, dtype):
    """Errors of the SP run against the fp32 one-process model (and, in bf16, the plain bf16 one-process model's
    own errors against it: the yardstick of the bf16 check)."""
    hf_upipe.init_sequence_parallel(world)
    results = {}
    for case in cases:
        ref, model = _pair(case, torch.float32)
        if case == "mistral lora":
            ref, model = lora_pair(ref, model)
        low = copy.deepcopy(ref).to(dtype) if dtype != torch.float32 else None
        model.to(dtype)
        hf_upipe.prepare_model(
            model, hf_upipe.UPipeConfig(fused_attention=case != "mistral registered")
        )
        vocab = (
            model.get_output_embeddings().weight.shape[0]
            if hasattr(model, "get_output_embeddings")
            else 96
        )
        ids = torch.randint(3, min(vocab, 96), (2, S), generator=torch.Generator().manual_seed(7))
        s = S // world
        with (
            hf_upipe.without_sequence_parallel()
        ):  # the one-process references, on the whole sequence
            loss_ref, logits_ref = _run(ref, {"input_ids": ids}, ids)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        base = None
        if low is not None:
            with hf_upipe.without_sequence_parallel():
                loss_low, logits_low = _run(low, {"input_ids": ids}, ids)
            base = {
                "loss": _rel(loss_low, loss_ref),
                "logits": _rel(
                    logits_low[:, rank * s : (rank + 1) * s],
                    logits_ref[:, rank * s : (rank + 1) * s],
                ),
            }
            base.update(
                {
                    n: _rel(p.grad, ref_grads[n])
                    for n, p in low.named_parameters()
                    if p.grad is not None
                }
            )
        shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
        kw = {
            k: v
            for k, v in shard.items()
            if k not in ("shift_labels", "num_label_tokens", "labels")
        }
        loss, logits = _run(
            model,
            kw,
            shard["shift_labels"],
            shift_labels=shard["shift_labels"],
            num_items_in_batch=shard["num_label_tokens"],
        )
        loss = loss.clone()
        dist.all_reduce(loss)
        errors = {
            "loss": _rel(loss, loss_ref),
            "logits": _rel(logits, logits_ref[:, rank * s : (rank + 1) * s]),
        }
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.float().clone()
            dist.all_reduce(g)
            errors[name] = _rel(g, ref_grads[name])
        results[case] = errors, base
    hf_upipe.reset_sequence_parallel()
    return results


CASES = ["mistral fused", "mistral registered", "qwen2", "qwen2_moe", "gemma3_text", "mistral lora"]


def test_windows_shorter_than_the_sequence_are_exact_fp32():
    for rank, results in enumerate(run_distributed(_worker, 2, CASES, torch.float32, timeout=300)):
        for case, (errors, _) in results.items():
            worst = max(errors, key=errors.get)
            assert errors[worst] < 2e-5, (rank, case, worst, errors[worst])


@pytest.mark.slow
def test_windows_in_bf16():
    """Within 2x the plain bf16 model's own error plus one bf16 ulp (MoE routing makes fixed bounds meaningless)."""
    for rank, results in enumerate(
        run_distributed(_worker, 2, ["mistral fused", "qwen2_moe"], torch.bfloat16)
    ):
        for case, (errors, base) in results.items():
            for name, e in errors.items():
                assert e <= 2 * base[name] + 2**-7, (rank, case, name, e, base[name])
