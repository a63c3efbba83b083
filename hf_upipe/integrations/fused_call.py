"""The forward the fused UPipe attention block installs on an attention module.

Entry points:
- `fused_forward(self, hidden_states, ...)`: under sequence parallelism, validates the batch like the registered
  path (once per model forward; every rank raises the same error before any all-to-all) and calls
  `fused_upipe_attention` on the normed hidden states (for packed rows, `upipe_cu_seqlens` in the kwargs, with the
  kernel wrapped in `hf_upipe.ops.documents.DocumentKernel`, as the registered path does); without SP, with another
  attention function chosen for the call, or under autocast to a dtype other than the weights', it calls the class's
  own forward (without SP: exact "sdpa", which handles packing itself).
- `OPTIONS_ATTRIBUTE`: the instance attribute holding the block's options, {"save_attention":
  `UPipeConfig.fused_backward` == "save", "overlap": `UPipeConfig.overlap_comm`}, which
  `hf_upipe.integrations.fused.install_fused_attention` sets.

Gradients are returned by one autograd Function per layer (never accumulated into `.grad` by hand), so DDP/FSDP
hooks and the model's non-reentrant activation checkpointing see an ordinary op.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hf_upipe.architectures import fused_attention_classes, keeps_documents_apart
from hf_upipe.batch_keys import CU_SEQLENS
from hf_upipe.integrations.call_checks import CACHE_NAMES
from hf_upipe.integrations.fused_weights import attention_weights
from hf_upipe.integrations.layout import validate_layout, without_documents
from hf_upipe.integrations.model_calls import with_model_documents
from hf_upipe.integrations.ring_seam import ring_kernel
from hf_upipe.integrations.sp_checks import (
    active_state,
    attention_overridden,
    check_call,
    check_model,
)
from hf_upipe.integrations.sp_kernels import sp_kernel, sp_window, window_kernel
from hf_upipe.integrations.zero3 import gather_children
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.fused_attention import fused_upipe_attention
from hf_upipe.ops.ring import ring_positions

logger = logging.getLogger(__name__)

__all__ = ["OPTIONS_ATTRIBUTE", "fused_forward"]

# instance attribute: the fused block's options (see the module docstring)
OPTIONS_ATTRIBUTE = "_upipe_fused_options"


def _call_arguments(args: tuple, kwargs: dict) -> tuple:
    """An attention forward's (position_embeddings, attention_mask, cache, other kwargs), whichever way the decoder
    layer passed them (by position or by name, the cache under either name)."""
    kwargs = dict(kwargs)
    named = [kwargs.pop(n, None) for n in ("position_embeddings", "attention_mask")]
    cache = next((kwargs.pop(n) for n in CACHE_NAMES if kwargs.get(n) is not None), None)
    for n in CACHE_NAMES:
        kwargs.pop(n, None)
    position_embeddings, attention_mask, positional_cache = (*args, None, None, None)[:3]
    return (
        position_embeddings if position_embeddings is not None else named[0],
        attention_mask if attention_mask is not None else named[1],
        positional_cache if positional_cache is not None else cache,
        kwargs,
    )


def fused_forward(self, hidden_states, *args, **kwargs):
    """Forward installed on known attention modules: the fused UPipe block under SP, the original otherwise."""
    state = active_state()
    if state is None or attention_overridden() or _autocast_other_dtype(self, hidden_states):
        return type(self).forward(
            self, hidden_states, *args, **kwargs
        )  # without SP: "sdpa"; else registered
    position_embeddings, attention_mask, cache, kwargs = _call_arguments(args, kwargs)
    kwargs = _checked_call(self, state, hidden_states, attention_mask, cache, kwargs)
    arch = fused_attention_classes()[type(self).__name__]
    kernel = _call_kernel(self, arch, state, hidden_states, attention_mask, kwargs)
    s = hidden_states.shape[1]
    cos, sin = position_embeddings
    gather_children(self)  # ZeRO-3: q/k/v/o_proj are read here, not called
    y = fused_upipe_attention(
        hidden_states,
        cos,
        sin,
        attention_weights(self, arch),
        num_heads=self.config.num_attention_heads,
        num_kv_heads=self.config.num_key_value_heads,
        head_dim=self.head_dim,
        group=state.attention_group,
        heads_per_chunk=state.heads_per_chunk,
        kernel=kernel,
        scale=self.scaling,
        # LoRA dropout's masks are drawn by global token position (ring shards hold two chunks)
        positions=lambda: ring_positions(
            state.sp_rank, s, state.sp_size, state.ring_size, hidden_states.device
        ),
        **self.__dict__.get(OPTIONS_ATTRIBUTE, {}),
    )
    return y, None


def _checked_call(self, state, hidden_states, attention_mask, cache, kwargs: dict) -> dict:
    """The call's kwargs, with the model's documents, once the checks every rank makes before any collective pass
    (a KV cache with past tokens, the model and call checks, a prepared mask tensor, chunked attention)."""
    if cache is not None and cache.get_seq_length(self.layer_idx) > 0:
        raise NotImplementedError(
            "A KV cache with past tokens is not supported under sequence parallelism; "
            "generate with hf_upipe.generate, or call the model with use_cache=False."
        )
    dropout = self.attention_dropout if self.training else 0.0
    check_model(self.config, state, hidden_states.shape[1] * state.sp_size)
    check_call(self, dropout, kwargs)
    kwargs = with_model_documents(kwargs, self)
    if isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            "The fused UPipe path got a prepared attention mask tensor under sequence "
            "parallelism; pass a 2-D padding mask (right padding) or none."
        )
    if getattr(attention_mask, "chunk", None) is not None:
        raise NotImplementedError(
            "chunked attention is not implemented by the fused UPipe block; prepare the model "
            "with UPipeConfig(fused_attention=False)."
        )
    return kwargs


def _call_kernel(self, arch, state, hidden_states, attention_mask, kwargs: dict):
    """The attention kernel of this call: the batch's layout validated (a collective), packed rows inside each
    document, then the ring or the sliding window."""
    B, s, _ = hidden_states.shape
    kernel = state.kernel
    if not is_fake(hidden_states):
        if not validate_layout(
            state,
            kwargs.get("position_ids"),
            attention_mask,
            B,
            s,
            hidden_states.device,
            kwargs.get(CU_SEQLENS),
            hidden_states.dtype,
            not keeps_documents_apart(self.config),
        ):
            kwargs = without_documents(
                kwargs
            )  # the model's mask ignores them (see validate_layout)
        # packed rows: the kernel runs inside each document (DocumentKernel), like the registered path
        kernel = sp_kernel(
            state, kwargs, hidden_states.device, hidden_states.dtype, s * state.sp_size
        )
    call_window = getattr(self, "sliding_window", None)
    if call_window is None and arch.window_in_config:
        call_window = getattr(self.config, "sliding_window", None)
    window = sp_window(attention_mask, call_window, s * state.sp_size, self)
    if (
        state.ring_size > 1
    ):  # ring attention: plain causal attention only (packed rows were refused above)
        return ring_kernel(state, kernel, hidden_states.device, hidden_states.dtype, window=window)
    if not is_fake(
        hidden_states
    ):  # (a simulation runs the unwindowed kernel: see upipe_attention_forward)
        return window_kernel(
            kernel,
            window,
            kwargs.get(CU_SEQLENS),
            hidden_states.device,
            hidden_states.dtype,
        )
    return kernel


def _autocast_other_dtype(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Autocast to a dtype other than the module's weights' (bf16 autocast over an fp32 model, as the Trainer's
    `bf16=True` runs one): the fused block computes in its inputs' dtype and does not autocast its own products, so
    the call takes the registered "upipe" path, where transformers' projections autocast as they do on one device.
    Logged once."""
    device = hidden_states.device.type
    if not torch.is_autocast_enabled(device):
        return False
    weight = next(module.parameters(), None)
    if weight is None or weight.dtype == torch.get_autocast_dtype(device):
        return False
    if not _AUTOCAST_SAID:
        _AUTOCAST_SAID.append(True)
        logger.info(
            "hf_upipe: under %s autocast over %s weights the attention takes the registered 'upipe' path, "
            "not the fused block (load the model in %s to use it)",
            torch.get_autocast_dtype(device),
            weight.dtype,
            torch.get_autocast_dtype(device),
        )
    return True


_AUTOCAST_SAID: list[bool] = []
