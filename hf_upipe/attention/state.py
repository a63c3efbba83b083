"""The state the "upipe" attention paths run under, and the checks of a model and of one attention call that need
no communication (the same verdict on every rank: same model, same arguments).

Entry points:
- `active_state()`: the installed sequence-parallel state when SP is on (more than one rank), else None; inside
  `local_sequence_parallel()`, a state of one rank of its own (the adapters' behaviour checks).
- `check_model(config, state, seq_len=None)`: the support gate (`hf_upipe.adapters.support`) for a model.
- `check_call(module, dropout, kwargs, handled=())`: causal attention, no attention weights, no dropout, no
  argument of `UNIMPLEMENTED_ARGUMENTS` but the `handled` ones (`SINK_ARGUMENTS`: implemented under SP).
- `attention_override(fn)` / `attention_overridden()`: a context in which the "upipe" attention function returns
  `fn(module, query, key, value, attention_mask, **kwargs)` instead (and the fused block takes the registered
  path, so that its layers reach `fn` too); `hf_upipe.generation` records a shard's keys and values and attends to
  them while decoding with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Callable

from hf_upipe.adapters.call_checks import refuse_collected_attentions
from hf_upipe.adapters.support import config_refusal, refusal_error, sdpa_refusal
from hf_upipe.distributed import SequenceParallelState, get_sequence_parallel_state

__all__ = [
    "TensorCache",
    "SINK_ARGUMENTS",
    "UNIMPLEMENTED_ARGUMENTS",
    "active_state",
    "attention_override",
    "attention_overridden",
    "check_call",
    "check_model",
    "local_sequence_parallel",
]


class TensorCache:
    """tensor -> value, by the tensor's identity, holding the tensor weakly (an entry dies with its tensor).
    (`weakref.WeakKeyDictionary` compares keys with `==`, which is elementwise for tensors.)"""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, tensor):
        entry = self._entries.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def set(self, tensor, value) -> None:
        key = id(tensor)
        self._entries[key] = (
            weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)),
            value,
        )


def active_state() -> SequenceParallelState | None:
    """The installed sequence-parallel state when it has more than one rank (SP on), else None."""
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
    """Inside, the "upipe" attention function returns `fn(module, query, key, value, attention_mask, dropout=,
    scaling=, sliding_window=, **kwargs)` (None: its own path again, e.g. from inside `fn`)."""
    token = _OVERRIDE.set(fn)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def attention_overridden() -> Callable | None:
    """The function of the innermost `attention_override`, or None (the fused block then takes the registered
    path)."""
    return _OVERRIDE.get()


@contextlib.contextmanager
def local_sequence_parallel(heads_per_chunk: int = 1):
    """Inside, the SP paths run as on one rank of its own (no process group, no collective): a behaviour check of
    an adapter (`hf_upipe.models.verification`) compares them with transformers' own code in this process. Use it inside
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


# attention arguments "upipe" does not implement: refused with and without SP rather than dropped
UNIMPLEMENTED_ARGUMENTS = ("softcap", "s_aux", "sinks", "position_bias", "alibi", "attention_bias")
SINK_ARGUMENTS = (
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
    """The support gate (`hf_upipe.adapters.support`) for a model of `config`: under SP (`state`), a verified
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
    arguments): causal attention, no attention weights requested, no dropout, no argument of
    `UNIMPLEMENTED_ARGUMENTS` other than the `handled` ones."""
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
    for name in UNIMPLEMENTED_ARGUMENTS:
        if kwargs.get(name) is not None and name not in handled:
            raise NotImplementedError(
                f"the model passes '{name}' to its attention, which 'upipe' does not implement "
                "(the result would silently drop it)."
            )
