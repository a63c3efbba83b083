"""The package's layers import only downward, with no circles, and `import hf_upipe` stays light.

Layers, bottom to top (a module may import its own layer and the layers below); each folder of hf_upipe/ is one
row:
  0 ops/ (pure torch, no transformers) and the bottom helpers: units, batch_keys, rank_layout, console_log, exits
  1 models/: what hf_upipe knows of transformers models (registry, families, verification, probes, PEFT, presets)
  2 settings, their agreement and the SP state: config, allocator, agreement, distributed
  3 data, vlm: shards of a batch
  4 adapters/: what prepare_model installs on a model's modules, the support gate, the global hooks
  5 attention/: "upipe" inside transformers (state, mask, layout, kernel, registered, fused, registration)
  6 prepare, generation: prepare_model / unprepare_model; generation under SP
  7 training/: runtime, trainer, plugin and what they use (loss, loaders, offload, checkpoints, ...)
  8 trl/: TRL's trainers on UPipeTrainer
  9 planning/, tools/, cli (on top: they may import anything)
 Old module paths have no files: `hf_upipe/_moved.py`'s table serves them until its release; nothing imports them.
Every import statement counts, also those inside functions (a lazy import is still a dependency).
"""

import ast
import os
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hf_upipe")

LAYERS = [
    (
        "hf_upipe.ops",
        "hf_upipe.units",
        "hf_upipe.batch_keys",
        "hf_upipe.rank_layout",
        "hf_upipe.console_log",
        "hf_upipe.exits",
        "hf_upipe._moved",
    ),
    ("hf_upipe.models",),
    ("hf_upipe.config", "hf_upipe.allocator", "hf_upipe.agreement", "hf_upipe.distributed"),
    ("hf_upipe.data", "hf_upipe.vlm"),
    ("hf_upipe.adapters",),
    ("hf_upipe.attention",),
    ("hf_upipe.prepare", "hf_upipe.generation", "hf_upipe.generation_cache"),
    ("hf_upipe.training",),
    ("hf_upipe.trl",),
    ("hf_upipe.planning", "hf_upipe.tools", "hf_upipe.cli", "hf_upipe.__init__"),
]
RUNTIME = tuple(p for row in LAYERS[:8] for p in row)


def _modules() -> dict[str, set[str]]:
    """module name -> hf_upipe modules it imports (anywhere in the file)."""
    graph = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            module = (
                rel[: -len(".__init__")]
                if rel.endswith(".__init__") and rel != "hf_upipe.__init__"
                else rel
            )
            deps = set()
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.startswith("hf_upipe")}
                elif (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("hf_upipe")
                ):
                    deps.add(node.module)
                    deps |= {f"{node.module}.{a.name}" for a in node.names}
            graph[module] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def _layer(module: str) -> int:
    """The layer of the longest prefix in LAYERS that names `module` (or a package containing it)."""
    matches = [
        (len(p), i)
        for i, prefixes in enumerate(LAYERS)
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def test_every_import_goes_down_or_sideways():
    graph = _modules()
    bad = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in graph.items()
        for d in deps
        if _layer(d) > _layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_no_runtime_module_imports_the_planner():
    graph = _modules()
    bad = [
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith(RUNTIME)
        for d in deps
        if d.startswith(("hf_upipe.planning", "hf_upipe.tools.selftest", "hf_upipe.cli"))
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    graph = _modules()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # a package's __init__ re-exporting its own submodules is not a circle of code
    cycles = [c for c in cycles if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_across_modules():
    bad = []
    for folder, _, files in os.walk(PACKAGE):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("hf_upipe")
                ):
                    bad += [
                        f"{os.path.relpath(path, ROOT)}: {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_")
                    ]
    assert not bad, "\n".join(bad)


def test_the_plugin_and_the_trainer_are_the_two_faces_of_the_runtime():
    """UPipePlugin and UPipeTrainer sit side by side in training/, both on the runtime."""
    graph = _modules()
    assert "hf_upipe.training.runtime" in graph["hf_upipe.training.plugin"]
    assert "hf_upipe.training.runtime" in graph["hf_upipe.training.trainer"]
    assert "hf_upipe.training.plugin" not in graph["hf_upipe.training.trainer"]
    assert "hf_upipe.training.trainer" not in graph["hf_upipe.training.plugin"]


def test_nothing_imports_a_deprecated_path():
    """No package module imports an old path of `hf_upipe._moved`'s table, and no old path has a file."""
    from hf_upipe._moved import MOVED, OLD_PACKAGES

    old = (*MOVED, *OLD_PACKAGES)

    def is_old(name: str) -> bool:
        return any(name == o or name.startswith(o + ".") for o in old)

    bad = []
    for folder, _, files in os.walk(PACKAGE):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            if is_old(module):
                bad.append(f"{module} is an old path: the table serves it")
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                bad += [f"{module} imports {n}" for n in names if is_old(n)]
    assert not bad, "\n".join(bad)


def test_the_old_module_paths_warn_and_are_the_new_modules():
    """Each documented old path gives the module that now holds the code, with a DeprecationWarning."""
    code = "\n".join(
        [
            "import importlib, warnings",
            "warnings.simplefilter('error', DeprecationWarning)",
            "pairs = %r" % (OLD_PATHS,),
            "import hf_upipe",
            "out = []",
            "for old, new in pairs:\n"
            "    try:\n        importlib.import_module(old); out.append('silent ' + old)\n"
            "    except DeprecationWarning: out.append('warned')",
            "print(sorted(set(out)))",
        ]
    )
    assert _python(code) == "['warned']"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import importlib

        import hf_upipe

        for old, new in OLD_PATHS:
            module = importlib.import_module(old)
            assert module is importlib.import_module(new), old
        from hf_upipe.integrations.accelerate import UPipePlugin
        from hf_upipe.memory import apply_tiled_mlp, offload_checkpoints

    assert UPipePlugin is hf_upipe.UPipePlugin
    assert offload_checkpoints.__module__ == "hf_upipe.training.offload"
    assert apply_tiled_mlp.__module__ == "hf_upipe.adapters.tiled_mlp"


OLD_PATHS = [
    ("hf_upipe.trainer", "hf_upipe.training.trainer"),
    ("hf_upipe.checkpoint", "hf_upipe.training.checkpoint"),
    ("hf_upipe.selftest", "hf_upipe.tools.selftest"),
    ("hf_upipe.memory.offload", "hf_upipe.training.offload"),
    ("hf_upipe.integrations.peft", "hf_upipe.models.peft"),
    ("hf_upipe.integrations.model_offload", "hf_upipe.training.model_offload"),
    ("hf_upipe.integrations.attention_tables", "hf_upipe.attention.registered"),
    ("hf_upipe.integrations.accelerate", "hf_upipe.training.plugin"),
    ("hf_upipe.planning.no_fit", "hf_upipe.planning.plan_command"),
    ("hf_upipe.planning.alloc_trace", "hf_upipe.planning.reserved"),
    ("hf_upipe.planning.caching_allocator", "hf_upipe.planning.reserved"),
]


def test_the_batch_keys_have_one_home():
    """The packed rows' batch keys are spelled once, in hf_upipe/batch_keys.py; code elsewhere uses its names."""
    from hf_upipe.batch_keys import DOCUMENT_KEYS

    bad = []
    for folder, _, files in os.walk(PACKAGE):
        for name in (f for f in files if f.endswith(".py") and f != "batch_keys.py"):
            path = os.path.join(folder, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            bad += [
                f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in DOCUMENT_KEYS
            ]
    assert not bad, "use hf_upipe.batch_keys instead of:\n" + "\n".join(bad)


def _python(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


HEAVY = ("transformers", "accelerate", "peft", "datasets", "hf_upipe.planning")


def test_imports_stay_light_and_upipe_is_registered_when_transformers_loads():
    """One fresh process: the light imports first, each checked, then transformers, which registers "upipe"."""
    code = "; ".join(
        [
            "import sys",
            "loaded = lambda: sorted(m for m in %r if m in sys.modules)" % (HEAVY,),
            "import hf_upipe.ops",
            "print('ops', loaded())",
            "import hf_upipe",
            "print('hf_upipe', loaded())",
            "import hf_upipe.adapters.tiled_mlp, hf_upipe.training.offload, hf_upipe.data, hf_upipe.config",
            "import hf_upipe.distributed, hf_upipe.models.architectures",
            "print('memory', loaded())",
            "from transformers import AutoModelForCausalLM",
            "import transformers.modeling_utils as m",
            "print('registered', 'upipe' in m.AttentionInterface._global_mapping)",
            "from hf_upipe import UPipeTrainer",
            "print('trainer', 'hf_upipe.planning' in sys.modules)",
        ]
    )
    assert _python(code).splitlines() == [
        "ops []",
        "hf_upipe []",
        "memory []",
        "registered True",
        "trainer False",
    ]


def test_upipe_is_registered_when_transformers_was_loaded_first():
    code = (
        "import transformers.modeling_utils as m; import hf_upipe; "
        "print('upipe' in m.AttentionInterface._global_mapping)"
    )
    assert _python(code) == "True"
