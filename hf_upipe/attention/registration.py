"""`attn_implementation="upipe"` registered with transformers by `import hf_upipe`, without importing transformers.

Entry point:
- `register_with_transformers()`: registers now if transformers' modeling code (`transformers.modeling_utils`, where
  `AttentionInterface` and `from_pretrained` live) is already loaded; otherwise registers the moment it finishes
  loading, through a one-shot import hook. Either way "upipe" is in transformers' registries before any model can
  be built, and `import hf_upipe` (or `import hf_upipe.ops`) costs no transformers import.

The hook is a `sys.meta_path` finder that answers for `transformers.modeling_utils` only: it asks the other finders
for the real module spec, removes itself, and wraps that spec's loader so that `register()` runs right after the
module has executed. `hf_upipe.attention.registered` registers as the last statement of its own import too (the
hook can fire while that module is importing transformers), and its `register()` is idempotent.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["register_with_transformers"]

_TRIGGER = "transformers.modeling_utils"


def _register() -> None:
    module = importlib.import_module("hf_upipe.attention.registered")
    if hasattr(module, "register"):
        module.register()
    # else: that module is being imported right now (it imports transformers, which fired the hook) and registers
    # itself as its last statement


class _LoaderThenRegister(importlib.abc.Loader):
    """The real loader of `transformers.modeling_utils`, then `_register()`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """One-shot finder: hands out the real spec of `transformers.modeling_utils` with a registering loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenRegister(spec.loader)
        return spec


def register_with_transformers() -> None:
    """See the module docstring."""
    if _TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
