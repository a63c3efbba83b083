"""Call arguments that would be silently wrong on a shard (`hf_upipe.adapters.call_checks`), refused for a model
loaded with `attn_implementation="upipe"` and called on shards without `prepare_model`, from its first call on:
`labels=` without `shift_labels=` (refused in the model's own loss, wrapped on the instance), `output_attentions=True`
(refused where transformers collects the weights), `use_cache=True` (from the second call: the guard installs the
pre-hook). With `shift_labels=` the shard losses add up to the one-process loss. A whole row's attention_mask passed
with a shard's input_ids is named as such, and so is `generate()` on shards (prepared or not), with the alternative.
Every case on both ranks of a gloo group; the loss and collector checks also in one process with an SP state
installed, and off without one.
"""

import copy

import pytest
import torch

from hf_upipe.adapters.call_checks import (
    ATTENTIONS_UNDER_SP,
    GENERATE_UNDER_SP,
    LABELS_UNDER_SP,
    refuse_collected_attentions,
)
from hf_upipe.distributed import SequenceParallelState, set_sequence_parallel_state
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config


@pytest.fixture
def sp2():
    previous = set_sequence_parallel_state(SequenceParallelState(None, 2, 0, None, 1, 0))
    try:
        yield
    finally:
        set_sequence_parallel_state(previous)


def test_the_models_loss_refuses_unshifted_labels_under_sp_only(sp2):
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    from hf_upipe.adapters.call_checks import check_loss_labels

    _, model = build_pair(tiny_config("llama"), "upipe", seed=2)
    check_loss_labels(model)
    logits, labels = torch.randn(1, 6, 10), torch.randint(0, 10, (1, 6))
    with pytest.raises(ValueError, match="labels= under sequence parallelism"):
        model.loss_function(logits, labels, 10)
    assert torch.isfinite(model.loss_function(logits, None, 10, shift_labels=labels))
    set_sequence_parallel_state(None)
    assert torch.isfinite(model.loss_function(logits, labels, 10))
    # transformers' own table is untouched: its Trainer compares entries by identity (the num_items_in_batch count)
    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss


def test_collected_attentions_are_refused(sp2):
    from transformers.utils.output_capturing import _active_collector

    refuse_collected_attentions()  # nothing collected: fine
    token = _active_collector.set({"attentions": []})
    try:
        with pytest.raises(NotImplementedError, match="output_attentions=True"):
            refuse_collected_attentions()
    finally:
        _active_collector.reset(token)


def _attempt(call, **kwargs) -> str:
    try:
        call(**kwargs)
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return "ran"


def _worker(rank, world):
    import hf_upipe
    from hf_upipe.data import shard_batch

    hf_upipe.init_sequence_parallel(heads_per_chunk=1)
    ref, model = build_pair(tiny_config("llama"), "upipe", seed=3)
    ids = torch.randint(3, 96, (1, 8 * world), generator=torch.Generator().manual_seed(1))
    shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    inputs = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    full_mask = torch.ones(1, 8 * world, dtype=torch.long)
    full_mask[:, -3:] = 0  # right padding of the whole row, passed whole with a shard's input_ids
    out = {
        "labels": _attempt(copy.deepcopy(model), **inputs, labels=shard["input_ids"]),
        "output_attentions": _attempt(copy.deepcopy(model), **inputs, output_attentions=True),
        "full mask": _attempt(copy.deepcopy(model), **inputs, attention_mask=full_mask),
    }
    for name, candidate in (
        ("generate", copy.deepcopy(model)),
        ("generate, prepared", hf_upipe.prepare_model(copy.deepcopy(model))),
    ):
        out[name] = _attempt(
            candidate.generate, input_ids=shard["input_ids"], max_new_tokens=2, do_sample=False
        )
    second = copy.deepcopy(model)
    out["first call"] = _attempt(second, **inputs)
    out["use_cache"] = _attempt(second, **inputs, use_cache=True)
    count = int((shard["shift_labels"] != -100).sum())
    total = torch.tensor(float(count))
    torch.distributed.all_reduce(total)
    loss = model(
        **inputs,
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=total,
    ).loss.detach()
    torch.distributed.all_reduce(loss)
    with hf_upipe.without_sequence_parallel():
        want = ref(input_ids=ids, labels=ids).loss.detach()
    hf_upipe.reset_sequence_parallel()
    return out, float(loss), float(want)


@pytest.mark.slow
def test_an_unprepared_upipe_model_gets_the_call_checks_on_every_rank():
    for out, loss, want in run_distributed(_worker, 2):
        assert out["labels"] == LABELS_UNDER_SP
        assert out["output_attentions"] == ATTENTIONS_UNDER_SP
        assert out["full mask"].startswith(
            "attention_mask has [16, 16] tokens per row on SP ranks [0, 1], but their "
            "input_ids hold a shard of 8 tokens: pass each rank its shard"
        ), out["full mask"]
        assert out["generate"] == out["generate, prepared"] == GENERATE_UNDER_SP, out
        assert out["first call"] == "ran"
        assert out["use_cache"].startswith("use_cache=True / a KV cache"), out["use_cache"]
        assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
