"""Vision-language models under SP (`hf_upipe.vlm`): images merged whole, the sequence sharded after.

Tiny Qwen2-VL and Qwen2.5-VL models built from their configs (`hf_upipe.tools.vlm_check`), random weights, two images
(one across the shard boundary) and text, a length that does not divide by the SP size: at SP 2 on gloo ranks, the
loss, each shard's logits and every trainable gradient (summed over the group: the vision tower's, the embedding's,
LoRA's on the language model, or every parameter's in a full fine-tune) equal the one-process model's in fp32.
"""

import pytest
import torch

import hf_upipe
from hf_upipe.tools.vlm_check import tiny_batch, tiny_vlm, vlm_pair, vlm_step
from hf_upipe.vlm import shard_multimodal_batch
from tests._dist import run_distributed


def _errors(rank, world, model_type, mode, seed, padded, video=False, images=True):
    hf_upipe.init_sequence_parallel(world)
    ref, model = vlm_pair(model_type, mode == "lora", seed)
    hf_upipe.prepare_model(model)
    base = model.get_base_model() if mode == "lora" else model
    config = base.config
    implementations = (
        config.vision_config._attn_implementation,
        config.text_config._attn_implementation,
    )
    batch = tiny_batch(seed + 1, padded, video, images)
    refused = None
    try:  # the images passed to the forward itself would be scattered into the shard: refused
        model(input_ids=batch["input_ids"][:, :12], pixel_values=torch.zeros(16, 12))
    except NotImplementedError as err:
        refused = str(err)
    errors = vlm_step(model, ref, batch)
    hf_upipe.unprepare_model(model)
    restored = config.vision_config._attn_implementation, config.text_config._attn_implementation
    hf_upipe.reset_sequence_parallel()
    return errors, implementations, restored, refused


CASES = [
    ("qwen2_vl", "lora", 0, False, False, True),
    ("qwen2_vl", "full", 1, True, True, True),
    ("qwen2_5_vl", "lora", 2, True, True, True),
    ("qwen2_vl", "lora", 3, False, False, False),
]


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.slow] if i else []) for i, c in enumerate(CASES)],
    ids=[
        "qwen2_vl-lora",
        "qwen2_vl-full-padded-video",
        "qwen2_5_vl-lora-padded-video",
        "text-only",
    ],
)
def test_vlm_matches_single_process(case):
    for errors, implementations, restored, refused in run_distributed(_errors, 2, *case):
        assert "['pixel_values']" in refused and "shard_multimodal_batch" in refused
        assert implementations == ("sdpa", "upipe")  # the vision tower keeps its own attention
        assert restored == ("sdpa", "sdpa")
        names = " ".join(errors)
        assert (".visual." in names) == case[
            -1
        ]  # (a text-only batch gives the vision tower no gradient)
        assert "lora_B" in names if case[1] == "lora" else "embed_tokens" in names
        bad = {name: e for name, e in errors.items() if not e < 1e-5}
        assert not bad, f"{case}: {bad}"


def test_other_vision_language_types_are_refused_with_the_reason():
    from transformers import AutoConfig

    from hf_upipe.adapters.support import config_refusal
    from hf_upipe.vlm import vlm_type_refusal

    assert vlm_type_refusal("qwen2_vl") is None and vlm_type_refusal("qwen2_5_vl") is None
    assert "deepstack" in config_refusal(AutoConfig.for_model("qwen3_vl"))
    assert "not a vision-language type verified" in vlm_type_refusal("llava")
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        batch = tiny_batch(0, padded=False)
        del batch["mm_token_type_ids"]
        shard_multimodal_batch(tiny_vlm("qwen2_vl", 0), batch, 0, 1)
    with pytest.raises(NotImplementedError, match="deepstack"):
        shard_multimodal_batch(
            _Typed("qwen3_vl"), {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, 0, 1
        )


class _Typed(torch.nn.Module):
    """A module whose config names a model type (nothing else is read before the refusal)."""

    def __init__(self, model_type):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
