"""No host synchronisation in the hot path: a training step under SP reads tensor values on the host only in the
layout check, once per forward, whatever the depth.

On a GPU every read of a device value on the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`, `.numpy()`) waits
for the stream. On CPU the same reads are counted: `aten._local_scalar_dense` (what `.item()` and `bool()` dispatch
to) through a dispatch mode, and `Tensor.tolist`, `.cpu`, `.numpy` by wrapping them, each attributed to the
innermost hf_upipe line that caused it. The step (SP 2, gloo, after one warm-up step): a Llama model with activation
checkpointing, on the registered path and on the fused block in both backward modes, forward and backward through
the tiled loss. With 2 and with 3 decoder layers the reads must be the same: none per layer, and hf_upipe's own
only in `hf_upipe/attention/layout.py` and `layout_rows.py` (the once-per-forward layout check).
"""

import collections
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_upipe
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config

_PACKAGE = os.path.dirname(
    os.path.abspath(hf_upipe.__file__)
)  # wherever the clone is, whatever its folder name


def _where() -> str:
    """The code that read the value: the innermost frame outside torch and this file, as "hf_upipe/<file>:<function>"
    (relative to the package's own folder, not to the working directory or the clone's name) or
    "<package>/<file>:<function>" (transformers' own code, e.g. its packed-sequence probe of position_ids)."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if f"{os.sep}torch{os.sep}" in path or path.endswith("test_no_host_sync.py"):
            continue
        if path.startswith(_PACKAGE + os.sep):
            return f"hf_upipe/{os.path.relpath(path, _PACKAGE).replace(os.sep, '/')}:{frame.name}"
        if f"{os.sep}site-packages{os.sep}" in path:
            return f"{path.split(os.sep + 'site-packages' + os.sep)[-1]}:{frame.name}"
        return f"{path}:{frame.name}"
    return "unknown"


class _HostReads(TorchDispatchMode):
    """Counts host reads of tensor values, by where they come from."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count[_where()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *a, _original=original, **k):
                self.count[_where()] += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


MODES = (
    "registered",
    "recompute",
    "save",
    "overlap",
)  # the registered path; the fused block's modes


def _worker(rank, world, layers):
    from hf_upipe.training.loss import shard_loss_sum

    hf_upipe.init_sequence_parallel(world)
    out = {}
    for mode in MODES:
        _, model = build_pair(tiny_config("llama", layers=layers), "upipe", 0)
        if mode != "registered":
            hf_upipe.prepare_model(
                model,
                hf_upipe.UPipeConfig(
                    fused_backward="recompute" if mode == "recompute" else "save",
                    overlap_comm=mode == "overlap",
                ),
            )
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        model.train()
        for step in range(
            2
        ):  # the first step warms up (the tiled loss checks the model's logit scaling once)
            ids = torch.randint(3, 90, (2, 32), generator=torch.Generator().manual_seed(step))
            shard = hf_upipe.shard_batch({"input_ids": ids, "labels": ids}, rank, world)
            inputs = {
                k: v
                for k, v in shard.items()
                if k not in ("shift_labels", "num_label_tokens", "labels")
            }
            with _HostReads() as reads:
                loss_sum, _ = shard_loss_sum(model, inputs, shard["shift_labels"])
                loss_sum.backward()
        out[mode] = dict(reads.count)
    hf_upipe.reset_sequence_parallel()
    return out


@pytest.mark.slow
def test_a_step_reads_the_host_only_in_the_layout_check():
    shallow = run_distributed(_worker, 2, 2)
    deep = run_distributed(_worker, 2, 3)
    for rank in range(2):
        for mode in MODES:
            reads = deep[rank][mode]
            assert shallow[rank][mode] == reads, (
                mode,
                shallow[rank][mode],
                reads,
            )  # nothing per layer
            ours = {k: n for k, n in reads.items() if k.startswith("hf_upipe/")}
            # the layout check's reads, and the random stream's seed (hf_upipe/adapters/hooks.py: one
            # number from torch's CPU generator per training forward, a host value, never a device sync)
            assert ours and all(
                k.startswith(
                    (
                        "hf_upipe/attention/layout.py:",
                        "hf_upipe/adapters/hooks.py:",
                    )
                )
                for k in ours
            ), (mode, ours)
            assert sum(n for k, n in ours.items() if "hooks.py:_fork" in k) == 1, (mode, ours)
            assert sum(reads.values()) <= 8, (mode, reads)  # a handful per step, once per forward
