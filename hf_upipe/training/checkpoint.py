"""Checkpoint manifests: the size and SHA-256 of every file, written before a checkpoint is published, checked
before a run resumes from it.

Entry points:
- `write_manifest(folder, *, group=None)`: call on every rank once every rank has written its files into
  `folder`; hashes them (the files split over the ranks of `group`), rank 0 writes `upipe_manifest.json`
  atomically, and it returns on every rank once the manifest is on disk.
- `verify_checkpoint(folder, *, group=None)`: call on every rank before resuming; checks that every file of the
  manifest exists with its size and hash (the work split over the ranks) and raises the same `CheckpointError`,
  naming the files, on every rank otherwise. A folder without a manifest is refused too: it was not written by
  hf_upipe, or its save never finished.
- `MANIFEST`: the manifest's file name; `CheckpointError`: a `ValueError`.

`UPipeTrainer` and the examples write a checkpoint into a staging folder, write its manifest, then rename it, so
`checkpoint-N` either is complete and verifiable or does not exist; `resume_from_checkpoint` verifies it first
(`UPipeConfig(verify_checkpoints=False)` / `UPIPE_VERIFY_CHECKPOINTS=0` skips the check). The manifest is an extra
JSON file: transformers, PEFT and accelerate load the checkpoint as if it were not there.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch.distributed as dist

__all__ = ["CheckpointError", "MANIFEST", "verify_checkpoint", "write_manifest"]

MANIFEST = "upipe_manifest.json"
_FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupted, or has no manifest."""


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _gather(obj, group) -> list:
    rank, size = _world(group)
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """Every file under `folder` (relative paths, sorted), the manifest and its temporary copies excluded."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if not (rel == MANIFEST or name.startswith(f".{MANIFEST}.")):
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str, *, group=None) -> dict:
    """Hash every file of `folder` and write its manifest (see the module docstring). Returns the manifest."""
    rank, size = _world(group)
    names = _files(
        folder
    )  # every rank lists the same files: they were all written before this call
    mine = {
        n: {
            "size": os.path.getsize(os.path.join(folder, n)),
            "sha256": _sha256(os.path.join(folder, n)),
        }
        for n in names[rank::size]
    }
    entries = {}
    for part in _gather(mine, group):
        entries.update(part)
    manifest = {"format": _FORMAT, "files": dict(sorted(entries.items()))}
    if rank == 0:
        fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, MANIFEST))
    if size > 1:
        dist.barrier(group=group)
    return manifest


def _read_manifest(folder: str) -> tuple[dict | None, str | None]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        return None, f"{folder} is not a folder"
    if not os.path.exists(path):
        return None, (
            f"{folder} has no {MANIFEST}: it was not written by hf_upipe, or its save did not finish, so "
            "it cannot be verified. Resume from a checkpoint hf_upipe wrote, or set "
            "UPipeConfig(verify_checkpoints=False) / UPIPE_VERIFY_CHECKPOINTS=0 to resume from it unchecked"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != _FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        return None, f"{path} is unreadable or malformed (the checkpoint is corrupted)"
    return manifest, None


def verify_checkpoint(folder: str, *, group=None) -> dict:
    """Check `folder` against its manifest on every rank (module docstring). Returns the manifest.

    Raises:
        CheckpointError: on every rank, naming the missing, resized or changed files (or the missing manifest).
    """
    rank, size = _world(group)
    manifest, error = _read_manifest(folder)
    problems = []
    if manifest is not None:
        for name in sorted(manifest["files"])[rank::size]:
            want, path = manifest["files"][name], os.path.join(folder, name)
            if not os.path.isfile(path):
                problems.append(f"{name} is missing")
            elif os.path.getsize(path) != want["size"]:
                problems.append(f"{name} has {os.path.getsize(path)} bytes, not {want['size']}")
            elif _sha256(path) != want["sha256"]:
                problems.append(f"{name} does not match its SHA-256 (changed or corrupted)")
    every = _gather((error, problems), group)
    errors = sorted({e for e, _ in every if e})
    found = sorted(p for _, ps in every for p in ps)
    if errors:
        raise CheckpointError(f"Cannot resume from {folder}: {errors[0]}.")
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointError(
            f"Cannot resume from {folder}: the checkpoint is incomplete or corrupted ({shown}). "
            "Resume from an earlier checkpoint."
        )
    return manifest
