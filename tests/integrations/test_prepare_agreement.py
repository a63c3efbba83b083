"""`prepare_model` under SP: the ranks of an SP group must prepare the same model with the same settings.

A custom loop that passes other settings on one rank (or loads another model there) would pair different
collectives; `prepare_model` compares them in one bounded collective and raises the same error, naming each
difference with every rank's value, on every rank, leaving the model as it was.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_upipe
from tests._dist import run_distributed
from tests.integrations._models import tiny_config


def _worker(rank, world, case):
    hf_upipe.init_sequence_parallel(world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    config = None
    if case == "fused_backward" and rank == 1:
        config = hf_upipe.UPipeConfig(fused_backward="save")
    elif case == "tiled_mlp":
        config = hf_upipe.UPipeConfig(tiled_mlp=True, mlp_chunk_tokens=4 + 4 * rank)
    elif case == "model" and rank == 1:
        model.get_input_embeddings().weight.requires_grad_(False)
    elif case == "same":
        config = hf_upipe.UPipeConfig(fused_backward="save")
    try:
        hf_upipe.prepare_model(model, config)
        outcome = None
    except ValueError as err:
        outcome = str(err)
    finally:
        hf_upipe.reset_sequence_parallel()
    return outcome, model.config._attn_implementation


@pytest.mark.parametrize(
    "case,said",
    [
        (
            "fused_backward",
            [
                "fused_backward: fused_backward='recompute' (no UPipeConfig) on rank 0, "
                "UPipeConfig(fused_backward='save') on rank 1"
            ],
        ),
        (
            "tiled_mlp",
            [
                "mlp_chunk_tokens: UPipeConfig(mlp_chunk_tokens=4) on rank 0, UPipeConfig(mlp_chunk_tokens=8) "
                "on rank 1"
            ],
        ),
        ("model", ["model: LlamaForCausalLM with", "trainable) on rank 0, LlamaForCausalLM with"]),
        ("same", None),
    ],
)
def test_ranks_that_prepare_differently_are_refused_on_every_rank(case, said):
    for rank, (outcome, attention) in enumerate(run_distributed(_worker, 2, case)):
        if said is None:
            assert outcome is None and attention == "upipe", (rank, outcome)
            continue
        assert outcome is not None and "called prepare_model differently" in outcome, (
            rank,
            outcome,
        )
        assert all(part in outcome for part in said), (rank, outcome)
        assert attention == "sdpa", (rank, attention)  # nothing was installed
