"""hf_upipe: UPipe (headwise-chunked Ulysses) sequence parallelism for Hugging Face causal language models.

Main entry points:
- `init_sequence_parallel(sp_size=None, *, heads_per_chunk=1, group=None, kernel="auto")`: build the
  sequence-parallel groups after torch.distributed is up; the defaults of `attn_implementation="upipe"`.
- `attn_implementation="upipe"` in `from_pretrained` / `from_config`: registered with transformers on import.
- `prepare_model(model)`: install the fused UPipe attention block (projections inside the head-chunk loop, LoRA
  included) on Llama, Mistral, Qwen2 and Qwen3 attention modules; a plain or a PEFT model.
- `upipe_attention(q, k, v, *, group, heads_per_chunk)`: the op itself, on explicit tensors and process group.
- `MemoryTracker`: exact tensor-memory accounting (real or fake tensors), as used by the benchmarks.
"""

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
    "get_sequence_parallel_state",
    "init_sequence_parallel",
    "prepare_model",
    "reset_sequence_parallel",
    "upipe_attention",
    "valid_heads_per_chunk",
    "valid_sp_sizes",
]

_register()
