"""The planner on the registry's geometries beyond Llama: sliding windows, MoE experts, multimodal models planned
for text, other layer layouts (GPT-2's `h`, OPT's `decoder.layers`), gated-DeltaNet hybrids, chunked attention and
multi-head latent attention. Each plans (its parameters counted in full: every expert), or is refused with the
reason and what to do (`benchmarks/planner_reach.py` runs every verified type)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_upipe.models.presets import runnable_config
from hf_upipe.models.verification import installed_release
from hf_upipe.planning.planner import plan

pytestmark = pytest.mark.slow

# one of each kind: a window (Mistral), experts in GraniteMoE's own layout, a multimodal model (Mllama), GPT-2's
# layout, a hybrid (Qwen3-Next), chunked attention (Llama 4); the benchmark runs every verified type
PLANNED = ["mistral", "granitemoe", "mllama", "gpt2", "qwen3_next", "llama4_text"]
REFUSED = {
    "ctrl": "does not support activation checkpointing",
    "hrm_text": "has no list of its 3 decoder layers",
}
# LongCat-Flash's router reads values (aten.nonzero) up to transformers 5.24; from 5.25 on it routes without them
if installed_release() in ("5.23", "5.24"):
    REFUSED["longcat_flash"] = "needs values (aten.nonzero.default"
else:
    PLANNED.append("longcat_flash")


@pytest.mark.parametrize("model_type", PLANNED)
def test_the_planner_plans_every_kind_of_geometry(model_type):
    _, config = runnable_config(model_type)
    result = plan(config, gpus=8, seq_len=16384)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    # fp32 master weights sharded over 8 ranks: every parameter, experts and vision towers included
    assert result.by_category["parameters"] >= 4 * parameters / 8 * 0.99, (
        result.by_category,
        parameters,
    )
    assert result.fits and result.tensor_peak > result.by_category["parameters"]


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_what_the_planner_cannot_simulate_is_refused_with_the_reason(model_type):
    _, config = runnable_config(model_type)
    with pytest.raises(ValueError, match=REFUSED[model_type].replace("(", r"\(")):
        plan(config, gpus=8, seq_len=16384)
