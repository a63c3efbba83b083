"""The pieces of `hf_upipe.training.runtime` (its setup checks and exact evaluation included) and
`hf_upipe.training.loaders` that need no process group: settings named as the user wrote them, the settings
every rank must share, the eval-loss arithmetic, the zero-token guard of the loss, and the evaluation loaders'
records (no repeated examples, the examples of every round)."""

import math
from dataclasses import fields

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from hf_upipe import UPipeConfig
from hf_upipe.training.loaders import _ExactIterableShard, _RecordingBatchSampler, eval_rounds
from hf_upipe.training.runtime import NO_SP, EvalSums, UPipeRuntime, settings_error, shared_settings


def test_settings_are_named_as_the_user_wrote_them(monkeypatch):
    monkeypatch.delenv("UPIPE_HEADS_PER_CHUNK", raising=False)
    assert (
        UPipeConfig(heads_per_chunk="all").describe("heads_per_chunk")
        == "UPipeConfig(heads_per_chunk='all')"
    )
    assert UPipeConfig().describe("heads_per_chunk") == "heads_per_chunk=1 (the default)"
    monkeypatch.setenv("UPIPE_HEADS_PER_CHUNK", "ulysses")
    assert UPipeConfig().describe("heads_per_chunk") == "UPIPE_HEADS_PER_CHUNK=ulysses"
    chosen = UPipeConfig().with_auto(heads_per_chunk=2)
    assert chosen.describe("heads_per_chunk") == "heads_per_chunk=2 (chosen by auto=True)"
    assert chosen.heads_per_chunk == 2 and UPipeConfig().heads_per_chunk == "all"


def test_every_shared_setting_that_differs_between_ranks_is_named():
    """Every field but the offload folder and the planner's GPU memory must agree across ranks; a difference in
    any one is named with each rank's value as written (the 2-rank refusal: tests/training/test_plugin.py)."""
    base = shared_settings(UPipeConfig())
    assert {n for n, _, _ in base} == {f.name for f in fields(UPipeConfig)} - {
        "offload_path",
        "gpu_memory",
    }
    assert settings_error([base, base, base]) is None
    for i, (name, value, described) in enumerate(base):
        other = list(base)
        other[i] = (name, ("not", value), "as rank 1 wrote it")
        err = str(settings_error([base, tuple(other), base]))
        assert f"({name}: {described} on ranks 0, 2, as rank 1 wrote it on rank 1)" in err, err


def test_eval_sums_match_the_trainers_definitions():
    sums = EvalSums(loss=[12.0, 3.0, 0.0], tokens=[4.0, 3.0, 0.0], examples=[4, 4, 1])
    assert sums.token_mean() == pytest.approx(15.0 / 7.0)
    # the Trainer: each batch's token mean repeated once per example, non-finite entries dropped, then the mean
    assert sums.batch_mean(nan_filter=True) == pytest.approx((4 * 3.0 + 4 * 1.0) / 8)
    assert math.isnan(sums.batch_mean(nan_filter=False))
    assert math.isnan(EvalSums(loss=[0.0], tokens=[0.0], examples=[2]).batch_mean())


def test_a_shard_without_label_tokens_gives_zero_loss_and_zero_gradients():
    from tests.training._runs import _model

    model = _model(False, 1)
    runtime = UPipeRuntime(UPipeConfig(loss_chunk_tokens=5), NO_SP, world_size=1, device="cpu")
    ids = torch.randint(1, 90, (2, 11))
    shard = runtime.shard({"input_ids": ids, "labels": torch.full_like(ids, -100)})
    loss = runtime.loss(model, shard)  # used to divide by zero
    loss.backward()
    assert loss.item() == 0.0 and all(
        p.grad is None or not p.grad.any() for p in model.parameters()
    )
    labelled = runtime.shard({"input_ids": ids, "labels": ids})
    assert runtime.loss(model, labelled).item() == pytest.approx(
        model(input_ids=ids, labels=ids).loss.item(), rel=1e-5
    )


@pytest.mark.parametrize(
    "rows, batch, replicas, drop_last, rounds",
    [
        (9, 2, 2, False, [4, 4, 1]),
        (9, 2, 3, False, [6, 3]),
        (8, 2, 2, False, [4, 4]),
        (9, 2, 2, True, [4, 4]),
    ],
)
def test_evaluation_loaders_repeat_nothing_and_record_rounds(
    rows, batch, replicas, drop_last, rounds
):
    seen = []
    for replica in range(replicas):
        shard = BatchSamplerShard(
            BatchSampler(SequentialSampler(range(rows)), batch, drop_last), replicas, replica
        )
        shard.even_batches = False
        shard.batch_sampler = _RecordingBatchSampler(shard.batch_sampler)
        got = list(shard)
        seen += [i for b in got for i in b]
        loader = type("Loader", (), {"batch_sampler": shard})()
        assert eval_rounds(loader, replicas) == rounds
        assert len(got) <= len(rounds)
    expected = rows if not drop_last else sum(rounds)
    assert sorted(seen) == list(range(expected))  # every example once, none repeated


def test_streamed_evaluation_shards_repeat_nothing():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(9))

    seen = []
    for replica in range(2):
        shard = IterableDatasetShard(Stream(), batch_size=2, num_processes=2, process_index=replica)
        shard.__class__ = _ExactIterableShard
        seen += list(shard)
        assert shard.round_sizes == [4, 4, 1]
    assert sorted(seen) == list(range(9))
