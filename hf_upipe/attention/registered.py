"""`attn_implementation="upipe"` for transformers: the attention function and its mask function.

Entry points:
- `register()`: adds "upipe" to transformers' `AttentionInterface` and `AttentionMaskInterface`, and has models
  with their own table of attention classes refuse it by name (`hf_upipe.attention.registered`);
  idempotent; run when this module is imported, which `import hf_upipe` arranges as soon as transformers'
  modeling code loads.
- `upipe_attention_forward(module, query, key, value, attention_mask, ...)`: the registered attention function.
- The registered mask function, `upipe_mask`, and what it returns under SP, `SequenceParallelMask`:
  `hf_upipe.attention.mask`. The kernel of a call (documents, window, chunks, soft-capping, ring):
  `hf_upipe.attention.kernel`. The state (`active_state`, `local_sequence_parallel`):
  `hf_upipe.attention.state`. The call prelude, the same for the fused path: `hf_upipe.attention.call.sp_call`
  (the refusals that need no communication, the model's documents, the layout check
  `hf_upipe.attention.layout.validate_layout`, one all-gather per model forward, not per layer, and the kernel).

The flow, with sequence parallelism initialised (`hf_upipe.init_sequence_parallel`, group of P > 1 ranks):
1. each rank calls the model on its contiguous shard input_ids [B, s] with GLOBAL position_ids
   (rank r: r*s .. r*s+s-1), so RoPE is applied with global positions before attention; for packed rows
   (several documents per row) with per-document position_ids and the document boundaries
   `upipe_cu_seqlens` / `upipe_max_seqlen` (`hf_upipe.shard_batch` makes all of these), which transformers
   passes through its kwargs to the attention function;
2. `upipe_mask` does not build an O(S^2) mask: it passes on the 2-D padding mask (if any) and whether the
   model asked for plain causal masking (else the mask function, probed later), as a `SequenceParallelMask`;
3. `upipe_attention_forward` checks (once per model forward: the first layer; `validate_layout`), with one tiny
   all-gather that every rank enters, that the ranks agree on
   the layout (equal shard lengths, the same documents, position_ids that are global or match the documents,
   a mask that is causal (within the local documents), padding only at the end of each row), so a bad batch
   raises the same error on every rank before any all-to-all; then it runs `hf_upipe.ops.upipe_attention` on
   the shard, with the kernel wrapped in `DocumentKernel` for packed rows (each token attends only to earlier
   tokens of its own document).
Without SP (never initialised, or a group of one rank) "upipe" is exactly transformers' "sdpa": same mask, same
kernel, padding, packing and generation with a KV cache included (`upipe_cu_seqlens` is ignored there).

Under SP, trailing (right) padding is accepted: causal attention never lets a real token see a later pad, so
real tokens are exact; outputs at padded positions are not meaningful and their labels must be ignored (-100).
Sliding windows shorter than the sequence (in the mask, in the call, or both, agreeing) run in the kernel
(`hf_upipe.ops.windowed`); so do attention sinks (`s_aux`/`sinks`: `upipe_attention(sinks=)`, from the log-sum-exp),
soft-capped scores (`softcap`: `hf_upipe.ops.softcap`, CPU) and value heads of another width (MLA: zero-padded).
Left or interior padding, packed rows without `upipe_cu_seqlens`, windows with packed rows (except inside the
soft-capped kernel), custom masks, dropout and KV caches with past tokens raise errors naming the fix.

Models that pick their attention class from their own table refuse `attn_implementation="upipe"` by name.

Most transformers models call the function registered under their attention implementation (transformers'
`AttentionInterface`, where "upipe" is registered). A few modeling modules instead hold their own table of attention
classes keyed by the implementation's name (`FALCON_ATTENTION_CLASSES = {"eager": ..., "sdpa": ...,
"flash_attention_2": ...}`: Falcon, GPT-Neo, GIT, Bark, GPT-J on transformers 5.23, SAM-style vision encoders), and
index it while building their layers. transformers accepts "upipe" for every model (it is registered), so such a
model would fail inside its own `__init__` with a bare `KeyError: 'upipe'`. "upipe" could never run in those classes
(their attention bypasses the interface), so nothing can adapt them: they are refused, by name, with the
alternatives.

Entry point:
- `install()`: wraps `PreTrainedModel.get_correct_attn_implementation` (which every model's `__init__` calls with its
  config's implementation before it builds a layer) so that it first gives each such table of the model's modeling
  module a "upipe" entry that raises `OwnAttentionTable` naming the model type, the table and the implementations it
  has (idempotent). Only a layer whose config asks for "upipe" reaches that entry: a multimodal model whose vision
  encoder keeps "sdpa" still builds.
- `attention_tables(module)`: the tables of a modeling module (dicts with an "eager" key whose values are
  `nn.Module` classes).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from hf_upipe.attention.call import SpCall, sp_call
from hf_upipe.attention.mask import upipe_mask
from hf_upipe.attention.state import (
    SINK_ARGUMENTS,
    UNIMPLEMENTED_ARGUMENTS,
    active_state,
    attention_overridden,
    check_model,
)
from hf_upipe.models.architectures import ARCHITECTURES
from hf_upipe.models.verification import TESTED_RANGE
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.upipe_attention import upipe_attention

__all__ = [
    "NAME",
    "OwnAttentionTable",
    "attention_tables",
    "install",
    "register",
    "upipe_attention_forward",
]

NAME = "upipe"

_DONE: set[str] = set()  # modeling modules whose tables have their "upipe" entry


class OwnAttentionTable(ValueError):
    """A model picks its attention class from its own table, so `attn_implementation="upipe"` cannot run in it."""


def attention_tables(module) -> dict[str, dict]:
    """See the module docstring."""
    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, dict)
        and "eager" in value
        and all(
            isinstance(v, type) and issubclass(v, nn.Module) for k, v in value.items() if k != NAME
        )
    }


def _refusal(table_name: str, implementations: list[str], where: str):
    def refuse(config, *args, **kwargs):
        model_type = getattr(config, "model_type", "?")
        arch = ARCHITECTURES.get(model_type)
        newer = (
            f" hf_upipe verifies {model_type} where its attention goes through the interface: "
            f"pip install '{TESTED_RANGE}' (the newest release it tests)."
            if arch is not None and arch.verified
            else ""
        )
        raise OwnAttentionTable(
            f"attn_implementation='upipe' is not available for model_type {model_type!r} ({where}): it picks its "
            "attention "
            f"class from its own table {table_name} ({', '.join(implementations)}), not from transformers' "
            "attention interface, so 'upipe' (and sequence parallelism) can never run in it. Load it with "
            f"attn_implementation={'sdpa' if 'sdpa' in implementations else 'eager'!r} and train without "
            f"sequence parallelism (docs/models.md lists the models hf_upipe runs).{newer}"
        )

    return refuse


def _add_entries(cls: type) -> None:
    """Give the tables of `cls`'s modeling module their refusing "upipe" entry (once per module)."""
    name = cls.__module__
    if name in _DONE or not name.startswith("transformers.models."):
        return
    _DONE.add(name)
    module = sys.modules.get(name)
    for table_name, table in attention_tables(module).items() if module is not None else ():
        if NAME not in table:
            table[NAME] = _refusal(table_name, [k for k in table if k != NAME], name)


def install() -> None:
    """See the module docstring."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "upipe_tables", False):
        return

    @functools.wraps(original)
    def get_correct_attn_implementation(self, *args, **kwargs):
        _add_entries(type(self))
        return original(self, *args, **kwargs)

    get_correct_attn_implementation.upipe_tables = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def _equal_head_dims(query, key, value, scaling):
    """Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...) has a value head dim Dv != the q/k head dim D.
    The all-to-alls and kernels take one head dim, so the narrower side is padded with zeros, which is exact: zero
    q/k dims add nothing to q.k, and the zero value dims give zero output dims, sliced off after attention.

    Args: query/key [B, H|Hk, s, D], value [B, Hk, s, Dv]. Returns (query, key, value) padded to max(D, Dv), Dv,
    and the softmax scale (D^-0.5 of the unpadded D when the model passes none)."""
    D, Dv = query.shape[-1], value.shape[-1]
    scaling = D**-0.5 if scaling is None else scaling
    if Dv < D:
        value = torch.nn.functional.pad(value, (0, D - Dv))
    elif Dv > D:
        query, key = (torch.nn.functional.pad(t, (0, Dv - D)) for t in (query, key))
    return query, key, value, Dv, scaling


def upipe_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """Attention function registered as "upipe" (transformers' AttentionInterface signature).

    Args:
        module: the model's attention module (`is_causal`, `config`, `layer_idx` are read).
        query: [B, H, s, D] this rank's tokens, RoPE applied; key/value: [B, Hk, s, D] (GQA not expanded).
        attention_mask: what `upipe_mask` returned.
        scaling: softmax scale; sliding_window: the model's window, if any.
        **kwargs: transformers' kwargs; `position_ids` [B or 1, s] (global, or per document with
            `upipe_cu_seqlens` / `upipe_max_seqlen` for packed rows) is required under SP.

    Returns:
        (attn_output [B, s, H, D], None)
    """
    if (
        override := attention_overridden()
    ) is not None:  # hf_upipe.generation's prefill and decode step
        kw = dict(kwargs, dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return override(module, query, key, value, attention_mask, **kw)
    state = active_state()
    config = getattr(module, "config", None)
    if state is None:
        check_model(config, None)
        for name in UNIMPLEMENTED_ARGUMENTS:
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"the model passes '{name}' to its attention, which 'upipe' (here 'sdpa') "
                    "does not implement (the result would silently drop it)."
                )
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    B, _, s, _ = query.shape  # [B, H, s, D]
    call = SpCall(
        module,
        attention_mask,
        B,
        s,
        query.device,
        query.dtype,
        is_fake(query),
        dropout=dropout,
        window=sliding_window,
        past=key.shape[-2] - s,
        handled=SINK_ARGUMENTS + ("softcap",),
    )
    kwargs, kernel = sp_call(state, call, kwargs)
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")  # [H]
    query, key, value, v_dim, scaling = _equal_head_dims(query, key, value, scaling)
    out = upipe_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),  # [B, s, H|Hk, D] views
        group=state.attention_group,
        heads_per_chunk=state.heads_per_chunk,
        kernel=kernel,
        scale=scaling,
        sinks=sinks,
    )
    return out[..., :v_dim], None  # [B, s, H, Dv]


def register() -> None:
    """Make `attn_implementation="upipe"` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, upipe_attention_forward)
    AttentionMaskInterface.register(NAME, upipe_mask)
    install()  # models with their own table of attention classes refuse "upipe" by name


# importing this module registers "upipe" (hf_upipe.attention.registration imports it once transformers loads)
register()
