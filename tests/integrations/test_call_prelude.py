"""Both "upipe" attention paths, the registered function and the fused block, run one call prelude
(`hf_upipe.attention.call.sp_call`): a refusal added to its `REFUSALS` stops a call on either path, each layer's
call enters it once, and what the fused block does not implement is an argument of the call, not a second copy."""

import pytest
import torch

import hf_upipe
from hf_upipe.attention import call as prelude
from hf_upipe.attention.fused import count_fused
from hf_upipe.attention.state import local_sequence_parallel
from hf_upipe.distributed import without_sequence_parallel
from tests.integrations._models import build_pair, tiny_config

PATHS = {False: "attn_implementation='upipe'", True: "the fused UPipe block"}


@pytest.mark.parametrize("fused", [False, True], ids=["registered", "fused"])
def test_a_refusal_added_to_the_prelude_applies_to_both_paths(fused, monkeypatch):
    _, model = build_pair(tiny_config("llama"), "upipe", seed=1)
    if fused:
        hf_upipe.prepare_model(model)
        assert count_fused(model) == 2
    seen = []

    def refuse_odd_lengths(state, call, kwargs):
        seen.append((call.path, call.length, call.chunks))
        if call.length % 2:
            raise NotImplementedError(f"{call.length} tokens per rank: use an even length")

    monkeypatch.setattr(prelude, "REFUSALS", [*prelude.REFUSALS, refuse_odd_lengths])
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    with without_sequence_parallel(), local_sequence_parallel():
        model(input_ids=ids, position_ids=torch.arange(8)[None])
        assert seen == [(PATHS[fused], 8, not fused)] * 2  # one call per layer, through the prelude
        with pytest.raises(NotImplementedError, match="7 tokens per rank: use an even length"):
            model(input_ids=ids[:, :7], position_ids=torch.arange(7)[None])
    assert seen[-1] == (PATHS[fused], 7, not fused)


def test_what_the_fused_block_does_not_implement_is_refused_by_the_prelude():
    """A chunked-attention mask reaches the prelude from both paths; only the registered one implements it."""
    chunked = type("ChunkedMask", (), {"chunk": 4})()
    for chunks, refused in ((True, False), (False, True)):
        call = prelude.SpCall(
            torch.nn.Module(),
            chunked,
            1,
            8,
            torch.device("cpu"),
            torch.float32,
            True,
            chunks=chunks,
        )
        if refused:
            with pytest.raises(NotImplementedError, match=r"chunks of 4\) is not implemented by"):
                prelude._refuse_chunks(None, call, {})
        else:
            prelude._refuse_chunks(None, call, {})
