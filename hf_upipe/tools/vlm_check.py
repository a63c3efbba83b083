"""A vision-language model under SP against one process: the self-test's VLM check and the tests' builders.

Entry points:
- `tiny_vlm(model_type, seed)`: a tiny random Qwen2-VL / Qwen2.5-VL model built from its config (no downloads).
- `tiny_batch(seed, padded, video=False)`: two rows of 23 tokens with an image each, row 0's image across the
  SP-2 shard boundary; `video`: a video in row 1; `padded`: an attention_mask with row 1 right-padded;
  `images=False`: text only.
- `vlm_step(model, ref, batch)`: one training step of `ref` on the whole batch (one process) and of the prepared
  `model` on this rank's `hf_upipe.vlm.shard_multimodal_batch`: relative errors of the loss, the shard's logits
  on real tokens and every trainable gradient (summed over the SP group).
The self-test's rows for a VLM (`hf-upipe selftest --model qwen2_vl`) are `hf_upipe.tools.selftest.check_vlm`.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

__all__ = ["tiny_batch", "tiny_vlm", "vlm_pair", "vlm_step"]

IMAGE, VIDEO, START, END = 60, 61, 62, 63  # the tiny vocabulary's special tokens


def tiny_vlm(model_type: str, seed: int):
    """A tiny random `model_type` VLM ("sdpa"; head_dim 8, M-RoPE sections 2+1+1), non-symmetric weights."""
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
    with torch.no_grad():  # the norms start at exactly 1
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def tiny_batch(
    seed: int, padded: bool, video: bool = False, images: bool = True, S: int = 23
) -> dict:
    """Two rows of S tokens: row 0 has a 2x2-token image over positions 10..13 (the shard boundary at SP 2 is 12),
    row 1 a 2x3-token image at 3..8 and (`video`) a video of two 2x2-token frames at 12..19; labels on the text
    tokens only; `padded`: row 1 right-padded by 3 tokens; `images=False`: text only."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 56, (2, S), generator=gen)  # [B, S]
    grids, types = [], torch.zeros(2, S, dtype=torch.long)  # types: 1 on image tokens
    for row, (at, (h, w)) in enumerate(((10, (4, 4)), (3, (4, 6)))):
        n = h * w // 4  # tokens after the 2x2 merge
        ids[row, at - 1], ids[row, at : at + n], ids[row, at + n] = START, IMAGE, END
        types[row, at : at + n] = 1
        grids.append([1, h, w])
    grid = torch.tensor(grids)  # [N_images, 3]: t, h, w in patches
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
    if not images:  # text only: no vision tokens at all
        ids.copy_(torch.randint(2, 56, (2, S), generator=gen))
        types.zero_()
        labels = batch["labels"] = ids.clone()
        del batch["pixel_values"], batch["image_grid_thw"]
    if video:  # row 1: 2 frames of 2x2 tokens at 12..19
        ids[1, 11], ids[1, 12:20], ids[1, 20] = START, VIDEO, END
        types[1, 12:20] = 2
        batch["pixel_values_videos"] = torch.randn(2 * 4 * 4, 3 * 1 * 2 * 2, generator=gen)
        batch["video_grid_thw"] = torch.tensor([[2, 4, 4]])
        batch["second_per_grid_ts"] = torch.tensor([0.5])
        labels[1, 12:20] = -100
    if padded:
        batch["attention_mask"] = torch.ones(2, S, dtype=torch.long)
        batch["attention_mask"][1, -3:] = 0
        ids[1, -3:], labels[1, -3:] = 0, -100
    return batch


def vlm_pair(model_type: str, lora: bool, seed: int):
    """(one-process reference, its copy for SP): LoRA on the language model's q/v/down projections with the vision
    tower trainable too (`lora`), else every parameter trainable."""
    ref = tiny_vlm(model_type, seed)
    model = copy.deepcopy(ref)
    if lora:
        from peft import LoraConfig, get_peft_model

        kw = dict(
            r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"
        )
        ref, model = (
            get_peft_model(m, LoraConfig(**kw, init_lora_weights=False)) for m in (ref, model)
        )
        model.load_state_dict(ref.state_dict())
        for m in (ref, model):
            for name, p in m.named_parameters():
                if ".visual." in name:
                    p.requires_grad_(True)
    return ref, model


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def vlm_step(model, ref, batch: dict) -> dict:
    """{"loss", "logits", parameter name: relative error} of one step (module docstring); SP initialised."""
    from hf_upipe.distributed import get_sequence_parallel_state, without_sequence_parallel
    from hf_upipe.vlm import shard_multimodal_batch

    state = get_sequence_parallel_state()
    with without_sequence_parallel():
        want = ref(**batch)
    want.loss.backward()
    shard = shard_multimodal_batch(model, batch, state.sp_rank, state.sp_size)
    got = model(
        inputs_embeds=shard["inputs_embeds"],
        position_ids=shard["position_ids"],
        attention_mask=shard.get("attention_mask"),
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=shard["num_label_tokens"],
    )
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss, group=state.sp_group)
    s, S = shard["inputs_embeds"].shape[1], batch["input_ids"].shape[1]
    mine = slice(
        state.sp_rank * s, min((state.sp_rank + 1) * s, S)
    )  # the SP padding has no reference
    n = mine.stop - mine.start
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))[:, mine, None].bool()
    logits = got.logits[:, :n].masked_fill(~real, 0)  # [B, n, V]: real tokens only
    errors = {
        "loss": _rel(loss, want.loss),
        "logits": _rel(logits, want.logits[:, mine].masked_fill(~real, 0)),
    }
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = grads[name].grad
        if p.requires_grad and (
            p.grad is not None or want is not None
        ):  # (no images: no vision gradient)
            g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
            dist.all_reduce(g, group=state.sp_group)
            errors[name] = _rel(g, torch.zeros_like(g) if want is None else want)
    return errors
