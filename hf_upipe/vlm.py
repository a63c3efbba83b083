"""Vision-language models under sequence parallelism: merge the vision features whole, then shard the sequence.

Entry points:
- `shard_multimodal_batch(model, batch, sp_rank, sp_size, *, pad_token_id=0, ignore_index=-100)`: from a full
  collated multimodal batch (`input_ids`, `pixel_values` / `pixel_values_videos` with `image_grid_thw` /
  `video_grid_thw` (and Qwen2.5-VL's `second_per_grid_ts`), `mm_token_type_ids`, `labels` or `shift_labels`,
  optional right-padded `attention_mask`),
  identical on every rank of an SP group, this rank's shard of the language model's inputs: `inputs_embeds`
  (the text embeddings with the image and video features scattered in, computed on the WHOLE sequence),
  `position_ids` [4, B, s] (the global text positions, then the three M-RoPE planes computed on the whole
  sequence), `shift_labels`, `num_label_tokens` and the shard of `attention_mask`. Call the prepared VLM with
  `model(inputs_embeds=..., position_ids=..., labels=shard["shift_labels"], shift_labels=...,
  num_items_in_batch=shard["num_label_tokens"])`.
- `vlm_refusal(model)` / `vlm_type_refusal(model_type)`: why a model (type) cannot be sharded this way, or None
  (`VISION_TYPES`: the verified types; the support gate names the reason for other vision-language types).

The vision tower runs on every rank of the SP group on the whole images (no sequence parallelism and no "upipe"
attention inside it: `prepare_model` keeps its own attention implementation). Its gradient is exact without any
extra collective: each rank's loss depends only on its shard of `inputs_embeds`, so autograd takes each vision
parameter's gradient from that shard's image tokens alone; summed over the SP group (as every parameter's gradient
is, by the data-parallel reduction over the SP ranks) it is the whole sequence's gradient, counted once.

Not handled (refused): packed rows (several documents per row), ring attention, multimodal types other than
`VISION_TYPES` (Qwen3-VL's deepstack adds visual features inside the first decoder layers at the image tokens'
positions, which this sharding does not carry).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_upipe.data import shard_batch
from hf_upipe.distributed import get_sequence_parallel_state
from hf_upipe.models.architectures import REFUSED_VISION_TYPES, VISION, vlm_type_refusal
from hf_upipe.models.peft import base_model

__all__ = [
    "REFUSED_VISION_TYPES",
    "VISION_TYPES",
    "shard_multimodal_batch",
    "vlm_refusal",
    "vlm_type_refusal",
]

# model types whose language model runs exactly under SP on inputs_embeds + [4, B, s] positions (the registry's,
# tested at SP 2 against one process: tests/integrations/test_vlm.py)
VISION_TYPES = VISION


def _inner(model: nn.Module) -> nn.Module | None:
    """The VLM's model holding `visual` and `language_model` (Qwen2VLModel), or None."""
    base = base_model(model)
    inner = getattr(base, "model", base)
    ok = all(hasattr(inner, a) for a in ("visual", "language_model", "get_rope_index"))
    return inner if ok else None


def vlm_refusal(model: nn.Module) -> str | None:
    """Why `shard_multimodal_batch` cannot shard this model's inputs exactly, or None."""
    model_type = getattr(getattr(base_model(model), "config", None), "model_type", None)
    if (why := vlm_type_refusal(model_type)) is not None:
        return why
    if _inner(model) is None:
        return f"{type(base_model(model)).__name__} has no model.visual / model.language_model / get_rope_index"
    return None


def _merged(inner: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, S, D] inputs_embeds with the vision features scattered in, [3, B, S] M-RoPE positions): the VLM's own
    embedding, vision tower and rope index, on the whole sequence."""
    ids = batch["input_ids"]  # [B, S]
    visual = batch.get("image_grid_thw") is not None or batch.get("video_grid_thw") is not None
    if visual and batch.get("mm_token_type_ids") is None:
        raise ValueError(
            "shard_multimodal_batch needs batch['mm_token_type_ids'] (0 text, 1 image, 2 video; the processor "
            "returns it) to compute the M-RoPE positions of a batch with images or videos."
        )
    embeds = inner.get_input_embeddings()(ids)  # [B, S, D]
    for pixels, grid, which in (
        ("pixel_values", "image_grid_thw", "image"),
        ("pixel_values_videos", "video_grid_thw", "video"),
    ):
        if batch.get(pixels) is None:
            continue
        get = inner.get_image_features if which == "image" else inner.get_video_features
        features = get(batch[pixels], batch[grid], return_dict=True).pooler_output
        features = torch.cat(features, dim=0).to(embeds.device, embeds.dtype)  # [N_tokens, D]
        masks = inner.get_placeholder_mask(
            ids, inputs_embeds=embeds, **{f"{which}_features": features}
        )
        embeds = embeds.masked_scatter(masks[0 if which == "image" else 1], features)
    if not visual:  # text only: the positions the model gives itself
        positions = torch.arange(ids.shape[1], device=ids.device)  # [S]
        return embeds, positions.expand(3, *ids.shape)  # [3, B, S]
    extra = (
        {"second_per_grid_ts": batch["second_per_grid_ts"]} if "second_per_grid_ts" in batch else {}
    )
    positions, _ = inner.get_rope_index(
        ids,
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=batch.get("attention_mask"),
        **extra,
    )  # [3, B, S]
    return embeds, positions.to(ids.device)


def _pad_tail(x: torch.Tensor, pad: int, dim: int, step: bool) -> torch.Tensor:
    """`x` padded by `pad` along `dim`: zeros, or (`step`) positions continuing the last one by 1, 2, ..."""
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    if not step:
        return torch.cat([x, x.new_zeros(shape)], dim=dim)
    count = torch.arange(1, pad + 1, device=x.device, dtype=x.dtype)  # [pad]
    count = count.view([pad if d == dim else 1 for d in range(x.dim())])  # broadcast along `dim`
    return torch.cat([x, x.narrow(dim, x.shape[dim] - 1, 1) + count], dim=dim)


def shard_multimodal_batch(
    model: nn.Module,
    batch: dict,
    sp_rank: int,
    sp_size: int,
    *,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> dict:
    """This rank's shard of a multimodal batch, merged whole (see the module docstring).

    Args:
        model: a Qwen2-VL-style model (plain or PEFT), prepared with `hf_upipe.prepare_model` under SP.
        batch: the full collated batch, the same on every rank of the SP group.
        sp_rank, sp_size: this rank's place in its SP group (`state.sp_rank`, `state.sp_size`).

    Returns:
        dict with `inputs_embeds` [B, s, D] (differentiable: the vision tower's and the embedding's gradients flow
        from it), `position_ids` [4, B, s], `shift_labels` [B, s] and `num_label_tokens` (when the batch has labels),
        and `attention_mask` [B, s] when the batch has one.

    Raises:
        NotImplementedError: a model `vlm_refusal` refuses, packed rows, or ring attention (before any collective).
        ValueError: what `hf_upipe.shard_batch` refuses (bad shapes, left padding, ...).
    """
    why = vlm_refusal(model)
    if why is not None:
        raise NotImplementedError(
            f"shard_multimodal_batch: {why}. Train this model without sequence parallelism, or on text only."
        )
    state = get_sequence_parallel_state()
    if state is not None and state.ring_size > 1:
        raise NotImplementedError(
            f"shard_multimodal_batch shards contiguously; ring attention (ring_size={state.ring_size}) is not "
            "implemented for vision-language models: use ring_size=1."
        )
    text = {
        k: batch[k] for k in ("input_ids", "attention_mask", "labels", "shift_labels") if k in batch
    }
    if batch.get("position_ids") is not None:
        raise NotImplementedError(
            "shard_multimodal_batch computes the M-RoPE position_ids on the whole sequence itself: do not pass "
            "position_ids (packed rows of several documents are not implemented for vision-language models)."
        )
    shard = shard_batch(
        text, sp_rank, sp_size, ring_size=1, pad_token_id=pad_token_id, ignore_index=ignore_index
    )
    B, S = batch["input_ids"].shape
    s = shard["position_ids"].shape[1]  # shard length (the sequence right-padded to s * sp_size)
    pad, take = s * sp_size - S, slice(sp_rank * s, (sp_rank + 1) * s)
    embeds, mrope = _merged(_inner(model), batch)  # [B, S, D], [3, B, S]
    out = {k: v for k, v in shard.items() if k not in ("input_ids", "position_ids")}
    out["inputs_embeds"] = _pad_tail(embeds, pad, 1, step=False)[:, take]  # [B, s, D]
    mrope = _pad_tail(mrope, pad, 2, step=True)[:, :, take]  # [3, B, s]
    text_positions = shard["position_ids"].to(mrope.dtype).expand(B, s)  # [B, s], global
    out["position_ids"] = torch.cat([text_positions[None], mrope], dim=0)  # [4, B, s]
    return out
