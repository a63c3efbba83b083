"""The test suite's multi-process runs: `hf_upipe.testing.run_distributed` (the harness the self-test uses too),
with every rank forked from one forkserver that imported torch, transformers and the test helpers once.

`run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes joined by
a gloo process group and returns the per-rank return values; a rank that raises makes the call raise with that
rank's traceback, and collectives time out instead of hanging. Starting a Python that imports torch and
transformers costs 3-6 s per rank on 2 cores; the suite starts about 80 ranks.
"""

import multiprocessing

from hf_upipe import testing

_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "accelerate",
    "hf_upipe",
    "hf_upipe.integrations.transformers",
    "tests.integrations._models",
]
multiprocessing.set_forkserver_preload(_PRELOAD)

__all__ = ["run_distributed"]


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    return testing.run_distributed(
        fn, world_size, *args, timeout=timeout, start_method="forkserver"
    )
