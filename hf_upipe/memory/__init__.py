"""Memory features applied to a loaded model.

Entry points:
- `apply_tiled_mlp(model, chunk_tokens=None, *, norms=True)` / `remove_tiled_mlp(model)` / `tiled_mlp(...)`:
  MLPs and RMSNorms over sequence chunks, recomputed in backward (`hf_upipe.memory.tiled_mlp`).
- `offload_checkpoints(model, target, *, path=None, ...)`: per-step context manager that moves the checkpointed
  layer inputs to pinned host memory or to disk (`hf_upipe.memory.offload`).
"""

from hf_upipe.memory.offload import offload_checkpoints
from hf_upipe.memory.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp, tiled_mlp

__all__ = ["apply_tiled_mlp", "offload_checkpoints", "remove_tiled_mlp", "tiled_mlp"]
