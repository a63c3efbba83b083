"""hf_upipe: UPipe (headwise-chunked Ulysses) sequence parallelism for Hugging Face causal language models.

Main entry points:
- `init_sequence_parallel(sp_size=None, *, heads_per_chunk=1, group=None, kernel="auto")`: build the
  sequence-parallel groups after torch.distributed is up; the defaults of `attn_implementation="upipe"`.
- `attn_implementation="upipe"` in `from_pretrained` / `from_config`: registered with transformers on import.
- `prepare_model(model)`: install the fused UPipe attention block (projections inside the head-chunk loop, LoRA
  included) on Llama, Mistral, Qwen2 and Qwen3 attention modules; a plain or a PEFT model.
- `upipe_attention(q, k, v, *, group, heads_per_chunk)`: the op itself, on explicit tensors and process group.
- `UPipeTrainer` / `UPipeConfig`: transformers' Trainer with sequence parallelism, exact token-weighted loss and
  a tiled loss; the settings dataclass (`UPIPE_*` environment fallbacks). `UPipeTrainer` is imported lazily.
- `UPipePlugin`: the same settings plus `prepare(accelerator, model, optimizer, loader)` for custom loops under
  `accelerate launch` (FSDP2 or DDP); imported lazily.
- `shard_batch`, `ShardedDataLoader`, `sampler_kwargs`: per-rank sequence shards for custom training loops.
- `MemoryTracker`: exact tensor-memory accounting (real or fake tensors), as used by the benchmarks.
- `plan(model, *, gpus, gpu_memory, nodes=1, seq_len=None, max_context=False, ...)`: before launch, the per-GPU
  peak by category, whether it fits, the settings to use and the longest sequence that fits (`hf-upipe plan`);
  imported lazily. `UPipeConfig(auto=True, plan_seq_len=...)` lets the Trainer and the plugin apply it.
"""

from hf_upipe.config import UPipeConfig
from hf_upipe.data import ShardedDataLoader, sampler_kwargs, shard_batch
from hf_upipe.distributed import (
    SequenceParallelState,
    get_sequence_parallel_state,
    init_sequence_parallel,
    reset_sequence_parallel,
)
from hf_upipe.integrations.fused import prepare_model
from hf_upipe.integrations.transformers import register as _register
from hf_upipe.ops.head_layout import HeadLayout, valid_heads_per_chunk, valid_sp_sizes
from hf_upipe.ops.upipe_attention import upipe_attention
from hf_upipe.planning.tracker import MemoryTracker

__version__ = "0.1.0"

__all__ = [
    "HeadLayout",
    "MemoryTracker",
    "SequenceParallelState",
    "ShardedDataLoader",
    "UPipeConfig",
    "UPipePlugin",
    "UPipeTrainer",
    "get_sequence_parallel_state",
    "init_sequence_parallel",
    "plan",
    "prepare_model",
    "reset_sequence_parallel",
    "sampler_kwargs",
    "shard_batch",
    "upipe_attention",
    "valid_heads_per_chunk",
    "valid_sp_sizes",
]

_register()


def __getattr__(name):
    if name == "UPipeTrainer":  # lazy: transformers.Trainer pulls in accelerate and optimizers
        from hf_upipe.trainer import UPipeTrainer

        return UPipeTrainer
    if name == "plan":  # lazy: the planner builds models with transformers
        from hf_upipe.planning.planner import plan

        return plan
    if name == "UPipePlugin":
        from hf_upipe.integrations.accelerate import UPipePlugin

        return UPipePlugin
    raise AttributeError(f"module 'hf_upipe' has no attribute {name!r}")
