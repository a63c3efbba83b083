"""A checkpoint save that fails on a full disk (or any other write error), explained.

Entry points:
- `explained_save_errors(run_dir, *, should_save=True)`: a context manager around one staged checkpoint save
  (`hf_upipe.training.trainer.save_staged`, the examples' `save_checkpoint`). A write error inside it becomes a
  `CheckpointSaveError` naming the file it failed on, the bytes the checkpoint needs (the size of the last complete
  checkpoint and of the same file in it, or at least what was written before the failure), the free space there,
  and which complete checkpoint stays intact to resume from. The staging folders of the failed save are removed
  (by the rank that failed, whichever it is), so no half checkpoint is left; the other ranks are told
  (`hf_upipe.training.peers`), and exit naming this one wherever they wait (a SIGTERM from the launcher during
  the save is held until they have). A rank whose save's collective fails because another rank went away (that
  rank's own save failed) raises `peers.named_peer`'s line naming it instead.
- `out_of_space(err, path)`: whether `err`, raised writing `path`, means the disk is full (see below).
- `CheckpointSaveError`: an `OSError` (its `errno` that of the cause, ENOSPC for a full disk seen by free space).

How a full disk is recognised, by its cause rather than by a message's words: the OS error number (an `OSError`'s
`errno` ENOSPC, EDQUOT or EFBIG; safetensors' writer reports the same number as `(os error 28)`), or, for a writer
that carries none (torch.save's `RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...`,
which is what torch 2.x raises when a write comes up short), the free space left on that filesystem at the
failure: less than `FULL_BELOW` bytes, or less than the rest of the file still to write (the size of the same
file in the previous checkpoint), is a full disk. Any other `OSError`, or torch's writer failing with space left,
is explained as a write error (the cause quoted).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil

__all__ = ["FULL_BELOW", "CheckpointSaveError", "explained_save_errors", "out_of_space"]

_GIB = 2**30
FULL_BELOW = 1 << 20  # free bytes under which a filesystem whose write just failed is full
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class CheckpointSaveError(OSError):
    """A checkpoint save that failed to write (module docstring). Under a launcher `hf_upipe.exits` prints it as
    one line, `error (rank N): CheckpointSaveError: ...`, and the rank exits with status 1 at once."""

    upipe_fault = True


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _os_errno(err: BaseException) -> int | None:
    """The OS error number behind `err` or its causes: an `OSError`'s errno, or the `(os error N)` that
    safetensors' Rust writer carries from the OS."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno:
            return e.errno
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found:
            return int(found.group(1))
    return None


def _writer_error(err: BaseException) -> bool:
    """An error of a file writer: an `OSError`, safetensors' error, torch's serializer (`inline_container`)."""
    return any(
        isinstance(e, OSError)
        or type(e).__name__ == "SafetensorError"
        or (
            isinstance(e, RuntimeError)
            and re.search(r"inline_container|PytorchStreamWriter|write", str(e))
        )
        for e in _chain(err)
    )


def _free(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def out_of_space(err: BaseException, path: str, rest: int = 0) -> bool:
    """Whether `err`, raised writing `path`, means the disk is full (module docstring); `rest`: the bytes of the
    file still to write, when known."""
    number = _os_errno(err)
    if number is not None:
        return number in _SPACE_ERRNOS
    free = _free(path)
    return _writer_error(err) and free is not None and free < max(FULL_BELOW, rest)


def _size(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def _staging(run_dir: str) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return [os.path.join(run_dir, d) for d in os.listdir(run_dir) if d.startswith(".staging-")]


def _newest_file(folders: list[str]) -> str | None:
    """The file written last under `folders` (the one a writer without a file name failed on), or None."""
    newest = None
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    when = os.stat(path).st_mtime_ns
                    if newest is None or when > newest[0]:
                        newest = (when, path)
    return newest[1] if newest else None


def _path_in_frames(err: BaseException, folders: list[str]) -> str | None:
    """The file the failed writer was writing, for a writer whose error names none (torch.save, safetensors):
    the innermost frame of the traceback holding a path under `folders` (torch.save's `f`, safetensors'
    `filename`), or None."""
    roots = tuple(os.path.abspath(f) + os.sep for f in folders)
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (str, os.PathLike)) and roots:
                path = os.path.abspath(os.fspath(value))
                if path.startswith(roots) and not os.path.isdir(path):
                    return path
    return None


def _gib(n: int) -> str:
    return f"{n / _GIB:.3f} GiB ({n} bytes)"


class _Failure:
    """What a failed save wrote, measured before its staging folders are removed."""

    def __init__(self, err: BaseException, run_dir: str):
        from hf_upipe.training.peers import last_checkpoint

        staging = _staging(run_dir)
        self.path = (
            getattr(err, "filename", None)
            or _path_in_frames(err, staging)
            or _newest_file(staging)
            or (staging or [run_dir])[0]
        )
        self.previous = last_checkpoint(run_dir)
        self.written = sum(_size(s) for s in staging)
        self.needed = _size(self.previous) if self.previous else None
        self.file_needed, self.file_written = self._file_sizes(staging)
        self.full = out_of_space(err, self.path, max(self.file_needed - self.file_written, 0))
        self.free_at_failure = _free(self.path)

    def _file_sizes(self, staging: list[str]) -> tuple[int, int]:
        """(the size of the failed file in the previous checkpoint, its size now), 0 when unknown."""
        written = 0
        with contextlib.suppress(OSError):
            written = os.path.getsize(self.path)
        for folder in staging:
            if self.previous and str(self.path).startswith(folder + os.sep):
                rel = os.path.relpath(self.path, folder).split(os.sep, 1)
                same = os.path.join(self.previous, rel[1]) if len(rel) == 2 else None
                if same and os.path.isfile(same):
                    return os.path.getsize(same), written
        return 0, written

    def message(self, err: BaseException, run_dir: str) -> str:
        cause = re.sub(r"\s+", " ", f"{type(err).__name__}: {err}")[:300]
        what = "the disk is full" if self.full else "a write error"
        if self.previous:
            needed = f"about {self.needed / _GIB:.3f} GiB ({self.needed} bytes, the size of {self.previous})"
            if self.file_needed:
                needed += f"; this file needs about {self.file_needed} bytes"
            kept = f"{self.previous} is intact: resume from it"
        else:
            needed = f"more than the {self.written} bytes written before the failure"
            kept = "no earlier checkpoint exists"
        free_now = _free(self.path if os.path.exists(self.path) else run_dir)
        free = "unknown" if free_now is None else _gib(free_now)
        at = (
            "" if self.free_at_failure is None else f", {self.free_at_failure} bytes at the failure"
        )
        fix = "Free space (a lower save_total_limit removes old checkpoints) or point output_dir to a larger disk."
        if self.full and self.needed and free_now is not None and self.needed > free_now:
            fix = f"Free at least {self.needed - free_now} more bytes" + fix[len("Free space") :]
        elif not self.full:
            fix = "Fix the cause above (permissions, a failing disk) or point output_dir elsewhere."
        return (
            f"{self.summary()} ({what}; {cause}). The checkpoint needs {needed}; free on that disk: {free} once "
            f"the half-written save was removed{at}. Nothing half-written was kept, {kept}. {fix}"
        )

    def summary(self) -> str:
        return f"Saving a checkpoint failed writing {self.path}"


def _remove(folder: str) -> None:
    """Remove a staging folder, emptying each file first: a file the failed writer still holds open keeps its
    space until it is closed, removed or not, and the free space said must be the one left."""
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                os.truncate(os.path.join(root, name), 0)
    shutil.rmtree(folder, ignore_errors=True)


def _explain(err: BaseException, run_dir: str) -> CheckpointSaveError | None:
    """The explained error (the staging folders removed), or None when `err` is no write error."""
    failure = _Failure(err, run_dir)
    if not (failure.full or _writer_error(err)):
        return None
    for folder in _staging(run_dir):
        _remove(folder)
    number = _os_errno(err) or (errno.ENOSPC if failure.full else 0)
    explained = CheckpointSaveError(*([number] if number else []), failure.message(err, run_dir))
    explained.posted = (  # the other ranks' line: short, the rank's own error says the rest
        f"CheckpointSaveError: {f'[Errno {number}] ' if number else ''}{failure.summary()} "
        f"({'the disk is full' if failure.full else 'a write error'}; its error says the bytes needed and free)"
    )
    return explained


@contextlib.contextmanager
def explained_save_errors(run_dir: str, *, should_save: bool = True):
    """See the module docstring (`should_save`: kept for callers; the rank that fails removes the staging)."""
    from hf_upipe.training import peers

    with peers.saving():
        try:
            yield
        except Exception as err:
            if isinstance(err, CheckpointSaveError):
                raise
            # another rank failed first (this error may be its echo: a file it removed): name that rank
            posted = peers.posted_by_another()
            if posted is not None:
                raise posted from err
            found = peers.named_peer(err)  # a barrier of the save failed: another rank stopped
            if found is not err:
                raise found from err
            explained = _explain(err, run_dir)
            if explained is None:
                raise
            peers.post_failure(explained.posted)
            raise explained from err
