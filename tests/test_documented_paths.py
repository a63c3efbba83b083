"""Two documented paths that failed as written (found by tests/test_docs_snippets.py), checked in one process:
docs/trainer.md's `DataCollatorForLanguageModeling` hands `shard_batch` a `BatchEncoding`, and docs/plugin.md's
`Accelerator()` under torchrun on CPU sets up one process of two, which `UPipePlugin.prepare` now refuses (it
trained each rank on its own, unsynchronised)."""

import types

import pytest
import torch
from transformers import BatchEncoding

import hf_upipe


def test_shard_batch_takes_a_collators_batch_encoding():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    for rank in (0, 1):
        plain = hf_upipe.shard_batch({"input_ids": ids, "labels": labels}, rank, 2)
        encoded = hf_upipe.shard_batch(BatchEncoding({"input_ids": ids, "labels": labels}), rank, 2)
        assert plain.keys() == encoded.keys()
        for key in plain:
            assert torch.equal(torch.as_tensor(plain[key]), torch.as_tensor(encoded[key])), key


def test_the_plugin_refuses_an_accelerator_that_missed_the_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerator = types.SimpleNamespace(num_processes=1, distributed_type="DistributedType.NO")
    with pytest.raises(ValueError) as err:
        hf_upipe.UPipePlugin().prepare(accelerator, torch.nn.Linear(2, 2))
    assert str(err.value) == (
        "2 processes were launched but accelerate set up 1 (DistributedType.NO), so it would not synchronise "
        "them: on CPU create the Accelerator with cpu=True (accelerate launch with "
        "accelerate_configs/cpu_2proc.yaml does)."
    )
