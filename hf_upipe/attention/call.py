"""What every "upipe" attention call under sequence parallelism runs first, on both paths: the call prelude.

Entry points:
- `SpCall`: one attention call as the prelude sees it (module, mask, shard sizes, device, dtype, dropout, the
  call's window, past tokens in a KV cache, what the path implements).
- `sp_call(state, call, kwargs) -> (kwargs, kernel)`: the checks every rank makes before any collective, then the
  batch's layout (a collective) and the kernel of the call. `hf_upipe.attention.registered.upipe_attention_forward`
  and `hf_upipe.attention.fused.fused_forward` both call it, then run their own attention on the kernel it returns.
- `REFUSALS`: the refusals of a call that need no communication, in order; each `(state, call, kwargs) -> None`
  raises `NotImplementedError` naming the numbers and the fix. A refusal added here applies to both paths.
- `call_kernel(state, kernel, call, kwargs)`: the kernel wrapped for the call: a ring around it, the kernel inside
  each chunk (chunked attention), soft-capped scores, or the call's window, in that order.

What the fused block does not implement is an argument of the call (`SpCall.handled`, `SpCall.chunks`), not a
second copy of the prelude: the registered path handles attention sinks, soft-capping and chunked attention, the
fused block refuses them.

The order (every rank alike, the same model and call on every rank):
1. `REFUSALS`: a KV cache with past tokens, the model (`check_model`), the call (`check_call`: causal, no attention
   weights, no dropout, no argument the path does not implement), a prepared mask tensor, chunked attention
   where the path has no chunks;
2. the model's documents added to the kwargs (`with_model_documents`);
3. real tensors only: the layout check (`validate_layout`: the ranks hold shards of the same batch; packed rows
   dropped where the model's mask ignores them), then `sp_kernel` (packed rows inside each document);
4. `call_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_upipe.adapters.call_checks import with_model_documents
from hf_upipe.attention.kernel import (
    ring_kernel,
    softcap_kernel,
    sp_kernel,
    sp_window,
    window_kernel,
)
from hf_upipe.attention.layout import ShardLayout, validate_layout, without_documents
from hf_upipe.attention.mask import SequenceParallelMask, chunk_kernel
from hf_upipe.attention.state import check_call, check_model
from hf_upipe.batch_keys import CU_SEQLENS
from hf_upipe.models.architectures import keeps_documents_apart

__all__ = ["REFUSALS", "SpCall", "call_kernel", "sp_call"]


@dataclass(frozen=True)
class SpCall:
    """One attention call under SP.

    module: the attention module; attention_mask: what `upipe_mask` returned (or a tensor, refused);
    batch, length: B and this rank's tokens s; device, dtype: of the call's tensors; fake: fake tensors (a memory
    simulation: no values to check); dropout: the attention dropout of the call; window: the call's own sliding
    window (None: none); past: tokens a KV cache already holds; path: the path's name in errors;
    handled: `UNIMPLEMENTED_ARGUMENTS` the path implements; chunks: whether it implements chunked attention."""

    module: torch.nn.Module
    attention_mask: object
    batch: int
    length: int
    device: torch.device
    dtype: torch.dtype
    fake: bool
    dropout: float = 0.0
    window: int | None = None
    past: int = 0
    path: str = "attn_implementation='upipe'"
    handled: tuple[str, ...] = ()
    chunks: bool = True


def _refuse_past_tokens(state, call: SpCall, kwargs: dict) -> None:
    if call.past > 0:
        raise NotImplementedError(
            f"a KV cache with {call.past} past tokens (generation) is not supported in a model call under "
            "sequence parallelism: generate with hf_upipe.generate, or call the model with use_cache=False."
        )


def _refuse_model_and_call(state, call: SpCall, kwargs: dict) -> None:
    check_model(getattr(call.module, "config", None), state, call.length * state.sp_size)
    check_call(call.module, call.dropout, kwargs, handled=call.handled)


def _refuse_mask_tensor(state, call: SpCall, kwargs: dict) -> None:
    if isinstance(call.attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"{call.path} got a prepared {call.attention_mask.dim()}-D attention mask tensor under sequence "
            "parallelism; pass a 2-D padding mask (right padding) or none."
        )


def _refuse_chunks(state, call: SpCall, kwargs: dict) -> None:
    chunk = getattr(call.attention_mask, "chunk", None)
    if chunk is not None and not call.chunks:
        raise NotImplementedError(
            f"chunked attention (chunks of {chunk}) is not implemented by {call.path}; prepare the model "
            "with UPipeConfig(fused_attention=False)."
        )


REFUSALS = [_refuse_past_tokens, _refuse_model_and_call, _refuse_mask_tensor, _refuse_chunks]


def sp_call(state, call: SpCall, kwargs: dict):
    """See the module docstring. Returns (the call's kwargs, with the model's documents or without them where
    its mask ignores them; the kernel the call runs)."""
    for refuse in REFUSALS:
        refuse(state, call, kwargs)
    kwargs = with_model_documents(kwargs, call.module)
    kernel = state.kernel
    if not call.fake:  # fake tensors carry no values to check (nor documents to split)
        config = getattr(call.module, "config", None)
        shard = ShardLayout(
            kwargs.get("position_ids"),
            call.attention_mask,
            call.batch,
            call.length,
            call.device,
            kwargs.get(CU_SEQLENS),
            call.dtype,
            not keeps_documents_apart(config),
        )
        if not validate_layout(state, shard):
            # the model's mask ignores the documents: attend across, as on one device
            kwargs = without_documents(kwargs)
        kernel = sp_kernel(state, kwargs, call.device, call.dtype, call.length * state.sp_size)
    return kwargs, call_kernel(state, kernel, call, kwargs)


def call_kernel(state, kernel, call: SpCall, kwargs: dict):
    """The kernel of one attention call under SP, from `kernel` (`sp_kernel`'s, or the state's on fake tensors):
    a ring around it (plain causal attention only), or the kernel inside each chunk (chunked attention), or
    soft-capped scores (any window inside), or limited to the call's window."""
    seq_len = call.length * state.sp_size
    window = sp_window(call.attention_mask, call.window, seq_len, call.module)
    mask = call.attention_mask
    chunk = mask.chunk if isinstance(mask, SequenceParallelMask) else None
    softcap = kwargs.get("softcap")
    if state.ring_size > 1:
        # ring attention: plain causal attention only (packed rows were refused by the layout check)
        return ring_kernel(
            state, kernel, call.device, call.dtype, window=window, chunk=chunk, softcap=softcap
        )
    if chunk is not None:  # chunked attention: the kernel inside each chunk, like packed documents
        if kwargs.get(CU_SEQLENS) is not None or softcap is not None:
            raise NotImplementedError(
                f"chunked attention (chunks of {chunk}) with packed documents or soft-capping is "
                "not implemented under sequence parallelism: do not pack."
            )
        if call.fake:  # (a simulation runs the unchunked kernel: the same buffers)
            return kernel
        return chunk_kernel(kernel, chunk, call.batch, seq_len, call.device, call.dtype)
    if softcap is not None:  # blocked math kernel (the simulation runs it too: its memory counts)
        arguments = None if call.fake else kwargs
        return softcap_kernel(state, arguments, call.device, call.dtype, seq_len, softcap, window)
    if call.fake:
        # a simulation runs the unwindowed kernel: the memory of a native-window kernel, flash-attn's, whose
        # buffers do not depend on the window; the CPU kernel's block masks are not modelled
        return kernel
    return window_kernel(kernel, window, kwargs.get(CU_SEQLENS), call.device, call.dtype)
