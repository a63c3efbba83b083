"""The test suite's multi-process runs: `hf_upipe.tools.testing.run_distributed` (the harness the self-test uses too),
with every rank forked from one forkserver that imported torch, transformers and the test helpers once.

`run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes joined by
a gloo process group and returns the per-rank return values; a rank that raises makes the call raise with that
rank's traceback, and collectives time out instead of hanging. Starting a Python that imports torch and
transformers costs 3-6 s per rank on 2 cores; the suite starts about 80 ranks. What the Trainer, TRL and DeepSpeed
runs import besides (datasets and pandas, the Trainer, deepspeed, TRL's trainers: 2-4 s more per rank) is preloaded
too: it halved the CPU time of tests/training/test_trainer_metrics.py. The server then freezes what it imported
(`tests._freeze`: `gc.freeze()`), so that a rank's garbage collections skip those objects: without it the larger
preload made every full collection slower and a rank that trains several runs gave the saving back.

`settle_collectives()`, called first in a rank that measures memory with the tracker, makes gloo's collectives
let go of their tensors before they return, so that real runs have the simulation's deterministic lifetimes.
"""

import multiprocessing
import os
import time

import torch
import torch.distributed as dist

from hf_upipe.tools import testing

_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "accelerate",
    "hf_upipe",
    # `import hf_upipe` imports its names on first use: what every rank uses, preloaded here
    "hf_upipe.distributed",
    "hf_upipe.adapters.hooks",
    "hf_upipe.data",
    "hf_upipe.prepare",
    "hf_upipe.attention.registered",
    "tests.integrations._models",
    # what the Trainer, TRL and DeepSpeed runs import in every rank (about 2-3 s per rank on 2 cores, paid once here)
    "datasets",
    "transformers.trainer",
    "deepspeed",
    "trl",
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.grpo_trainer",
    "hf_upipe.training.trainer",
    "tests._freeze",  # last: gc.freeze() of everything above
]
# DeepSpeed picks its accelerator once, when it is imported (in the server): the CPU one, as tests/training/
# test_deepspeed.py sets before its ranks start (the setting is the same in every worker once that file is collected)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
multiprocessing.set_forkserver_preload(_PRELOAD)

__all__ = ["run_distributed", "settle_collectives"]

# the collectives hf_upipe calls on tensors (point-to-point sends and receives are not queued on gloo's threads)
_COLLECTIVES = ("all_gather", "all_reduce", "all_to_all_single", "broadcast")


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    return testing.run_distributed(
        fn, world_size, *args, timeout=timeout, start_method="forkserver"
    )


class _Done:
    """A finished collective, for a caller that asked for an asynchronous one: the caller still holds its buffers
    until it waits, as in the simulation, whose collectives finish at once."""

    def wait(self, *args, **kwargs):
        return True


def _tensors(args) -> list[torch.Tensor]:
    """The tensors among a collective's arguments, one level of lists deep (all_gather's outputs)."""
    flat = []
    for a in args:
        flat.extend(a if isinstance(a, list | tuple) else [a])
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _settled(collective):
    def call(*args, **kwargs):
        asynchronous = kwargs.pop("async_op", False)
        tensors = _tensors([*args, *kwargs.values()])
        before = [t._use_count() for t in tensors]
        work = collective(*args, **kwargs)  # blocking
        deadline = time.monotonic() + 10
        while (
            any(t._use_count() > n for t, n in zip(tensors, before)) and time.monotonic() < deadline
        ):
            time.sleep(0)  # release the GIL until the worker thread has dropped its references
        return _Done() if asynchronous else work

    call.settled = True
    return call


def settle_collectives() -> None:
    """Make gloo's collectives return only once its worker thread has let go of their tensors (this process only).

    gloo's `wait()` returns as soon as a collective is done, but the worker thread that ran it drops its references
    to the tensors a moment later. A tensor the caller has already discarded (a send buffer, a `.contiguous()`
    copy, a gradient reduced in place) then dies on that thread, after later tensors were allocated, and on a
    loaded machine the tracked peak of a real run is sometimes one such tensor higher than the simulation's, which
    has no threads (seen: +0.25 MiB for an all-to-all send buffer in about 1 run of 10; +4 KiB for the gathered
    DeltaNet states under CI's two test workers). Waiting for the references gives the real run the lifetimes a
    blocking collective implies. A collective asked for asynchronously runs blocking here; its buffers still live
    until the caller waits.
    """
    for name in _COLLECTIVES:
        collective = getattr(dist, name)
        if not getattr(collective, "settled", False):
            setattr(dist, name, _settled(collective))
