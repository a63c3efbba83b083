"""Test order and threads for the two-worker run (README's `-n 2 --dist loadfile`).

- The files holding slow tests (multi-process equivalence runs, the examples, the architecture matrix) run first,
  each file's tests in their own order: the long files start early and the short ones fill the gaps, instead of one
  long file running alone at the end.
- Each worker's own torch uses one thread: two workers already fill the two cores, and two-thread kernels in both
  would only contend (the spawned ranks and the examples' processes run one thread each anyway).
- The adapters' verdicts by behaviour (`hf_upipe.models.verification`) are cached in a folder of this run's own, not the
  user's cache: every run checks afresh, and nothing is left behind.
"""

import os
import tempfile

# set at import, before any worker or spawned rank starts: they inherit it
os.environ.setdefault("HF_UPIPE_CACHE_DIR", tempfile.mkdtemp(prefix="hf_upipe_test_cache_"))


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(
        key=lambda item: item.path not in slow_files
    )  # stable: files and tests keep their order otherwise
