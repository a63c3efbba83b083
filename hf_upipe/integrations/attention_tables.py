"""Models that pick their attention class from their own table refuse `attn_implementation="upipe"` by name.

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

from torch import nn

from hf_upipe.architectures import ARCHITECTURES
from hf_upipe.verification import TESTED_RANGE

__all__ = ["OwnAttentionTable", "attention_tables", "install"]

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
