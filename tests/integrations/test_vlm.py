"""Vision-language models under SP (`hf_upipe.vlm`): images merged whole, the sequence sharded after.

Tiny Qwen2-VL and Qwen2.5-VL models built from their configs, random weights, two images (one of them across the
shard boundary) and text, a length that does not divide by the SP size: at SP 2 on gloo ranks, the loss, each
shard's logits and every trainable gradient (summed over the group: the vision tower's, the embedding's, LoRA's on
the language model, or every parameter's in a full fine-tune) equal the one-process model's in fp32.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hf_upipe
from hf_upipe.vlm import shard_multimodal_batch
from tests._dist import run_distributed

IMAGE, VIDEO, START, END = 60, 61, 62, 63


def tiny_vlm(model_type: str, seed: int):
    """A tiny random `model_type` VLM (sdpa; head_dim 8, M-RoPE sections 2+1+1)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    vision = dict(depth=2, num_heads=2, patch_size=2, temporal_patch_size=1, spatial_merge_size=2)
    if model_type == "qwen2_vl":
        vision.update(embed_dim=16, hidden_size=32, mlp_ratio=2)
    else:  # Qwen2.5-VL: windowed vision blocks, the second one full
        vision.update(
            hidden_size=16, intermediate_size=24, out_hidden_size=32, window_size=8,
            fullatt_block_indexes=[1],
        )  # fmt: skip
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
        bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).float()
    with torch.no_grad():  # non-symmetric weights everywhere (the norms start at exactly 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tiny_batch(seed: int, padded: bool, S: int = 23):
    """Two rows of S tokens: row 0 has a 2x2-token image over positions 10..13 (the shard boundary at SP 2 is 12),
    row 1 a 2x3-token image at 3..8; labels on the text tokens only; `padded`: an attention_mask, row 1 padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 56, (2, S), generator=gen)  # [B, S]
    grids, types = [], torch.zeros(2, S, dtype=torch.long)
    for row, (at, (h, w)) in enumerate(((10, (4, 4)), (3, (4, 6)))):
        n = h * w // 4  # tokens after the 2x2 merge
        ids[row, at - 1], ids[row, at : at + n], ids[row, at + n] = START, IMAGE, END
        types[row, at : at + n] = 1
        grids.append([1, h, w])
    grid = torch.tensor(grids)  # [N_images, 3]
    pixels = torch.randn(
        int(grid.prod(-1).sum()), 3 * 1 * 2 * 2, generator=gen
    )  # [patches, C*T*P*P]
    labels = ids.masked_fill(types.bool(), -100)
    batch = dict(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=types,
        labels=labels,
    )
    if padded:  # row 1 right-padded by 3 tokens
        batch["attention_mask"] = torch.ones(2, S, dtype=torch.long)
        batch["attention_mask"][1, -3:] = 0
        ids[1, -3:], labels[1, -3:] = 0, -100
    return batch


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _pair(model_type, mode, seed):
    """(one-process reference, copy to run under SP), both with LoRA on the language model's projections and the
    vision tower trainable (`mode="lora"`), or every parameter trainable (`mode="full"`)."""
    ref = tiny_vlm(model_type, seed)
    model = copy.deepcopy(ref)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = dict(
            r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"
        )
        ref, model = (
            get_peft_model(m, LoraConfig(**lora, init_lora_weights=False)) for m in (ref, model)
        )
        model.load_state_dict(ref.state_dict())
        for m in (ref, model):
            for name, p in m.named_parameters():
                if ".visual." in name:
                    p.requires_grad_(True)
    return ref, model


def _errors(rank, world, model_type, mode, seed, padded):
    hf_upipe.init_sequence_parallel(world)
    state = hf_upipe.get_sequence_parallel_state()
    ref, model = _pair(model_type, mode, seed)
    hf_upipe.prepare_model(model)
    base = model.get_base_model() if mode == "lora" else model
    implementations = (
        base.config.vision_config._attn_implementation,
        base.config.text_config._attn_implementation,
    )
    batch = tiny_batch(seed + 1, padded)
    with hf_upipe.without_sequence_parallel():
        want = ref(**batch)
    want.loss.backward()
    shard = shard_multimodal_batch(model, batch, state.sp_rank, state.sp_size)
    refused = None
    try:  # the images passed to the forward itself would be scattered into the shard: refused
        model(input_ids=batch["input_ids"][:, :12], pixel_values=batch["pixel_values"])
    except NotImplementedError as err:
        refused = str(err)
    got = model(
        inputs_embeds=shard["inputs_embeds"],
        position_ids=shard["position_ids"],
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=shard["num_label_tokens"],
    )
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss, group=state.sp_group)
    s, S = shard["inputs_embeds"].shape[1], batch["input_ids"].shape[1]
    mine = slice(rank * s, min((rank + 1) * s, S))  # the padding at the end has no reference
    n = mine.stop - mine.start
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))[:, mine, None].bool()
    logits = got.logits[:, :n].masked_fill(
        ~real, 0
    )  # [B, n, V]: real tokens only (padding has no reference)
    errors = {
        "loss": _rel(loss, want.loss),
        "logits": _rel(logits, want.logits[:, mine].masked_fill(~real, 0)),
    }
    grads = dict(ref.named_parameters())
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for name, p in trained:
        g = p.grad.clone()
        dist.all_reduce(g, group=state.sp_group)
        errors[name] = _rel(g, grads[name].grad)
    hf_upipe.reset_sequence_parallel()
    return errors, implementations, refused


CASES = [
    ("qwen2_vl", "lora", 0, False),
    ("qwen2_vl", "full", 1, True),
    ("qwen2_5_vl", "lora", 2, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}{'-padded' * c[3]}" for c in CASES])
def test_vlm_matches_single_process(case):
    for errors, implementations, refused in run_distributed(_errors, 2, *case):
        assert "['pixel_values']" in refused and "shard_multimodal_batch" in refused
        assert implementations == ("sdpa", "upipe")  # the vision tower keeps its own attention
        names = " ".join(errors)
        assert ".visual." in names and (
            "lora_B" in names if case[1] == "lora" else "embed_tokens" in names
        )
        bad = {name: e for name, e in errors.items() if not e < 1e-5}
        assert not bad, f"{case}: {bad}"


def test_other_vision_language_types_are_refused_with_the_reason():
    from transformers import AutoConfig

    from hf_upipe.integrations.support import config_refusal
    from hf_upipe.vlm import vlm_type_refusal

    assert config_refusal(AutoConfig.for_model("qwen2_vl")) is None
    assert vlm_type_refusal("qwen2_5_vl") is None
    for model_type, reason in (
        ("qwen3_vl", "deepstack"),
        ("llava", "not a vision-language type verified"),
    ):
        assert reason in vlm_type_refusal(model_type)
        assert reason in config_refusal(AutoConfig.for_model(model_type))
    with pytest.raises(NotImplementedError, match="deepstack"):
        shard_multimodal_batch(
            _Typed("qwen3_vl"), {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, 0, 1
        )


class _Typed(torch.nn.Module):
    """A module whose config names a model type (nothing else is read before the refusal)."""

    def __init__(self, model_type):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
