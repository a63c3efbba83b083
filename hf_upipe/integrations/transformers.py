"""`attn_implementation="upipe"` for transformers: the attention function and its mask function.

Entry points:
- `register()`: adds "upipe" to transformers' `AttentionInterface` and `AttentionMaskInterface`, and has models
  with their own table of attention classes refuse it by name (`hf_upipe.integrations.attention_tables`);
  idempotent; run when this module is imported, which `import hf_upipe` arranges as soon as transformers'
  modeling code loads.
- `upipe_attention_forward(module, query, key, value, attention_mask, ...)`: the registered attention function.
- The registered mask function, `upipe_mask`, and what it returns under SP, `SequenceParallelMask`:
  `hf_upipe.integrations.sp_mask`. The kernel of a call (documents, window, chunks, soft-capping, ring):
  `hf_upipe.integrations.sp_kernels`. The state and the checks that need no communication (`active_state`,
  `check_model`, `check_call`, `local_sequence_parallel`): `hf_upipe.integrations.sp_checks`. All three are
  shared with the fused path; the layout check itself is `hf_upipe.integrations.layout.validate_layout` (one
  all-gather per model forward, not per layer).

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
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from hf_upipe.architectures import keeps_documents_apart
from hf_upipe.batch_keys import CU_SEQLENS
from hf_upipe.integrations import attention_tables
from hf_upipe.integrations.layout import validate_layout, without_documents
from hf_upipe.integrations.model_calls import with_model_documents
from hf_upipe.integrations.sp_checks import (
    SINK_ARGUMENTS,
    UNIMPLEMENTED_ARGUMENTS,
    active_state,
    attention_overridden,
    check_call,
    check_model,
)
from hf_upipe.integrations.sp_kernels import call_kernel, sp_kernel
from hf_upipe.integrations.sp_mask import upipe_mask
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.upipe_attention import upipe_attention

__all__ = ["NAME", "register", "upipe_attention_forward"]

NAME = "upipe"


def _check_kv_length(query, key) -> None:
    if key.shape[-2] != query.shape[-2]:
        raise NotImplementedError(
            f"key length {key.shape[-2]} != query length {query.shape[-2]}: a KV cache with past tokens "
            "(generation) is not supported in a model call under sequence parallelism: generate with "
            "hf_upipe.generate, or call the model with use_cache=False."
        )


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
    check_model(config, state, query.shape[2] * state.sp_size)
    check_call(module, dropout, kwargs, handled=SINK_ARGUMENTS + ("softcap",))
    kwargs = with_model_documents(kwargs, module)
    _check_kv_length(query, key)
    sinks = (
        kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    )  # [H] sink logits
    query, key, value, v_dim, scaling = _equal_head_dims(query, key, value, scaling)
    if isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"attn_implementation='upipe' got a prepared {attention_mask.dim()}-D attention mask tensor under "
            "sequence parallelism; pass a 2-D padding mask (right padding) or none."
        )
    B, _, s, _ = query.shape
    kernel = state.kernel
    if not is_fake(
        query
    ):  # fake tensors (memory simulation) carry no values to check (nor documents to split)
        if not validate_layout(
            state,
            kwargs.get("position_ids"),
            attention_mask,
            B,
            s,
            query.device,
            kwargs.get(CU_SEQLENS),
            query.dtype,
            not keeps_documents_apart(config),
        ):
            kwargs = without_documents(
                kwargs
            )  # the model's mask ignores them: attend across, as on one device
        kernel = sp_kernel(state, kwargs, query.device, query.dtype, s * state.sp_size)
    kernel = call_kernel(state, kernel, attention_mask, sliding_window, module, kwargs, query)
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
    attention_tables.install()  # models with their own table of attention classes refuse "upipe" by name


register()  # importing this module registers "upipe" (hf_upipe.registration imports it once transformers loads)
