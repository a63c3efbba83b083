"""The attention kernel of one "upipe" call under sequence parallelism: the state's kernel, wrapped for packed
rows, a sliding window, chunked attention, soft-capped scores or a ring.

Entry points:
- `sp_kernel(state, kwargs, device, dtype, seq_len)`: the state's kernel, wrapped in
  `hf_upipe.ops.documents.DocumentKernel` for packed rows (one per batch; shared with the fused path).
- `sp_window(attention_mask, call_window, seq_len, module)`: the call's sliding window, the mask's and the call's
  agreeing; `window_kernel(...)`, `softcap_kernel(...)`: a kernel limited to a window, with soft-capped scores.

Ring attention's seam in the attention paths: the kernel a call runs under `init_sequence_parallel(ring_size=R)`.

Entry point:
- `ring_kernel(state, kernel, device, dtype, *, window=None, chunk=None, softcap=None)`: the state's kernel wrapped
  in `hf_upipe.ops.ring.RingKernel` over `state.ring_group`; the registered attention function and the fused block
  call it in place of their window / chunk / soft-capping kernels, which assume the sequence in order.

What the ring does not implement is refused here, on every rank alike (the same model and call on every rank),
before any all-to-all: sliding windows, chunked attention and soft-capping (their masks are over positions in
sequence order, not the ring's). Packed rows are refused by `hf_upipe.data.shard_batch` and the layout check.
"""

from __future__ import annotations

from hf_upipe.attention.mask import SequenceParallelMask
from hf_upipe.attention.state import TensorCache
from hf_upipe.batch_keys import CU_SEQLENS, MAX_SEQLEN
from hf_upipe.ops.documents import DocumentKernel
from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.ring import RingKernel
from hf_upipe.ops.softcap import SoftcapKernel
from hf_upipe.ops.windowed import WindowKernel

__all__ = [
    "ring_kernel",
    "softcap_kernel",
    "sp_kernel",
    "sp_window",
    "window_kernel",
]


def ring_kernel(
    state, kernel: str | AttentionKernel, device, dtype, *, window=None, chunk=None, softcap=None
) -> AttentionKernel:
    """`kernel` (a name or an `AttentionKernel`) as a `RingKernel` over `state.ring_group`.

    Raises:
        NotImplementedError: the call needs a sliding window, chunked attention or soft-capping (every rank).
    """
    for what, value in (
        ("a sliding window", window),
        ("chunked attention", chunk),
        ("attention soft-capping", softcap),
    ):
        if value is not None:
            raise NotImplementedError(
                f"This model's attention uses {what} ({value}), which ring attention "
                f"(ring_size={state.ring_size}) does not implement: use ring_size=1 (UPipe "
                "over the whole SP group)."
            )
    inner = get_kernel(kernel, device, dtype) if isinstance(kernel, str) else kernel
    return RingKernel(inner, state.ring_group)


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
    documents = None if kwargs is None else kwargs.get(CU_SEQLENS)
    return (
        kernel
        if documents is None
        else DocumentKernel(kernel, documents, seq_len, kwargs.get(MAX_SEQLEN))
    )


# upipe_cu_seqlens tensor -> ((kernel name, device, dtype, S), DocumentKernel) of the current batch
_DOCUMENT_KERNELS = TensorCache()


def sp_kernel(state, kwargs: dict, device, dtype, seq_len: int) -> str | AttentionKernel:
    """The attention kernel for this call: the state's kernel, or for packed rows (`upipe_cu_seqlens` in the
    model's kwargs) that kernel wrapped in `DocumentKernel` over the full sequence of `seq_len` tokens."""
    documents = kwargs.get(CU_SEQLENS)
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
    kernel = DocumentKernel(inner, documents, seq_len, kwargs.get(MAX_SEQLEN))
    _DOCUMENT_KERNELS.set(documents, (key, kernel))
    return kernel
