"""Chunked attention (Llama 4: each query sees the earlier keys of its own block of `attention_chunk_size` tokens)
under sequence parallelism, against one process: loss, the logits of every shard and every parameter gradient, on 2
gloo ranks. Chunks shorter than a shard and longer than a shard (but shorter than the sequence: a shard's local
indices cannot tell such a chunk from a window, the global probe must); transformers passes both as `local_size`.
"""

import copy

import torch

import hf_upipe
from hf_upipe.attention.mask import local_pattern
from hf_upipe.models.presets import tiny_config
from tests._dist import run_distributed
from tests.integrations._models import sharded_errors

S = 24


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _worker(rank, world, chunks):
    from transformers import AutoModelForCausalLM

    hf_upipe.init_sequence_parallel(world)
    out = {}
    for chunk in chunks:
        config = tiny_config("llama4_text")
        config.attention_chunk_size = chunk
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="upipe")
        model.load_state_dict(ref.state_dict())
        hf_upipe.prepare_model(model)
        ids = torch.randint(3, 96, (2, S), generator=torch.Generator().manual_seed(7))
        errors, _ = sharded_errors(ref, model, ids, rank, world)
        with hf_upipe.without_sequence_parallel():
            want = ref(input_ids=ids)
        # without its chunks (plain causal attention) the model would differ: the test can fail
        unchunked = copy.deepcopy(config)
        unchunked.attention_chunk_size = 10 * S
        torch.manual_seed(0)
        plain = AutoModelForCausalLM.from_config(unchunked, attn_implementation="sdpa")
        plain.load_state_dict(ref.state_dict())
        with hf_upipe.without_sequence_parallel():
            unchunked_logits = plain(input_ids=ids).logits
        out[chunk] = (
            max(errors.values()),
            max(errors, key=errors.get),
            _rel(unchunked_logits, want.logits),
        )
    hf_upipe.reset_sequence_parallel()
    return out


def test_chunked_attention_is_exact():
    for rank, out in enumerate(run_distributed(_worker, 2, [5, 16])):
        for chunk, (error, where, unchunked) in out.items():
            assert error < 2e-5, (rank, chunk, where, error)
            assert unchunked > 1e-2, (chunk, unchunked)


def test_window_and_chunk_masks_are_told_apart_at_global_indices():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_overlay,
    )

    window = and_masks(sliding_window_overlay(16), causal_mask_function)
    chunked = chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long))
    assert local_pattern(window, 1, 16, 48) == "window"
    assert local_pattern(chunked, 1, 16, 48) == "chunk"
    assert (
        local_pattern(causal_mask_function, 1, 16, 48) is None
    )  # neither: plain causal sees beyond 16 keys
