"""`attn_implementation="upipe"` for transformers: the attention function and its mask function.

Entry points:
- `register()`: adds "upipe" to transformers' `AttentionInterface` and `AttentionMaskInterface`, and has models
  with their own table of attention classes refuse it by name (`hf_upipe.integrations.attention_tables`);
  idempotent; run when this module is imported, which `import hf_upipe` arranges as soon as transformers'
  modeling code loads.
- `upipe_attention_forward(module, query, key, value, attention_mask, ...)`: the registered attention function.
- `upipe_mask(...)`: the registered mask function; `SequenceParallelMask`: what it returns under SP.
- `sp_kernel(state, kwargs, device, dtype, seq_len)`: the state's kernel, wrapped in
  `hf_upipe.ops.documents.DocumentKernel` for packed rows (one per batch; shared with the fused path).
- `local_sequence_parallel()`: the SP paths on a rank of its own, for the adapters' behaviour checks.
- `attention_override(fn)`: a context in which the "upipe" attention function (and the fused block, which then
  takes the registered path) returns `fn(module, query, key, value, attention_mask, **kwargs)` instead;
  `hf_upipe.generation` uses it to record a shard's keys and values and to attend to them while decoding.
- `active_state()`, `check_model(...)`, `check_call(...)`, `sp_window(...)`, `window_kernel(...)`: the checks
  and the sliding window (`hf_upipe.ops.windowed`) the fused path shares (the layout check itself is
  `hf_upipe.integrations.layout.validate_layout`: one all-gather per model forward, not per layer).

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

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from hf_upipe.architectures import keeps_documents_apart
from hf_upipe.distributed import SequenceParallelState, get_sequence_parallel_state
from hf_upipe.integrations import attention_tables
from hf_upipe.integrations.call_checks import refuse_collected_attentions
from hf_upipe.integrations.chunked import chunk_kernel, local_pattern
from hf_upipe.integrations.layout import (
    TensorCache,
    mask_agrees,
    validate_layout,
    with_model_documents,
    without_documents,
)
from hf_upipe.integrations.ring_seam import ring_kernel
from hf_upipe.integrations.support import config_refusal, refusal_error, sdpa_refusal
from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.fake import is_fake, simulating
from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.ring import ring_positions
from hf_upipe.ops.softcap import SoftcapKernel
from hf_upipe.ops.upipe_attention import upipe_attention
from hf_upipe.ops.windowed import WindowKernel

__all__ = [
    "SequenceParallelMask",
    "active_state",
    "attention_override",
    "overridden",
    "check_call",
    "check_model",
    "local_sequence_parallel",
    "register",
    "sp_kernel",
    "sp_window",
    "upipe_attention_forward",
    "upipe_mask",
    "window_kernel",
]

NAME = "upipe"


@dataclass(frozen=True)
class SequenceParallelMask:
    """What the attention function needs to know about masking under SP (instead of an O(S^2) mask).

    Attributes:
        padding: [B, s] bool, True for real tokens of this rank's shard; None when nothing is padded.
        plain_causal: False when the model asked for more than causal masking (packed-sequence, sliding-window
            or custom mask functions); the SP path accepts such a mask only when it agrees with causal masking
            inside the documents given by `upipe_cu_seqlens` (transformers' packed mask from local position_ids).
        mask_function: the model's mask function when not plain causal (probed by the attention function), else
            None.
        window: the sliding window of the mask (transformers' `local_size`: key t seen by query i when
            0 <= i - t < window) when it is shorter than the full sequence; `plain_causal` then means causal within
            that window (the mask function was probed against it).
        chunk: chunked attention (Llama 4: key t seen by query i when t <= i in the same `chunk`-token block of
            the row), told from a window by `hf_upipe.integrations.chunked.local_pattern`.
        mask_given: the model got a 2-D attention_mask (transformers then never looks for packed documents in
            position_ids, so a plain causal mask says nothing about the model's handling of them).
    """

    padding: torch.Tensor | None
    plain_causal: bool
    mask_function: Callable | None = field(default=None, compare=False, repr=False)
    window: int | None = None
    chunk: int | None = None
    mask_given: bool = False

    def __getattr__(self, name: str):
        # model code that treats the mask as a tensor (its own mask arithmetic: `.dtype`, `.shape`, ...) would run
        # on a mask that is not there: a clear refusal (an AttributeError too, so `hasattr` stays False)
        if name.startswith("__"):
            raise AttributeError(name)
        raise _MaskUsedAsTensor(
            f"the model reads attention_mask.{name}: it computes with the mask itself (its own masking code), but "
            "under sequence parallelism 'upipe' hands the layers a description of the mask, not an [S, S] tensor. "
            "This model is not supported under sequence parallelism."
        )


class _MaskUsedAsTensor(AttributeError, NotImplementedError):
    """Model code used the SP mask as a tensor (both an AttributeError and a NotImplementedError)."""


def active_state() -> SequenceParallelState | None:
    """The installed sequence-parallel state when it has more than one rank (SP on), else None."""
    return _active_state()


def _active_state() -> SequenceParallelState | None:
    if _LOCAL:
        return _LOCAL[-1]
    state = get_sequence_parallel_state()
    return state if state is not None and state.sp_size > 1 else None


_LOCAL: list[SequenceParallelState] = []

_OVERRIDE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "upipe_attention_override", default=None
)


@contextlib.contextmanager
def attention_override(fn: Callable | None):
    """Inside, `upipe_attention_forward` returns `fn(module, query, key, value, attention_mask, dropout=,
    scaling=, sliding_window=, **kwargs)` (None: the function's own path again, e.g. from inside `fn`)."""
    token = _OVERRIDE.set(fn)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def overridden() -> bool:
    """True inside `attention_override(fn)` with a function (the fused block then takes the registered path)."""
    return _OVERRIDE.get() is not None


@contextlib.contextmanager
def local_sequence_parallel(heads_per_chunk: int = 1):
    """Inside, the SP paths run as on one rank of its own (no process group, no collective): a behaviour check of
    an adapter (`hf_upipe.verification`) compares them with transformers' own code in this process. Use it inside
    `hf_upipe.distributed.without_sequence_parallel()`, so that nothing else sees an SP state."""
    _LOCAL.append(
        SequenceParallelState(
            sp_group=None,
            sp_size=1,
            sp_rank=0,
            dp_group=None,
            dp_size=1,
            dp_rank=0,
            heads_per_chunk=heads_per_chunk,
            kernel="sdpa",
        )
    )
    try:
        yield
    finally:
        _LOCAL.pop()


def upipe_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """Mask function registered for "upipe": `sdpa_mask` without SP, a `SequenceParallelMask` with SP.

    It runs once per forward, before any layer, with the model's config: the support gate checks it here (the same
    verdict on every rank, before any collective or token mixing)."""
    state = _active_state()
    if state is None:
        check_model(kwargs.get("config"), None)
        return sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    check_model(kwargs.get("config"), state, q_length * state.sp_size)
    padding = attention_mask
    # a fake mask (memory simulation) carries no values: simulations model unpadded batches
    if padding is not None and (is_fake(padding) or bool(padding.all())):
        padding = None
    local_size = kwargs.get(
        "local_size"
    )  # the size of transformers' sliding-window and chunked masks
    window = chunk = None
    if (
        simulating()
    ):  # fake tensors (the planner): no values to probe; a window's and a chunk's kernels and the
        # layout check are not run on fake tensors either, and neither changes the buffers of the attention
        window = (
            local_size
            if isinstance(local_size, int) and 0 < local_size < q_length * state.sp_size
            else None
        )
        return SequenceParallelMask(
            padding=padding, plain_causal=True, window=window, mask_given=attention_mask is not None
        )
    if isinstance(local_size, int) and 0 < local_size < q_length * state.sp_size:
        pattern = local_pattern(mask_function, batch_size, local_size, q_length * state.sp_size)
        chunk, window = (local_size, None) if pattern == "chunk" else (None, local_size)
    plain = mask_function is causal_mask_function or _agrees_with_causal(
        mask_function, q_length, batch_size, window, chunk
    )
    if not plain and state.ring_size > 1 and window is None and chunk is None:
        # ring order jumps inside a shard, which transformers takes for packed documents: causal within those
        # segments is plain causal here (the layout check refuses positions other than the ring's)
        plain = _agrees_with_ring_segments(mask_function, state, q_length, batch_size)
    return SequenceParallelMask(
        padding=padding,
        plain_causal=plain,
        mask_function=None if plain else mask_function,
        window=window,
        chunk=chunk,
        mask_given=attention_mask is not None,
    )


def _agrees_with_causal(
    mask_function, length: int, batch_size: int, window: int | None = None, chunk: int | None = None
) -> bool:
    """Probe a model's mask function on a grid of local (query, key) positions against plain causal masking (within
    `window` keys when given: 0 <= q - k < window; inside `chunk`-token chunks when given).

    The grid is {0, 1, s/2, s-1} and, with a window, the distances around it: a window shorter than the shard or a
    custom mask fails the probe (mask functions are elementwise, so a grid is enough to tell these apart).
    """
    grid = {0, 1, length // 2, length - 1}
    for size in (window, chunk):
        if size is not None:
            grid |= {size - 1, size, size + 1, length - 1 - size, length - size}
    points = torch.tensor(sorted(grid & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    expected = q_idx >= kv_idx
    if window is not None:
        expected &= q_idx - kv_idx < window
    if chunk is not None:
        expected &= q_idx // chunk == kv_idx // chunk
    return all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size))


def _agrees_with_ring_segments(mask_function, state, length: int, batch_size: int) -> bool:
    """Probe a mask function against causal masking inside the runs of consecutive ring positions of this shard
    (`ring_positions`), on the grid {0, 1, s/2, s-1} plus each run's start and the token before it."""
    positions = ring_positions(state.sp_rank, length, state.sp_size, state.ring_size)  # [s]
    starts = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    segment = torch.zeros(length, dtype=torch.long)
    segment[starts] = 1
    segment = segment.cumsum(0)  # [s] run index
    grid = {0, 1, length // 2, length - 1} | set(starts) | {p - 1 for p in starts}
    points = torch.tensor(sorted(grid & set(range(length))))
    q_idx, kv_idx = (t.flatten() for t in torch.meshgrid(points, points, indexing="ij"))
    expected = (q_idx >= kv_idx) & (segment[q_idx] == segment[kv_idx])
    return all(mask_agrees(mask_function, b, q_idx, kv_idx, expected) for b in range(batch_size))


def sp_window(attention_mask, call_window: int | None, seq_len: int, module=None) -> int | None:
    """The sliding window of one attention call under SP (None: plain causal): the mask's window (transformers'
    semantics, as "sdpa" applies it), which must agree with a window the model passes to the call. `seq_len`: the
    full sequence; windows at least that long change nothing. A layer that its config's `layer_types` calls
    "sliding_attention", with a window shorter than the sequence, must have found it in the mask or the call."""
    call = call_window if isinstance(call_window, int) and 0 < call_window < seq_len else None
    mask = attention_mask.window if isinstance(attention_mask, SequenceParallelMask) else call
    if call is not None and mask != call:
        raise NotImplementedError(
            f"the model passes sliding_window={call_window} to its attention but its mask has "
            f"{'no window' if mask is None else f'window {mask}'} over the {seq_len} tokens: hf_upipe does not "
            "know which applies."
        )
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types, configured = (
        getattr(config, "layer_types", None),
        getattr(config, "sliding_window", None),
    )
    if (
        mask is None
        and isinstance(layer, int)
        and isinstance(types, (list, tuple))
        and layer < len(types)
        and types[layer] == "sliding_attention"
        and isinstance(configured, int)
        and 0 < configured < seq_len
    ):
        raise NotImplementedError(
            f"layer {layer} is a sliding-window layer (sliding_window={configured}, shorter than the {seq_len} "
            "tokens), but neither its mask nor its attention call carries the window: hf_upipe cannot apply it."
        )
    return mask


def window_kernel(kernel, window: int | None, documents, device, dtype):
    """`kernel` (a name or a kernel) limited to `window` (`hf_upipe.ops.windowed.WindowKernel`), or as it is."""
    if window is None:
        return kernel
    if documents is not None:
        raise NotImplementedError(
            f"a sliding window ({window}) with packed documents (upipe_cu_seqlens) is not "
            "implemented under sequence parallelism: do not pack, or use shorter sequences."
        )
    inner = get_kernel(kernel, device, dtype) if isinstance(kernel, str) else kernel
    return WindowKernel(inner, window)


def softcap_kernel(
    state, kwargs: dict | None, device, dtype, seq_len: int, softcap: float, window: int | None
):
    """The state's kernel with soft-capped scores (`hf_upipe.ops.softcap.SoftcapKernel`, any window inside it), run
    per document for packed rows (`upipe_cu_seqlens` in `kwargs`)."""
    base = (
        get_kernel(state.kernel, device, dtype) if isinstance(state.kernel, str) else state.kernel
    )
    kernel = SoftcapKernel(base, softcap, window)
    documents = None if kwargs is None else kwargs.get("upipe_cu_seqlens")
    return (
        kernel
        if documents is None
        else DocumentKernel(kernel, documents, seq_len, kwargs.get("upipe_max_seqlen"))
    )


# attention arguments "upipe" does not implement: refused with and without SP rather than dropped
_UNIMPLEMENTED = ("softcap", "s_aux", "sinks", "position_bias", "alibi", "attention_bias")
_SINKS = (
    "s_aux",
    "sinks",
)  # per-head attention-sink logits: implemented under SP (`upipe_attention(sinks=)`)
# the names transformers configs give the attention dropout probability
_DROPOUT_KEYS = (
    "attention_dropout",
    "attn_pdrop",
    "attention_probs_dropout_prob",
    "attn_dropout",
    "attention_dropout_prob",
)


def check_model(config, state, seq_len: int | None = None) -> None:
    """The support gate (`hf_upipe.integrations.support`) for a model of `config`: under SP (`state`), a verified
    architecture without length-dependent RoPE or a window shorter than `seq_len`; without SP, one that supports
    "sdpa". Raises NotImplementedError (the same on every rank)."""
    if config is None:
        return
    if state is None:
        reason = sdpa_refusal(config)
        if reason is not None:
            raise NotImplementedError(f"attn_implementation='upipe': {reason}.")
        return
    reason = config_refusal(config, seq_len, allow_unverified=state.allow_unverified)
    if reason is not None:
        raise refusal_error(reason)


def check_call(module, dropout, kwargs, handled: tuple[str, ...] = ()) -> None:
    """Checks of one attention call that need no communication (identical on every rank: same model, same
    arguments): causal attention, no attention weights requested, no dropout, no argument of `_UNIMPLEMENTED` other
    than the `handled` ones."""
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(
            "attn_implementation='upipe' supports causal (decoder) attention only."
        )
    refuse_collected_attentions()
    if dropout and dropout > 0.0:
        config = getattr(module, "config", None)
        keys = [k for k in _DROPOUT_KEYS if getattr(config, k, None) == dropout] or [
            "attention_dropout"
        ]
        raise NotImplementedError(
            f"attention dropout={dropout} is not supported by sequence-parallel 'upipe' attention: set the model "
            f"config's {keys[0]}=0.0 (e.g. from_pretrained(..., {keys[0]}=0.0)) or call model.eval()."
        )
    for name in _UNIMPLEMENTED:
        if kwargs.get(name) is not None and name not in handled:
            raise NotImplementedError(
                f"the model passes '{name}' to its attention, which 'upipe' does not implement "
                "(the result would silently drop it)."
            )


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


# upipe_cu_seqlens tensor -> ((kernel name, device, dtype, S), DocumentKernel) of the current batch
_DOCUMENT_KERNELS = TensorCache()


def sp_kernel(state, kwargs: dict, device, dtype, seq_len: int) -> str | AttentionKernel:
    """The attention kernel for this call: the state's kernel, or for packed rows (`upipe_cu_seqlens` in the
    model's kwargs) that kernel wrapped in `DocumentKernel` over the full sequence of `seq_len` tokens."""
    documents = kwargs.get("upipe_cu_seqlens")
    if documents is None:
        return state.kernel
    key = (state.kernel, device, dtype, seq_len)
    cached = _DOCUMENT_KERNELS.get(documents)
    if cached is not None and cached[0] == key:
        return cached[
            1
        ]  # one DocumentKernel per batch: its documents are read (one sync) once, not per layer
    inner = (
        get_kernel(state.kernel, device, dtype) if isinstance(state.kernel, str) else state.kernel
    )
    kernel = DocumentKernel(inner, documents, seq_len, kwargs.get("upipe_max_seqlen"))
    _DOCUMENT_KERNELS.set(documents, (key, kernel))
    return kernel


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
    if (override := _OVERRIDE.get()) is not None:
        kw = dict(kwargs, dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return override(module, query, key, value, attention_mask, **kw)
    state = _active_state()
    config = getattr(module, "config", None)
    if state is None:
        check_model(config, None)
        for name in _UNIMPLEMENTED:
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
    check_call(module, dropout, kwargs, handled=_SINKS + ("softcap",))
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
            kwargs.get("upipe_cu_seqlens"),
            query.dtype,
            not keeps_documents_apart(config),
        ):
            kwargs = without_documents(
                kwargs
            )  # the model's mask ignores them: attend across, as on one device
        kernel = sp_kernel(state, kwargs, query.device, query.dtype, s * state.sp_size)
    window = sp_window(attention_mask, sliding_window, s * state.sp_size, module)
    chunk = attention_mask.chunk if isinstance(attention_mask, SequenceParallelMask) else None
    if (
        state.ring_size > 1
    ):  # ring attention: plain causal attention only (packed rows were refused above)
        kernel = ring_kernel(
            state,
            kernel,
            query.device,
            query.dtype,
            window=window,
            chunk=chunk,
            softcap=kwargs.get("softcap"),
        )
    elif (
        chunk is not None
    ):  # chunked attention: the kernel inside each chunk, like packed documents
        if kwargs.get("upipe_cu_seqlens") is not None or kwargs.get("softcap") is not None:
            raise NotImplementedError(
                f"chunked attention (chunks of {chunk}) with packed documents or soft-capping is "
                "not implemented under sequence parallelism: do not pack."
            )
        if not is_fake(query):  # (a simulation runs the unchunked kernel: the same buffers)
            kernel = chunk_kernel(kernel, chunk, B, s * state.sp_size, query.device, query.dtype)
    elif (
        kwargs.get("softcap") is not None
    ):  # blocked math kernel (the simulation runs it too: its memory counts)
        kernel = softcap_kernel(
            state,
            None if is_fake(query) else kwargs,
            query.device,
            query.dtype,
            s * state.sp_size,
            kwargs["softcap"],
            window,
        )
    elif not is_fake(
        query
    ):  # (a simulation runs the unwindowed kernel: the memory of a native-window kernel,
        # flash-attn's, whose buffers do not depend on the window; the CPU kernel's block masks are not modelled)
        kernel = window_kernel(
            kernel, window, kwargs.get("upipe_cu_seqlens"), query.device, query.dtype
        )
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
