"""Deprecated package: the tiled MLP lives in `hf_upipe.adapters.tiled_mlp`, the checkpoint offload in
`hf_upipe.training.offload`; this package re-exports their entry points for one release."""

import warnings

from hf_upipe.adapters.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp, tiled_mlp
from hf_upipe.training.offload import offload_checkpoints

__all__ = ["apply_tiled_mlp", "offload_checkpoints", "remove_tiled_mlp", "tiled_mlp"]

warnings.warn(
    "hf_upipe.memory moved: hf_upipe.adapters.tiled_mlp and hf_upipe.training.offload; the old path "
    "re-exports them for one release.",
    DeprecationWarning,
    stacklevel=2,
)
