"""The memory of one hybrid mixer layer per rank, simulated: fake tensors on a fake process group.

Entry points:
- `mixer_module(config)`: the mixer module a hybrid config builds (transformers' own class), alone.
- `mixer_peak(config, seq_len, sp_size, rank, mode, batch, dtype)`: the exact tensor peak (bytes) of one forward +
  backward of that mixer on rank `rank`'s shard of `seq_len` tokens: installed (`mode` "parallel" or "sequential",
  `hf_upipe.adapters.mixers`) or the class's own forward on the shard alone (`mode="alone"`, wrong across
  shards: the memory of one rank's share). The input and the incoming gradient are not counted.

`tests/planning/test_mixer_memory.py` checks that this simulation equals a real 2-rank gloo run byte for byte.
The sequential mode can be simulated on rank 0 only (the receiving ranks read a shape header off the wire).
The kernels simulated are transformers' torch fallbacks, whose saved tensors differ from the CUDA kernels'
(flash-linear-attention, mamba-ssm); what hf_upipe adds on top of them is the same.
"""

from __future__ import annotations

import importlib

import torch

from hf_upipe.planning.simulate import fake_tensors, simulated_world
from hf_upipe.planning.tracker import MemoryTracker

__all__ = ["mixer_module", "mixer_peak"]


def mixer_module(config) -> torch.nn.Module:
    """The first mixer class hf_upipe runs across shards that the config's modeling file defines, built for layer 0
    in the default dtype (inside `fake_tensors(dtype)` for a simulation)."""
    from hf_upipe.adapters.mixers import HALO_MIXERS, MIXERS

    modeling = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )
    names = [n for n in (*MIXERS, *HALO_MIXERS) if hasattr(modeling, n)]
    if not names:
        raise ValueError(
            f"{config.model_type}: no mixer class hf_upipe runs across shards in its modeling file."
        )
    return getattr(modeling, names[0])(config, layer_idx=0)


def mixer_peak(
    config,
    seq_len: int,
    sp_size: int,
    rank: int,
    mode: str,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Peak bytes of one mixer forward + backward on `rank` of `sp_size` (module docstring)."""
    from hf_upipe.adapters.mixers import install_mixers
    from hf_upipe.distributed import init_sequence_parallel, reset_sequence_parallel

    if mode not in ("parallel", "sequential", "alone"):
        raise ValueError(f"mode={mode!r}: use 'parallel', 'sequential' or 'alone'.")
    if mode == "sequential" and rank > 0:
        raise ValueError("the sequential mode is simulated on rank 0 only (module docstring).")
    if seq_len % sp_size:
        raise ValueError(f"seq_len={seq_len} is not a multiple of sp_size={sp_size}.")
    s = seq_len // sp_size
    with simulated_world(sp_size, rank):
        init_sequence_parallel(sp_size)
        try:
            with fake_tensors(dtype):
                mixer = mixer_module(config)
                install_mixers(
                    mixer, state_passing="sequential" if mode == "sequential" else "parallel"
                )
                x = torch.randn(batch, s, config.hidden_size, requires_grad=True)  # [B, s, Dm]
                dy = torch.randn(batch, s, config.hidden_size)
                with MemoryTracker() as tracker:
                    out = type(mixer).forward(mixer, x) if mode == "alone" else mixer(x)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(dy)
                    del out
                return tracker.peak_bytes
        finally:
            reset_sequence_parallel()
