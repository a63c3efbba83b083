"""Checkpoint manifests in one process: written over every file, verified, and every kind of damage refused with
the file named (the multi-rank path, where ranks hash shares of the files, runs in tests/training/)."""

import json
import os

import pytest

from hf_upipe.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    verify_checkpoint,
    write_manifest,
)


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "checkpoint-2"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 40)
    (folder / "rng_state_1.pth").write_bytes(b"rng")
    (folder / "trainer_state.json").write_text("{}")
    write_manifest(str(folder))
    return folder


def test_manifest_lists_every_file_and_verifies(checkpoint):
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert sorted(files) == [
        "model/adapter_model.safetensors",
        "rng_state_1.pth",
        "trainer_state.json",
    ]
    assert files["rng_state_1.pth"]["size"] == 3 and len(files["rng_state_1.pth"]["sha256"]) == 64
    assert verify_checkpoint(str(checkpoint))["files"] == files
    assert not [
        n for n in os.listdir(checkpoint) if n.startswith(f".{MANIFEST}")
    ]  # no temporary left


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "model/adapter_model.safetensors does not match its SHA-256"),
        ("truncate", "model/adapter_model.safetensors has 10239 bytes, not 10240"),
        ("delete", "rng_state_1.pth is missing"),
        ("no manifest", "has no upipe_manifest.json"),
        ("bad manifest", "unreadable or malformed"),
    ],
)
def test_damage_is_refused_naming_the_file(checkpoint, damage, message):
    weights = checkpoint / "model" / "adapter_model.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[5000] ^= 0x10
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "delete":
        os.remove(checkpoint / "rng_state_1.pth")
    elif damage == "no manifest":
        os.remove(checkpoint / MANIFEST)
    else:
        (checkpoint / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(str(checkpoint))
