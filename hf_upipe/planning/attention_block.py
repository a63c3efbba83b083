"""Per-rank memory of one attention block under sequence parallelism: UPipe vs DeepSpeed-Ulysses.

Entry points:
- `measure_attention_block(impl, *, hidden, heads, kv_heads, head_dim, seq_len, sp_size, dtype, group=None,
  heads_per_chunk=1, arch="llama")`: forward + backward of one transformers attention module (`LlamaAttention`, or
  the attention of another fused family, e.g. "olmo2", "phi3": q/k/v projections, norms, RoPE, attention, o_proj)
  on this rank's shard, under `MemoryTracker`. Runs on real tensors in a real process group
  (gloo) or on fake tensors under `simulated_world` + `fake_tensors`.
- `simulate_attention_block(impl, *, hidden, ..., seq_len, sp_size, dtype, heads_per_chunk=1)`: the same as
  rank 0 of a fake `sp_size`-rank world, in one process, at any sequence length.

`impl`: "upipe" (our registered `attn_implementation="upipe"`; heads_per_chunk=None is its Ulysses mode),
"fused" (the fused block installed by `hf_upipe.prepare_model`: projections inside the head-chunk loop; its
backward recomputes each stage's attention), "fused_save" (the same block keeping each stage's attention output
for the backward: `UPipeConfig(fused_backward="save")`), "fused_overlap" / "fused_save_overlap" (either with its
all-to-alls issued one stage ahead: `UPipeConfig(overlap_comm=True)`) or
"deepspeed" (DeepSpeed 0.19.8 `UlyssesSPAttentionHF` around transformers' sdpa, registered as "ds_ulysses").

Counted (the tracker's view): every tensor the block creates in forward and backward: activations, all-to-all
buffers, the block output, dx and the weight gradients. Not counted: what the neighbouring layers hand to the
block, i.e. its input x and the incoming gradient of its output, and the weights, cos/sin and position_ids (all
created before the tracker starts). The result also gives "peak_with_grad_in", the peak if the incoming gradient
were counted too. Unit u = s * hidden * bytes: one full-width local activation.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from hf_upipe import distributed as _sp
from hf_upipe.planning.model_step import (
    DS_ATTN_NAME,
    deepspeed_attention,
    deepspeed_comm,
    require_deepspeed,
)
from hf_upipe.planning.simulate import fake_tensors, simulated_world
from hf_upipe.planning.tracker import MemoryTracker

__all__ = [
    "BENCHMARK_ROWS",
    "IMPLEMENTATIONS",
    "build_attention_block",
    "measure_attention_block",
    "simulate_attention_block",
]

IMPLEMENTATIONS = (
    "upipe",
    "fused",
    "fused_save",
    "fused_overlap",
    "fused_save_overlap",
    "deepspeed",
)
# ours: registered attention function / fused block (`prepare_model`), its backward recomputing or saving attention
UPIPE_IMPLS = ("upipe", "fused", "fused_save", "fused_overlap", "fused_save_overlap")
# what the benchmarks compare side by side: (label, impl, heads_per_chunk)
BENCHMARK_ROWS = (
    ("DeepSpeed Ulysses", "deepspeed", None),
    ("ours Ulysses", "upipe", None),
    ("UPipe c=1", "upipe", 1),
    ("UPipe c=2", "upipe", 2),
    ("UPipe fused c=1", "fused", 1),
    ("UPipe fused save c=1", "fused_save", 1),
    ("UPipe fused save c=1 overlap", "fused_save_overlap", 1),
)


@contextmanager
def upipe_state(group: dist.ProcessGroup, heads_per_chunk: int | None) -> Iterator[None]:
    """Install (group, heads_per_chunk) as the "upipe" defaults unless they already are; restore on exit."""
    previous = _sp.get_sequence_parallel_state()
    if (
        previous is not None
        and previous.sp_group is group
        and previous.heads_per_chunk == heads_per_chunk
    ):
        yield
        return
    _sp.init_sequence_parallel(
        group=group,
        heads_per_chunk=heads_per_chunk,
        kernel=previous.kernel if previous is not None else "auto",
    )
    try:
        yield
    finally:
        _sp.set_sequence_parallel_state(previous)  # exactly what was installed before (None: reset)


def build_attention_block(
    impl, hidden, heads, kv_heads, head_dim, seq_len, dtype, group, arch="llama"
):
    """The attention module of `arch` (a model_type of the registry's fused families; LlamaAttention by default) with
    this geometry, built in `dtype` (also under fake mode), and its rotary embedding."""

    from transformers import AttentionInterface, AutoConfig

    from hf_upipe.models.architectures import ARCHITECTURES

    entry = ARCHITECTURES.get(arch)
    if entry is None or not entry.fused:
        raise ValueError(
            f"arch={arch!r}: choose a fused architecture of hf_upipe.models.architectures.FUSED"
        )
    module = importlib.import_module(
        f"transformers.models.{entry.module or arch}.modeling_{entry.module or arch}"
    )
    name = "upipe" if impl in UPIPE_IMPLS else DS_ATTN_NAME
    config = AutoConfig.for_model(
        arch,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=4 * hidden,
        num_hidden_layers=1,
        attention_dropout=0.0,
        attention_bias=False,
        max_position_embeddings=seq_len,
    )
    config._attn_implementation = name
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # module.to(dtype) fails under fake mode
    try:
        block = getattr(module, entry.attention)(config, layer_idx=0)
        rotary = getattr(module, f"{entry.prefix}RotaryEmbedding")(
            config
        )  # inv_freq: float32 whatever the dtype
    finally:
        torch.set_default_dtype(previous)
    if impl.startswith("fused"):
        from hf_upipe.config import UPipeConfig
        from hf_upipe.prepare import prepare_model

        mode = "save" if impl.startswith("fused_save") else "recompute"
        prepare_model(
            block,
            UPipeConfig(
                fused_backward=mode,
                overlap_comm=impl.endswith("_overlap"),
                tiled_mlp=False,
                auto=False,
            ),
        )  # not the env's UPIPE_*
    if impl == "deepspeed":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        ds_cls = require_deepspeed()
        AttentionInterface.register(DS_ATTN_NAME, deepspeed_attention)
        block.ds_ulysses = ds_cls(
            attn=sdpa_attention_forward,
            batch_size=1,
            attn_head_count=heads,
            attn_head_size=head_dim,
            kv_head_count=kv_heads,
            num_hidden_layers=1,
            process_group=group,
            seq_length_is_variable=True,
        )
    return block, rotary


def measure_attention_block(
    impl: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    sp_size: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    heads_per_chunk: int | None = 1,
    snapshot: bool = False,
    arch: str = "llama",
) -> dict:
    """Tracked forward + backward of one attention block on this rank's shard of seq_len // sp_size tokens.

    Args:
        impl: "upipe", "fused", "fused_save", "fused_overlap", "fused_save_overlap" or "deepspeed".
        hidden, heads, kv_heads, head_dim: the block geometry (H query / Hk key-value heads of size D).
        seq_len: S, the full sequence; sp_size: P, the ranks of `group` (default: the world).
        dtype: weights and activations.
        heads_per_chunk: UPipe's query heads per rank per stage (None: Ulysses mode); ignored for "deepspeed".
        snapshot: also return the storages live at the peak (`MemoryTracker(snapshot_at_peak=True)`).
        arch: the attention module's architecture (`build_attention_block`).

    Returns:
        {"forward_peak": bytes, "peak": bytes (forward + backward), "peak_with_grad_in": the same counting the
        incoming gradient, "unit": s * hidden * bytes per element}, plus
        "peak_snapshot" (list of `StorageRecord`) with `snapshot=True`.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: choose one of {IMPLEMENTATIONS}")
    if not dist.is_initialized():
        raise RuntimeError(
            "measure_attention_block needs torch.distributed; use simulate_attention_block for a "
            "single-process simulation."
        )
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) != sp_size:
        raise ValueError(f"sp_size={sp_size} but the group has {dist.get_world_size(group)} ranks")
    if seq_len % sp_size:
        raise ValueError(f"seq_len={seq_len} is not divisible by sp_size={sp_size}")
    s, rank = seq_len // sp_size, dist.get_rank(group)

    state = upipe_state(group, heads_per_chunk) if impl in UPIPE_IMPLS else deepspeed_comm()
    with state:
        # not counted: weights, x [1, s, hidden], position_ids [1, s] (global), cos/sin [1, s, D]
        block, rotary = build_attention_block(
            impl, hidden, heads, kv_heads, head_dim, seq_len, dtype, group, arch
        )
        x = torch.randn(1, s, hidden, dtype=dtype, requires_grad=True)
        position_ids = torch.arange(rank * s, (rank + 1) * s).unsqueeze(0)
        cos, sin = rotary(x, position_ids)
        grad_y = torch.ones(
            1, s, hidden, dtype=dtype
        )  # from the layer above, like x from the layer below
        with MemoryTracker(snapshot_at_peak=snapshot) as tracker:
            y = block(
                x, position_embeddings=(cos, sin), attention_mask=None, position_ids=position_ids
            )[0]
            tracker.mark("forward")  # y [1, s, hidden]
            y.backward(grad_y)
            tracker.mark("backward")
            del y
    unit = s * hidden * torch.finfo(dtype).bits // 8
    result = {
        "forward_peak": tracker.phase_peaks["forward"],
        "peak": tracker.peak_bytes,
        "peak_with_grad_in": max(
            tracker.phase_peaks["forward"], tracker.phase_peaks["backward"] + unit
        ),
        "unit": unit,
    }
    if snapshot:
        result["peak_snapshot"] = tracker.peak_snapshot
    return result


def simulate_attention_block(
    impl: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    sp_size: int,
    dtype: torch.dtype = torch.bfloat16,
    heads_per_chunk: int | None = 1,
    snapshot: bool = False,
    arch: str = "llama",
) -> dict:
    """`measure_attention_block` as rank 0 of a fake sp_size-rank world on fake tensors (one process, no data).

    The SP defaults ("upipe") and the fake world are torn down on exit, also on error.
    """
    with simulated_world(sp_size) as world, fake_tensors(dtype):
        if impl in UPIPE_IMPLS:
            _sp.init_sequence_parallel(group=world, heads_per_chunk=heads_per_chunk)
        try:
            return measure_attention_block(
                impl,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                seq_len=seq_len,
                sp_size=sp_size,
                dtype=dtype,
                group=world,
                heads_per_chunk=heads_per_chunk,
                snapshot=snapshot,
                arch=arch,
            )
        finally:
            if impl in UPIPE_IMPLS:
                _sp.reset_sequence_parallel()
