"""Tiled MLP equals the model's own MLP: outputs, input gradients and every parameter gradient (also LoRA)."""

import copy

import pytest
import torch

from hf_upipe.adapters.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp, tiled_mlp
from tests.integrations._models import tiny_config


def _mlp(arch: str, dtype, lora: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers=1), dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                init_lora_weights=False,
                target_modules=["gate_proj", "up_proj", "down_proj"],
            ),
        )
    return model


def _grads(model, x, dy):
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    mlp = next(m for m in model.modules() if type(m).__name__.endswith("MLP"))
    y = mlp(x)
    y.backward(dy)
    return (
        y.detach(),
        x.grad,
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_mlp_equals_plain(arch, lora, dtype):
    ref = _mlp(arch, dtype, lora)
    tiled = copy.deepcopy(ref)
    assert apply_tiled_mlp(tiled, chunk_tokens=7) == 1
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 48, generator=gen).to(dtype)  # 30 tokens: chunks 7,7,7,7,2
    dy = torch.randn(2, 30, 48, generator=gen).to(dtype)
    y0, dx0, g0 = _grads(ref, x, dy)
    y1, dx1, g1 = _grads(tiled, x, dy)
    assert g0.keys() == g1.keys() and len(g0) > 0
    if lora:
        assert all("lora_" in n for n in g0)
    if (
        dtype == torch.float32
    ):  # the weight gradients are sums over 60 tokens in another order: relative to max
        for got, want, name in [(y1, y0, "y"), (dx1, dx0, "dx")] + [(g1[n], g0[n], n) for n in g0]:
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), (name, err)
    else:  # bf16: within 2x the plain bf16 path's error against an fp32 computation, plus one ulp
        ref32 = _mlp(arch, torch.float32, lora)
        y32, dx32, g32 = _grads(ref32, x.float(), dy.float())
        for got, plain, exact, name in [(y1, y0, y32, "y"), (dx1, dx0, dx32, "dx")] + [
            (g1[n], g0[n], g32[n], n) for n in g0
        ]:
            err_plain = (plain.float() - exact).abs().max().item()
            err = (got.float() - exact).abs().max().item()
            assert err <= 2 * err_plain + 2**-7 * exact.abs().max().item(), (name, err, err_plain)


def test_tiled_mlp_saves_only_the_input():
    """Peak of saved tensors: the plain MLP saves [B, s, I]-sized intermediates, the tiled one only x."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 256), torch.nn.Linear(256, 16)
    fn = lambda t: lin2(torch.relu(lin1(t)))  # noqa: E731
    x = torch.randn(1, 512, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        tiled_mlp(x, fn, list(lin1.parameters()) + list(lin2.parameters()), chunk_tokens=64)
    assert sum(saved) == x.numel()  # only the input
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        fn(x)
    assert sum(saved) >= 2 * 512 * 256


def test_dropout_masks_replay_in_backward():
    """LoRA-style dropout inside the MLP: the recomputed chunks draw the same masks as the forward did, so the
    gradient equals that of the same chunks run plainly (masks are drawn per chunk, as in any tiled MLP)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 12)
    drop = torch.nn.Dropout(0.5)
    fn = lambda t: lin(drop(t))  # noqa: E731
    x = torch.randn(2, 40, 12, requires_grad=True)
    torch.manual_seed(5)
    y0 = torch.cat(
        [fn(x[:, a : a + 9]) for a in range(0, 40, 9)], dim=1
    )  # [2, 40, 12], per-chunk masks
    y0.sum().backward()
    g0, x.grad = x.grad.clone(), None
    torch.manual_seed(5)
    y1 = tiled_mlp(x, fn, list(lin.parameters()), chunk_tokens=9)
    y1.sum().backward()
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(x.grad, g0)
    assert not torch.equal(g0[:, :9], g0[:, 9:18])


def test_remove_restores_the_forward():
    model = _mlp("llama", torch.float32, False)
    mlp = model.model.layers[0].mlp
    apply_tiled_mlp(model, chunk_tokens=4)
    apply_tiled_mlp(model, chunk_tokens=4)  # idempotent
    assert "forward" in mlp.__dict__ and mlp._upipe_mlp_chunk == 4
    assert remove_tiled_mlp(model) == 4  # the MLP, the layer's two RMSNorms and the final norm
    assert "forward" not in mlp.__dict__ and not hasattr(mlp, "_upipe_mlp_chunk")
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        apply_tiled_mlp(model, chunk_tokens=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_whole_model_with_tiled_mlp_and_norms_equals_plain(arch):
    """All MLPs and the layer/final RMSNorms tiled (q_norm/k_norm left alone): loss and every gradient equal."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(arch, layers=2), attn_implementation="sdpa")
    tiled = copy.deepcopy(ref)
    assert apply_tiled_mlp(tiled, chunk_tokens=5) == 2
    norms = [n for n, m in tiled.named_modules() if "forward" in m.__dict__ and "norm" in n]
    assert len(norms) == 2 * 2 + 1 and not any(n.endswith(("q_norm", "k_norm")) for n in norms), (
        norms
    )
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (ref, tiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0])
    for (name, p), (_, q) in zip(ref.named_parameters(), tiled.named_parameters()):
        err = (p.grad - q.grad).abs().max().item()
        assert err <= 1e-5 * p.grad.abs().max().item() + 1e-9, (name, err)
