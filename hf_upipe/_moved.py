"""Old module paths kept for one release, each re-exporting the module that now holds its code.

Entry point:
- `alias(old, new)`: the one statement of a deprecated module: a DeprecationWarning naming the new path, then
  `sys.modules[old]` becomes the module `new` itself (every name, private ones too, and a monkeypatch of the old
  path reaches the new module).
"""

import importlib
import sys
import warnings

__all__ = ["alias"]


def alias(old: str, new: str) -> None:
    """See the module docstring."""
    warnings.warn(
        f"{old} moved to {new}; the old path re-exports it for one release.",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
