"""Old module paths, kept until `REMOVED_IN`: one table, served by an import hook instead of a file per path.

An old path imports as the module that now holds its code, with a DeprecationWarning naming the new path:
`sys.modules[old]` is the new module itself (every name, private ones too, and a monkeypatch of the old path
reaches the new module). The two dissolved packages, `hf_upipe.integrations` and `hf_upipe.memory`, import as
empty packages (the second with the four names it used to re-export) whose submodules resolve through the table.

Entry points:
- `MOVED`: old dotted path -> new dotted path; `OLD_PACKAGES`: the dissolved packages and the names each
  re-exports; `REMOVED_IN`: the release that deletes them and this module.
- `install()`: put the hook first on `sys.meta_path` (`import hf_upipe` does; a second call does nothing).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "OLD_PACKAGES", "REMOVED_IN", "install"]

REMOVED_IN = "0.3.0"

MOVED = {
    "hf_upipe.trainer": "hf_upipe.training.trainer",
    "hf_upipe.checkpoint": "hf_upipe.training.checkpoint",
    "hf_upipe.selftest": "hf_upipe.tools.selftest",
    "hf_upipe.memory.offload": "hf_upipe.training.offload",
    "hf_upipe.integrations.peft": "hf_upipe.models.peft",
    "hf_upipe.integrations.model_offload": "hf_upipe.training.model_offload",
    "hf_upipe.integrations.attention_tables": "hf_upipe.attention.registered",
    "hf_upipe.integrations.accelerate": "hf_upipe.training.plugin",
    "hf_upipe.planning.no_fit": "hf_upipe.planning.plan_command",
    "hf_upipe.planning.alloc_trace": "hf_upipe.planning.reserved",
    "hf_upipe.planning.caching_allocator": "hf_upipe.planning.reserved",
    "hf_upipe.trl.dpo_config": "hf_upipe.trl.dpo",
    "hf_upipe.trl.grpo_config": "hf_upipe.trl.grpo",
}

# dissolved package -> (where its code went, {name it re-exports: module that defines it})
OLD_PACKAGES = {
    "hf_upipe.integrations": (
        "hf_upipe.models, hf_upipe.adapters, hf_upipe.attention, hf_upipe.training and hf_upipe.prepare "
        "(docs/architecture.md)",
        {},
    ),
    "hf_upipe.memory": (
        "hf_upipe.adapters.tiled_mlp and hf_upipe.training.offload",
        {
            "apply_tiled_mlp": "hf_upipe.adapters.tiled_mlp",
            "remove_tiled_mlp": "hf_upipe.adapters.tiled_mlp",
            "tiled_mlp": "hf_upipe.adapters.tiled_mlp",
            "offload_checkpoints": "hf_upipe.training.offload",
        },
    ),
}


def _warn(old: str, new: str) -> None:
    # stacklevel 3 is the importing frame (above exec_module): the warnings module skips importlib's frames
    warnings.warn(
        f"{old} moved to {new}; the old path is removed in hf_upipe {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=3,
    )


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of the table and loads each as its new module (or as an old, empty package)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED and fullname not in OLD_PACKAGES:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname in OLD_PACKAGES)

    def create_module(self, spec):
        return None  # a plain module: exec_module fills an old package, or puts the new module in its place

    def exec_module(self, module):
        old = module.__name__
        if old in OLD_PACKAGES:
            where, names = OLD_PACKAGES[old]
            _warn(old, where)
            module.__doc__ = f"Dissolved package, kept until hf_upipe {REMOVED_IN}: see {where}."
            module.__all__ = sorted(names)
            for name, home in names.items():
                setattr(module, name, getattr(importlib.import_module(home), name))
            return
        _warn(old, MOVED[old])
        # the import system returns what sys.modules holds after exec_module: the new module itself
        sys.modules[old] = importlib.import_module(MOVED[old])


def install() -> None:
    """See the module docstring."""
    if not any(type(f).__name__ == _OldPaths.__name__ for f in sys.meta_path):
        # first, so that the table wins over a stale copy of an old file (an older install, an editable one)
        sys.meta_path.insert(0, _OldPaths())
