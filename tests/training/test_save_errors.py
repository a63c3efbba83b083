"""A checkpoint save that fails to write is explained and leaves the previous checkpoint intact
(`hf_upipe.training.save_errors`). These faults are imitated (their names say so): the writers raise the errors
a full disk makes them raise, on a disk with space left. The real full disk, a tmpfs under torchrun:
tests/training/test_full_disk.py.

One process: a tiny UPipeTrainer trains a step and saves `checkpoint-1`, counting the files the save writes (every
open for writing, safetensors' writer, the manifest's file). Then, for each N, the save of step 2 fails at its Nth
file (ENOSPC from `open`, safetensors' own error from its writer): the error names the path, the bytes needed and
the free space; the run folder holds `checkpoint-1` only (no staging folder, no half `checkpoint-2`), which still
verifies against its manifest; finally a save succeeds and a new trainer resumes from `checkpoint-1`.

Two ranks (`tests.training._fault_runs` "enospc", started as plain processes by `test_faults._launch`): rank 0's
write of `checkpoint-2` fails with ENOSPC. Rank 0 ends with the explained error; rank 1 exits within the bounded
peer wait with one line naming rank 0's failure and `checkpoint-1` (and no traceback), both when rank 0 ends
through Python (rank 1's watch sees the posted failure) and when it exits at once (rank 1's save barrier breaks:
`peers.named_peer`); `checkpoint-1` is the only checkpoint left and verifies.
"""

import builtins
import errno
import os

import pytest
import torch

RUN_ARGS = dict(
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
)


def _trainer(out, steps):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

    import hf_upipe
    from tests.integrations._models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    ids = torch.randint(1, 96, (8, 16), generator=torch.Generator().manual_seed(1)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=str(out), max_steps=steps, **RUN_ARGS)
    hf_upipe.reset_sequence_parallel()
    return hf_upipe.UPipeTrainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=default_data_collator,
        upipe_config=hf_upipe.UPipeConfig(sp_size=1),
    )


class _Writes:
    """Counts the file writes of a save under `root`; the `fail_at`-th raises as a full disk would."""

    def __init__(self, monkeypatch, root: str, fail_at: int | None = None):
        import transformers.modeling_utils as modeling_utils
        from safetensors import SafetensorError

        self.root, self.fail_at, self.count, self.failed = root, fail_at, 0, None
        real_open, real_fdopen = builtins.open, os.fdopen
        real_safe = modeling_utils.safe_save_file

        def write(path, safetensors=False, pickled=False):
            self.count += 1
            if self.count == self.fail_at:
                # an OSError carries its path; safetensors' and torch.save's errors do not: the message then
                # names the staging folder the save was writing
                named = not (pickled or safetensors or str(path).startswith("<"))
                self.failed = str(path) if named else os.path.join(root, ".staging-")
                if pickled:
                    # torch 2.13's words on a full tmpfs (no errno: here, with space left, a write error)
                    raise RuntimeError(
                        "[enforce fail at inline_container.cc:672] . unexpected pos 640 vs 534"
                    )
                if safetensors:
                    raise SafetensorError(
                        "Error while serializing: I/O error: No space left on device (os error 28)"
                    )
                if not named:  # a write to an open file descriptor: no file name
                    raise OSError(errno.ENOSPC, "No space left on device")
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

        def fake_open(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and any(m in mode for m in "wax"):
                if os.path.abspath(file).startswith(root):
                    write(file)
            return real_open(file, mode, *args, **kwargs)

        def fake_fdopen(fd, mode="r", *args, **kwargs):
            if any(m in mode for m in "wax"):
                write(f"<file descriptor {fd}>")
            return real_fdopen(fd, mode, *args, **kwargs)

        def fake_safe(tensors, filename, *args, **kwargs):
            write(filename, safetensors=True)
            return real_safe(tensors, filename, *args, **kwargs)

        real_save = torch.save

        def fake_save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and os.path.abspath(f).startswith(root):
                write(f, pickled=True)
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", fake_save)
        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(os, "fdopen", fake_fdopen)
        monkeypatch.setattr(modeling_utils, "safe_save_file", fake_safe)


@pytest.mark.slow
def test_an_imitated_failed_write_at_each_file_is_explained_and_keeps_the_last_checkpoint(tmp_path):
    from hf_upipe.training.checkpoint import verify_checkpoint
    from hf_upipe.training.save_errors import CheckpointSaveError

    out = str(tmp_path / "run")
    trainer = _trainer(out, steps=1)
    trainer.train()
    with pytest.MonkeyPatch.context() as mp:
        counter = _Writes(mp, out)
        trainer._save_checkpoint(trainer.model, None)
    files = counter.count
    assert files >= 6, (
        files
    )  # weights, config, generation config, optimizer, scheduler, state, rng, args, manifest
    first = os.path.join(out, "checkpoint-1")
    size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
    trainer.state.global_step = 2
    for n in range(1, files + 1):
        with pytest.MonkeyPatch.context() as mp:
            fault = _Writes(mp, out, fail_at=n)
            with pytest.raises(CheckpointSaveError) as caught:
                trainer._save_checkpoint(trainer.model, None)
        message = str(caught.value)
        assert f"Saving a checkpoint failed writing {fault.failed}" in message, (n, message)
        assert (
            f"The checkpoint needs about {size / 2**30:.3f} GiB ({size} bytes, the size of {first})"
            in (message)
        )
        assert (
            "; free on that disk: " in message and f"{first} is intact: resume from it" in message
        )
        assert sorted(os.listdir(out)) == ["checkpoint-1"], (n, os.listdir(out))
        verify_checkpoint(first)
        if n == 1:
            print(message)
    trainer._save_checkpoint(trainer.model, None)  # with space again, the run saves
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-2"]
    verify_checkpoint(os.path.join(out, "checkpoint-2"))
    resumed = _trainer(out, steps=2)
    resumed.train(resume_from_checkpoint=first)
    assert resumed.state.global_step == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["enospc", "enospc_exit"])
def test_an_imitated_full_disk_on_rank_0_of_two_is_explained_there_and_named_by_rank_1(
    tmp_path, mode
):
    from hf_upipe.training.checkpoint import verify_checkpoint
    from tests.training.test_faults import PEER_TIMEOUT, _launch

    (code0, stderr0, _), (code1, stderr1, seconds) = _launch(mode, 2, 0, tmp_path)[0]
    first = tmp_path / "checkpoint-1"
    assert code0 == 1, (code0, stderr0[-3000:])
    explained = [line for line in stderr0.splitlines() if "CheckpointSaveError" in line]
    assert len(explained) == 1 and "Saving a checkpoint failed writing " in explained[0], stderr0[
        -3000:
    ]
    assert "No space left on device" in explained[0] and "; free on that disk: " in explained[0]
    assert f"{first} is intact: resume from it" in explained[0], explained[0]
    lines = [line for line in stderr1.splitlines() if line.startswith("error (rank")]
    assert code1 == 1 and len(lines) == 1 and "Traceback" not in stderr1, (code1, stderr1[-3000:])
    assert lines[0].startswith(
        "error (rank 1): rank 0 failed: CheckpointSaveError: [Errno 28] Saving a checkpoint failed writing "
    ), lines[0]
    assert lines[0].endswith(f"; resume from {first}"), lines[0]
    assert seconds is not None and seconds < PEER_TIMEOUT + 5, seconds
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["checkpoint-1"]
    verify_checkpoint(str(first))
    print(mode, explained[0], "\n", lines[0], f"({seconds:.1f} s)")
