"""hf_upipe: UPipe (headwise-chunked Ulysses) sequence parallelism for Hugging Face causal language models.

Main entry points:
- `init_sequence_parallel(sp_size=None, *, heads_per_chunk=1, group=None, kernel="auto")`: build the
  sequence-parallel groups after torch.distributed is up; the defaults of `attn_implementation="upipe"`.
- `attn_implementation="upipe"` in `from_pretrained` / `from_config`: registered with transformers by
  `import hf_upipe` (as soon as transformers' modeling code loads: `hf_upipe.attention.registration`).
- `prepare_model(model, upipe_config=None)` / `unprepare_model(model)`: install (and remove, exactly) the fused
  UPipe attention block and the tiled MLP on the architectures of `hf_upipe.models.architectures`; a plain
  or a PEFT model.
- `upipe_attention(q, k, v, *, group, heads_per_chunk)`: the op itself, on explicit tensors and process group.
- `UPipeTrainer` / `UPipeConfig`: transformers' Trainer with sequence parallelism, exact token-weighted loss and
  a tiled loss; the settings dataclass (`UPIPE_*` environment fallbacks).
- `UPipePlugin`: the same settings plus `prepare(accelerator, model, optimizer, loader)` for custom loops under
  `accelerate launch` (FSDP2 or DDP), returning the run's `UPipeRuntime`.
- `shard_batch`, `ShardedDataLoader`, `sampler_kwargs`: per-rank sequence shards for custom training loops;
  `without_sequence_parallel()`: a context in which a model runs on whole sequences (under SP, a model called
  without `prepare_model` whose attention is not "upipe", or with token mixers, is refused).
- `generate(model, input_ids, max_new_tokens=..., do_sample=False, ...)`: generation under SP, each rank prefilling
  its shard of the prompt and keeping that shard's KV cache (`hf_upipe.generation`).
- `MemoryTracker`: exact tensor-memory accounting (real or fake tensors), as used by the benchmarks.
- `plan(model, *, gpus, gpu_memory, nodes=1, seq_len=None, max_context=False, ...)`: before launch, the per-GPU
  peak by category, whether it fits, the settings to use and the longest sequence that fits (`hf-upipe plan`).
  `UPipeConfig(auto=True, plan_seq_len=...)` lets the Trainer and the plugin apply it.

Under `accelerate launch` / `torchrun`, a setting error that nothing catches is one line from the first rank and
exit status 2 on every rank (`hf_upipe.exits`; `UPIPE_TRACEBACK=1` keeps the tracebacks).

Importing this package imports neither torch nor transformers (`hf-upipe --help` answers at once): it registers
"upipe" with transformers (when its modeling code loads), installs the console handler, the import hook that serves
the old module paths (`hf_upipe.trainer`, `hf_upipe.integrations.peft`, ...: their new modules, with a
DeprecationWarning until the release named in `hf_upipe._moved`, which holds their table) and, under a launcher, the
exception hook. Every name is imported on its first use; the two global hooks (`hf_upipe.adapters.hooks`) are
imported by `hf_upipe.distributed` before any sequence-parallel state is installed.
"""

import os
from importlib import import_module
from importlib.util import find_spec

from hf_upipe._moved import install as _serve_old_paths
from hf_upipe.attention.registration import register_with_transformers
from hf_upipe.console_log import install_console_handler
from hf_upipe.exits import report_setting_errors

__version__ = "0.1.0"

# name -> module that defines it, imported on first use (transformers, accelerate or the planner behind them)
_LAZY = {
    "HeadLayout": "hf_upipe.ops.head_layout",
    "SequenceParallelState": "hf_upipe.distributed",
    "ShardedDataLoader": "hf_upipe.data",
    "UPipeConfig": "hf_upipe.config",
    "get_sequence_parallel_state": "hf_upipe.distributed",
    "init_sequence_parallel": "hf_upipe.distributed",
    "reset_sequence_parallel": "hf_upipe.distributed",
    "sampler_kwargs": "hf_upipe.data",
    "shard_batch": "hf_upipe.data",
    "upipe_attention": "hf_upipe.ops.upipe_attention",
    "valid_heads_per_chunk": "hf_upipe.ops.head_layout",
    "valid_sp_sizes": "hf_upipe.ops.head_layout",
    "without_sequence_parallel": "hf_upipe.distributed",
    "MemoryTracker": "hf_upipe.planning.tracker",
    "UPipePlugin": "hf_upipe.training.plugin",
    "UPipeRuntime": "hf_upipe.training.runtime",
    "UPipeTrainer": "hf_upipe.training.trainer",
    "generate": "hf_upipe.generation",
    "plan": "hf_upipe.planning.planner",
    "prepare_model": "hf_upipe.prepare",
    "unprepare_model": "hf_upipe.prepare",
}

__all__ = sorted(_LAZY)

register_with_transformers()
# the old module paths (hf_upipe.trainer, hf_upipe.integrations.peft, ...) until their removal
_serve_old_paths()
install_console_handler()  # hf_upipe's INFO lines on the console, rank 0, unless logging is configured
if "TORCHELASTIC_RUN_ID" in os.environ:  # started by accelerate launch / torchrun
    report_setting_errors()  # an uncaught setting error: one line from the first rank, exit status 2


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # once imported, an attribute like any other
        return value
    if not name.startswith("_") and find_spec(f"hf_upipe.{name}") is not None:
        return import_module(
            f"hf_upipe.{name}"
        )  # a submodule not imported yet: `hf_upipe.ops`, ...
    raise AttributeError(f"module 'hf_upipe' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
