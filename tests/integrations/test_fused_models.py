"""prepare_model(): the fused UPipe block on every fused architecture (`hf_upipe.models.architectures.FUSED`: Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, Granite, GraniteMoE, OLMo 2, Phi-3, Gemma, Gemma 3, SmolLM3,
Cohere), plain and with PEFT LoRA adapters, at SP 2 and SP 4 (GQA, and k/v replication where Hk < 4), on gloo ranks
vs the single-process sdpa model: logits on every shard and every trainable gradient (summed over the SP group);
the fused path is really the one that runs; activation checkpointing and no_grad eval work."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

import hf_upipe
import hf_upipe.attention.fused as fused_call
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _with_lora(ref, model, seed):
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"],
    )
    ref, model = get_peft_model(ref, cfg), get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero B so that A and B both get gradients
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                q.copy_(p)
    return ref, model


def _case(rank, world, arch, geom, chunk, lora, dtype, ckpt, seed, save=False, overlap=False, B=2):
    H, Hk = geom
    S = 8 * world
    cfg = tiny_config(arch, heads=H, kv_heads=Hk)
    ref, model = build_pair(cfg, "upipe", seed)
    if lora:
        ref, model = _with_lora(ref, model, seed)
    model.to(dtype)
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    n = (labels != -100).sum()
    ref_logits = ref(ids).logits
    F.cross_entropy(
        ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    ).div(n).backward()
    base = None
    if dtype != torch.float32:  # the plain single-process model's own error in this dtype
        low, _ = build_pair(cfg, "sdpa", seed)
        if lora:
            low, _ = _with_lora(low, build_pair(cfg, "sdpa", seed)[1], seed)
        low.to(dtype)
        low_logits = low(ids).logits
        F.cross_entropy(
            low_logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ).div(n).backward()
        ref_named = dict(ref.named_parameters())
        base = {"logits": _rel(low_logits, ref_logits)}
        base.update(
            {
                k: _rel(p.grad, ref_named[k].grad)
                for k, p in low.named_parameters()
                if p.requires_grad
            }
        )
        base["eval logits"] = base["logits"]

    state = hf_upipe.init_sequence_parallel(heads_per_chunk=chunk)
    settings = hf_upipe.UPipeConfig(
        fused_backward="save" if save else "recompute", overlap_comm=overlap
    )
    hf_upipe.prepare_model(model, settings)
    hf_upipe.prepare_model(model, settings)  # idempotent
    calls = []
    original = fused_call.fused_upipe_attention
    fused_call.fused_upipe_attention = lambda *a, **k: (
        calls.append((k["save_attention"], k["overlap"])) or original(*a, **k)
    )
    try:
        if ckpt:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        s = S // world
        sh = slice(rank * s, (rank + 1) * s)
        pos = torch.arange(S)[sh].unsqueeze(0)
        logits = model(ids[:, sh], position_ids=pos).logits
        F.cross_entropy(
            logits.float().flatten(0, 1),
            labels[:, sh].flatten(),
            ignore_index=-100,
            reduction="sum",
        ).div(n).backward()
        errs = {"logits": _rel(logits, ref_logits[:, sh])}
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        ref_params = dict(ref.named_parameters())
        for name, p in trained:
            g = p.grad.float().clone()
            dist.all_reduce(g, group=state.sp_group)
            errs[name] = _rel(g, ref_params[name].grad)
        model.eval()
        with torch.no_grad():
            errs["eval logits"] = _rel(
                model(ids[:, sh], position_ids=pos).logits, ref_logits[:, sh]
            )
    finally:
        fused_call.fused_upipe_attention = original
        hf_upipe.reset_sequence_parallel()
    layers = cfg.num_hidden_layers
    assert set(calls) == {(save, overlap)}, (
        calls
    )  # the modes prepare_model was given reached every call
    return errs, base, len(calls), layers, len(trained)


def _worker(rank, world, cases):
    return [_case(rank, world, *c) for c in cases]


F32, BF16 = torch.float32, torch.bfloat16
CASES = {  # (arch, (H, Hk), heads_per_chunk, lora, dtype, activation checkpointing, seed)
    2: [
        ("llama", (8, 2), 1, False, F32, False, 0),
        ("qwen2", (4, 4), None, True, F32, False, 1),
        ("mistral", (8, 4), 2, True, F32, True, 2),
        ("qwen3", (6, 2), 1, False, F32, False, 3),
        ("qwen3", (8, 2), 1, True, BF16, False, 4),
    ],
    4: [
        ("llama", (8, 2), 1, True, F32, False, 5),
        ("qwen2", (8, 8), 2, False, F32, False, 6),
        ("mistral", (4, 1), 1, False, F32, False, 7),
        ("qwen3", (8, 4), 1, True, F32, True, 8),
    ],
}
# every other fused architecture, plain at one SP size and LoRA at the other
for n, arch in enumerate(
    [
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "granite",
        "granitemoe",
        "olmo2",
        "phi3",
        "gemma",
        "gemma3_text",
        "smollm3",
        "cohere",
    ]
):
    lora_at_2 = n % 2 == 1
    CASES[2].append((arch, (4, 2), 1 if n % 3 else None, lora_at_2, F32, n == 5, 20 + n))
    CASES[4].append((arch, (8, 2) if n % 2 else (8, 4), 1, not lora_at_2, F32, False, 40 + n))
CASES[2] += [
    ("olmo2", (8, 2), 1, True, BF16, False, 60),
    ("cohere", (4, 4), 1, False, BF16, False, 61),
]
# the save-mode backward (UPipeConfig(fused_backward="save")): GQA chunks shared by several stages, replication at
# 4 ranks, LoRA, checkpointing, the projection variants, bf16
CASES[2] += [
    ("llama", (8, 2), 1, True, F32, True, 70, True),
    ("olmo2", (4, 2), 1, False, F32, False, 71, True),
    ("phi3", (8, 2), 1, True, BF16, False, 72, True),
]
CASES[4] += [
    ("qwen3", (8, 2), 1, True, F32, False, 73, True),
    ("cohere", (8, 4), 1, False, F32, True, 74, True),
]
# all-to-alls overlapped (UPipeConfig(overlap_comm=True)), in both backward modes
CASES[2] += [
    ("llama", (8, 2), 1, True, F32, True, 80, True, True),
    ("qwen3", (6, 2), 1, False, F32, False, 81, False, True),
]
CASES[4] += [("mistral", (8, 2), 1, True, F32, False, 82, False, True)]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fused_models_match_single_process(world):
    for per_rank in run_distributed(_worker, world, CASES[world]):
        for case, (errs, base, calls, layers, n_trained) in zip(CASES[world], per_rank):
            lora, ckpt = case[3], case[5]
            # the fused block ran in every layer: forward (+ recompute under checkpointing) + eval forward
            assert calls == layers * (3 if ckpt else 2), (case, calls)
            assert len(errs) == n_trained + 2
            if lora:
                assert all("lora_" in k for k in errs if k not in ("logits", "eval logits")), (
                    "base not frozen"
                )
            for name, e in errs.items():
                if base is None:
                    assert e < 1e-4, f"{name}: rel err {e:.2e} in {case}"
                else:  # bf16: within 2x the plain bf16 model's error plus one bf16 ulp
                    assert e <= 2 * base[name] + 2**-7, (
                        f"{name}: rel err {e:.2e} vs plain {base[name]:.2e} in {case}"
                    )


def test_unknown_attention_modules_keep_the_registered_path(caplog):
    from transformers import AutoModelForCausalLM, OlmoConfig

    cfg = OlmoConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="upipe")
    with caplog.at_level("INFO", logger="hf_upipe.prepare"):
        hf_upipe.prepare_model(model)
    assert (
        "fused UPipe attention on 0 module(s); ['OlmoAttention'] keep the registered 'upipe' path"
        in caplog.text
    )
    assert not any("forward" in m.__dict__ for m in model.modules())
    # overlapping the fused block's all-to-alls is a setting this model has no module to apply to: refused, and the
    # model is left as it was
    hf_upipe.unprepare_model(model)
    with pytest.raises(
        ValueError,
        match=r"UPipeConfig\(overlap_comm=True\) overlaps the fused block's all-to-alls, "
        r"but none of this model's attention modules .*\['OlmoAttention'\]",
    ):
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(overlap_comm=True))
    assert model.config._attn_implementation == "upipe" and not any(
        "forward" in m.__dict__ for m in model.modules()
    )


@pytest.mark.parametrize(
    "arch, setting, reason",
    [
        ("cohere", dict(use_qk_norm=True), "per-head LayerNorm q/k norms"),
        ("gemma3_text", dict(attn_logit_softcapping=30.0), "attention logit soft-capping"),
        ("gemma", dict(use_bidirectional_attention=True), "bidirectional attention"),
    ],
)
def test_settings_the_fused_block_does_not_compute_keep_the_registered_path(
    arch, setting, reason, caplog
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, **setting), attn_implementation="upipe"
    )
    with caplog.at_level("INFO", logger="hf_upipe.attention"):
        hf_upipe.prepare_model(model)
    assert f"keep the registered 'upipe' path, not the fused block: {reason}" in caplog.text
    assert not any("forward" in m.__dict__ for m in model.modules())


def _merged_worker(rank, world):
    """Merged LoRA adapters: the fused block reads the merged base weights and no adapter."""
    cfg = tiny_config("llama", heads=8, kv_heads=2)
    ref, model = _with_lora(*build_pair(cfg, "upipe", 11), seed=11)
    model.merge_adapter()
    hf_upipe.init_sequence_parallel()
    hf_upipe.prepare_model(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    sh = slice(rank * 8, (rank + 1) * 8)
    with torch.no_grad():
        with hf_upipe.without_sequence_parallel():
            want = ref(ids).logits[:, sh]
        err = _rel(model(ids[:, sh], position_ids=torch.arange(16)[sh][None]).logits, want)
    hf_upipe.reset_sequence_parallel()
    return err


def test_merged_adapters():
    assert max(run_distributed(_merged_worker, 2)) < 1e-5
