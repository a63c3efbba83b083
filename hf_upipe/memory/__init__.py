"""Memory features applied to a loaded model: tiled MLP (`tiled_mlp`) and offloaded checkpoint inputs (`offload`)."""

from hf_upipe.memory.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp, tiled_mlp

__all__ = ["apply_tiled_mlp", "remove_tiled_mlp", "tiled_mlp"]
