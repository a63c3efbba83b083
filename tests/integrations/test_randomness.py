"""Random draws inside a model under SP (`hf_upipe.adapters.hooks`): two shards holding identical inputs at
the same local positions, with the seed every rank shares, draw different dropout masks (hidden-state dropout,
PEFT's LoRA dropout on the MLP, the fused block's LoRA dropout) and different router jitter, each dropping the right
fraction; the hooks off, the same masks (the control); activation checkpointing's recompute draws the forward's
masks (gradients equal to the uncheckpointed step's with the same masks); LayerDrop and NEFTune are refused.

The masks of a hashed or seeded stream are fixed outcomes, so the statistical bounds (6 sigma) cannot flake."""

import math

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn

import hf_upipe
from hf_upipe.adapters import hooks as randomness
from hf_upipe.adapters.hooks import random_refusal, rank_seed
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config

P = 0.3  # every dropout probability


def _phi3(seed=0):
    cfg = tiny_config("phi3", heads=4, kv_heads=2, resid_pdrop=P, embd_pdrop=P)
    _, model = build_pair(cfg, "upipe", seed)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=P, target_modules="all-linear", init_lora_weights=False
    )
    return get_peft_model(model, lora)


def _record_masks(model, masks: list):
    """Forward hooks on every nn.Dropout (LoRA's and the model's): append (its name, its keep mask: output != 0)."""
    return [
        m.register_forward_hook(
            lambda mod, args, out, name=name: masks.append((name, out.detach() != 0))
        )
        for name, m in model.named_modules()
        if isinstance(m, nn.Dropout) and m.p > 0
    ]


def _step(model, ids, pos, masks, hooks_on=True):
    torch.manual_seed(1234)  # the seed every rank shares (the Trainer's set_seed)
    randomness.sync_randomness(hooks_on)
    try:
        out = model(input_ids=ids, position_ids=pos)
        out.logits.float().square().mean().backward()
    finally:
        randomness.sync_randomness(True)
    return out.logits.detach()


def _dropout_worker(rank, world):
    hf_upipe.init_sequence_parallel()
    model = _phi3()
    hf_upipe.prepare_model(model)
    model.train()
    s = 64
    ids = torch.randint(
        3, 96, (2, s), generator=torch.Generator().manual_seed(7)
    )  # the same on both ranks
    pos = torch.arange(rank * s, (rank + 1) * s)[None]
    fused = hf_upipe.attention.fused.count_fused(model)
    result = {"fused": fused}
    for name, on in (("forked", True), ("shared", False)):
        masks = []
        hooks = _record_masks(model, masks)
        _step(model, ids, pos, masks, on)
        for h in hooks:
            h.remove()
        flat = torch.cat(
            [m.flatten() for _, m in masks]
        )  # the first forward's masks, in call order
        other = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(other, flat)
        result[name] = (len(masks), flat.numel(), 1 - flat.double().mean().item())
        result[name + " agree"] = (other[0] == other[1]).double().mean().item()
    # the generators are shared again after the forward, and advanced
    state = torch.get_rng_state()
    states = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(states, state)
    result["rng alike after"] = torch.equal(states[0], states[1])
    return result


def test_shards_draw_their_own_dropout_masks():
    for r in run_distributed(_dropout_worker, 2):
        assert (
            r["fused"] == 2
        )  # attention LoRA runs in the fused block (its own masks), the MLP's in PEFT
        count, n, dropped = r["forked"]
        assert count >= 2 * 2 + 1 and n > 20_000, (
            r
        )  # resid x2 per layer, embeddings, LoRA on the MLP
        assert abs(dropped - P) < 6 * math.sqrt(P * (1 - P) / n), r
        expected = P * P + (1 - P) ** 2  # two independent masks agree this often
        assert abs(r["forked agree"] - expected) < 6 * math.sqrt(expected * (1 - expected) / n), r
        assert r["shared agree"] == 1.0, (
            r
        )  # the control: without the hooks every shard repeats the masks
        assert r["rng alike after"]


def _checkpoint_worker(rank, world, reentrant):
    """The same masks in the forward and in the recompute, and the gradients of the step without checkpointing
    (same seed, so the same masks)."""
    hf_upipe.init_sequence_parallel()
    s = 16
    ids = torch.randint(3, 96, (1, s), generator=torch.Generator().manual_seed(rank))
    pos = torch.arange(rank * s, (rank + 1) * s)[None]
    runs = {}
    for ckpt in (False, True):
        model = _phi3()
        hf_upipe.prepare_model(model)
        if ckpt:
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
            model.enable_input_require_grads()
        model.train()
        masks = []
        hooks = _record_masks(model, masks)
        logits = _step(model, ids, pos, masks)
        for h in hooks:
            h.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs[ckpt] = (logits, masks, grads)
    (l0, m0, g0), (l1, m1, g1) = runs[False], runs[True]
    layer_masks = len(m1) - len(
        m0
    )  # the recompute's: those of the checkpointed layers (in any order)
    first = dict(m1[: len(m0)])
    recompute_equal = layer_masks > 0 and all(torch.equal(m, first[n]) for n, m in m1[len(m0) :])
    forward_equal = all(a == b and torch.equal(x, y) for (a, x), (b, y) in zip(m0, m1))
    grad_err = max(((g1[k] - g).norm() / g.norm().clamp_min(1e-30)).item() for k, g in g0.items())
    return (
        layer_masks,
        recompute_equal,
        forward_equal,
        (l1 - l0).abs().max().item(),
        grad_err,
        len(g0),
    )


@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_checkpoint_recompute_draws_the_forward_masks(reentrant):
    for layer_masks, recompute_equal, forward_equal, logit_err, grad_err, n in run_distributed(
        _checkpoint_worker, 2, reentrant
    ):
        assert layer_masks >= 4 and recompute_equal and forward_equal
        assert logit_err == 0.0 and n > 0 and grad_err < 1e-5, (grad_err, n)


def _jitter_worker(rank, world, arch):
    """Router jitter (Mixtral's multiplier on the router's input) of identical tokens at identical local
    positions: drawn per rank. Returns the fraction of multipliers equal across the ranks and their range."""
    hf_upipe.init_sequence_parallel()
    cfg = tiny_config(arch, heads=4, kv_heads=2, router_jitter_noise=0.5)
    _, model = build_pair(cfg, "upipe", 0)
    hf_upipe.prepare_model(model)
    model.train()
    pairs = []
    for block in (m for m in model.modules() if hasattr(m, "jitter_noise")):
        seen = {}
        block.register_forward_pre_hook(lambda m, a, seen=seen: seen.update(x=a[0].clone()))
        block.gate.register_forward_pre_hook(
            lambda m, a, seen=seen: pairs.append(a[0].view(-1) / seen["x"].reshape(-1))
        )
    s = 32
    ids = torch.randint(3, 96, (2, s), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(99)
    model(input_ids=ids, position_ids=torch.arange(rank * s, (rank + 1) * s)[None])
    mult = torch.cat(pairs)  # the multipliers drawn, uniform in [0.5, 1.5]
    other = [torch.empty_like(mult) for _ in range(world)]
    dist.all_gather(other, mult)
    return (other[0] == other[1]).double().mean().item(), mult.min().item(), mult.max().item()


def test_router_jitter_is_drawn_per_rank():
    for agree, low, high in run_distributed(_jitter_worker, 2, "mixtral"):
        assert agree < 0.01 and 0.5 <= low < 0.52 and 1.48 < high <= 1.5


def _stream_worker(rank, world):
    """Any module's draws inside the model (here PhiMoE's router: input jitter and sparsemixer's sampling) come
    from a generator whose state differs between the ranks (alike with the hooks off: the control); after the
    forward the generator is where one draw from the shared state leaves it, on every rank."""
    hf_upipe.init_sequence_parallel()
    cfg = tiny_config(
        "phimoe", heads=4, kv_heads=2, router_jitter_noise=0.01, input_jitter_noise=0.1
    )
    _, model = build_pair(cfg, "upipe", 0)
    hf_upipe.prepare_model(model)
    model.train()
    inside = []
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_pre_hook(lambda *a: inside.append(torch.get_rng_state()))
    s = 8
    ids = torch.randint(3, 96, (1, s), generator=torch.Generator().manual_seed(rank))
    differ = {}
    for on in (True, False):
        inside.clear()
        torch.manual_seed(5)
        torch.randint(0, 2**62, (1,))  # the hook's one draw
        expected_after = torch.get_rng_state()
        torch.manual_seed(5)
        randomness.sync_randomness(on)
        try:
            model(input_ids=ids, position_ids=torch.arange(rank * s, (rank + 1) * s)[None])
        finally:
            randomness.sync_randomness(True)
        got = [torch.empty_like(inside[0]) for _ in range(world)]
        dist.all_gather(got, inside[0])
        differ[on] = not torch.equal(got[0], got[1])
        if on:
            restored = torch.equal(torch.get_rng_state(), expected_after)
    return len(inside), differ, restored


def test_every_draw_in_the_model_comes_from_the_rank_stream():
    for n, differ, restored in run_distributed(_stream_worker, 2):
        assert n == 2 and differ == {True: True, False: False} and restored


def test_refusals_name_the_setting():
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("opt", heads=4, kv_heads=4)
    cfg.layerdrop = 0.1
    model = AutoModelForCausalLM.from_config(cfg)
    assert "config.layerdrop = 0.0" in random_refusal(model)
    model.config.layerdrop = 0.0
    assert random_refusal(model) is None
    model.get_input_embeddings().neftune_noise_alpha = 5.0
    assert "neftune_noise_alpha=None" in random_refusal(model)
    assert rank_seed(3, 0) != rank_seed(3, 1) and rank_seed(3, 0) < 2**63


def _refusal_worker(rank, world):
    hf_upipe.init_sequence_parallel()
    cfg = tiny_config("opt", heads=4, kv_heads=4)
    cfg.layerdrop = 0.2
    _, model = build_pair(cfg, "upipe", 0)
    hf_upipe.prepare_model(model)
    ids = torch.randint(3, 96, (1, 8))
    model.eval()
    model(input_ids=ids, position_ids=torch.arange(rank * 8, rank * 8 + 8)[None])  # eval: no draw
    model.train()
    try:
        model(input_ids=ids, position_ids=torch.arange(rank * 8, rank * 8 + 8)[None])
    except NotImplementedError as e:
        return str(e), torch.equal(torch.get_rng_state(), torch.get_rng_state())
    return None


def test_layerdrop_is_refused_on_every_rank_in_training():
    for message, _ in run_distributed(_refusal_worker, 2):
        assert "layerdrop=0.2" in message and "config.layerdrop = 0.0" in message
