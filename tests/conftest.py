"""Test order and threads for the two-worker run (README's `-n 2 --dist loadfile`).

- The files holding slow tests (multi-process equivalence runs, the examples, the architecture matrix) run first,
  the longest of them (`LONGEST`) before the others, each file's tests in their own order: the long files start
  early and the short ones fill the gaps, instead of one long file running alone at the end; the files without
  slow tests follow, most tests first. xdist's own order (every file by test count, largest first, which put the
  long files of few tests last) is turned off for this.
- Each worker's own torch uses one thread: two workers already fill the two cores, and two-thread kernels in both
  would only contend (the spawned ranks and the examples' processes run one thread each anyway).
- The adapters' verdicts by behaviour (`hf_upipe.models.verification`) are cached in a folder of this run's own, not the
  user's cache: every run checks afresh, and nothing is left behind.
"""

import collections
import os
import tempfile

# set at import, before any worker or spawned rank starts: they inherit it
os.environ.setdefault("HF_UPIPE_CACHE_DIR", tempfile.mkdtemp(prefix="hf_upipe_test_cache_"))


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        # xdist (3.x) hands out `--dist loadfile`'s files by test count, largest first (its --loadscope-reorder,
        # on by default), which put the long files of few tests last, each running alone at the end: keep the
        # order below instead
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


# the longest files (minutes each on 2 cores, measured): handed out first, so that neither worker is left with one
# of them at the end (the dry run of benchmarks/gpu/max_context.py starts a process per probe)
LONGEST = ("test_examples.py", "test_docs_snippets.py", "planning/test_max_context_script.py")


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    count = collections.Counter(item.path for item in items)

    def rank(item) -> tuple[int, int]:
        """LONGEST in its order, then the other files of slow tests, then the rest, most tests first."""
        longest = [i for i, name in enumerate(LONGEST) if str(item.path).endswith(os.sep + name)]
        if longest:
            return (0, longest[0])
        return (1, 0) if item.path in slow_files else (2, -count[item.path])

    items.sort(key=rank)  # stable: files and tests keep their order otherwise
