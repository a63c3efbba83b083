"""The documentation stays true to the code.

- Every `hf_upipe.*` dotted name quoted in a Markdown file of the repository or in a docstring of `hf_upipe/`
  imports (a module) or is an attribute of one (a function, a class, a class's method or dataclass field).
- Every repository path quoted there (`hf_upipe/...`, `examples/...`, `benchmarks/...`, `docs/...`,
  `accelerate_configs/...`, `tests/...`, `.ci/...`, and `ops/`, `integrations/`, `planning/`, `memory/`, `trl/`
  inside `hf_upipe/`; a module may be quoted without its `.py`, a `<placeholder>` stands for any name) exists,
  and every relative Markdown link points to a file.
- Every command in a shell code block of the README and of `docs/` and `benchmarks/README.md` parses: its script
  or module exists, and each `--flag` it passes is one its parser declares (what `--help` lists), for
  `python script.py`, `python -m module`, `accelerate launch [its flags] script.py` and `hf-upipe <command>`.

Names and parsers are resolved in one child process (scripts' `main` runs up to its `parse_args`, which is
intercepted), so nothing the scripts import or set leaks into the test process.
"""

import ast
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script names a command block shows as a stand-in for the user's own
PLACEHOLDER_SCRIPTS = {"your_script.py"}


def _markdown_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every Markdown file
        out = [
            os.path.relpath(p, ROOT)
            for p in glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True)
        ]
    return sorted(p for p in out if os.path.exists(os.path.join(ROOT, p)))


def _docstrings() -> list[tuple[str, str]]:
    """(where, text) of every module, class and function docstring of hf_upipe/."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "hf_upipe", "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    found.append((f"{rel}:{getattr(node, 'lineno', 1)}", text))
    return found


def _texts() -> list[tuple[str, str]]:
    texts = []
    for rel in _markdown_files():
        with open(os.path.join(ROOT, rel)) as f:
            texts.append((rel, f.read()))
    return texts + _docstrings()


NAME = re.compile(r"(?<![\w./-])hf_upipe(?:\.[A-Za-z_]\w*)+")
ROOTS = r"hf_upipe|examples|benchmarks|docs|accelerate_configs|tests|\.ci"
INNER = r"ops|models|adapters|attention|training|tools|planning|trl"  # folders of hf_upipe/, quoted without it
PATH = re.compile(rf"(?<![\w./-])((?:{ROOTS}|{INNER})/(?:[\w.*{{}},/-]|<[\w-]+>)*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _names() -> dict[str, list[str]]:
    """dotted name -> where it is quoted."""
    names = {}
    for where, text in _texts():
        for m in NAME.finditer(text):
            names.setdefault(m.group(0), []).append(where)
    return names


def _expand(path: str) -> list[str]:
    """`a.{json,png}` -> `a.json`, `a.png`."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        p
        for alt in m.group(1).split(",")
        for p in _expand(path[: m.start()] + alt + path[m.end() :])
    ]


def _path_exists(path: str) -> bool:
    path = re.sub(r"<[\w-]+>", "*", path)  # a placeholder: some file matches
    top = path.split("/")[0]
    if re.fullmatch(INNER, top):
        path = "hf_upipe/" + path
    return all(
        glob.glob(os.path.join(ROOT, p))
        if "*" in p
        else os.path.exists(os.path.join(ROOT, p)) or os.path.exists(os.path.join(ROOT, p + ".py"))
        for p in _expand(path)
    )


def test_every_quoted_repository_path_and_link_exists():
    missing = []
    for where, text in _texts():
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".,:;")
            if not _path_exists(path):
                missing.append(f"{where}: {path}")
        if where.endswith(".md"):
            for m in LINK.finditer(text):
                target = m.group(1).split("#")[0]
                if not target or re.match(r"[a-z]+:", target):  # an anchor, a URL
                    continue
                if not os.path.exists(os.path.join(ROOT, os.path.dirname(where), target)):
                    missing.append(f"{where}: link {target}")
    assert not missing, "quoted paths that do not exist:\n" + "\n".join(missing)


# --------------------------------------------------------------------------------- commands


def _command_blocks() -> list[tuple[str, str]]:
    files = ["README.md", "benchmarks/README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    blocks = []
    for rel in files:
        with open(os.path.join(ROOT, rel)) as f:
            text = f.read()
        for m in re.finditer(r"```(bash|sh|shell)\n(.*?)```", text, re.S):
            blocks.append((rel, m.group(2)))
    return blocks


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command of the shell blocks: continuations joined, comments dropped, split at
    `&&`, `||`, `|`, `;`; leading `VAR=value` assignments and optional-argument brackets removed."""
    commands = []
    for where, block in _command_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            argv = []
            for token in list(lexer) + [";"]:
                if token in (";", "&&", "||", "|"):
                    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                        argv.pop(0)
                    if argv:
                        commands.append((where, argv))
                    argv = []
                else:
                    token = token.strip("[]")
                    if token and token != "...":
                        argv.append(token)
    return commands


def _targets(argv: list[str]) -> tuple[str, str | None, list[str], list[str]]:
    """(kind, target, flags for the target, flags for the launcher) of one command; kind: script, module, cli,
    file (a shell script: it must exist), skip."""
    flags = [a.split("=")[0] for a in argv if a.startswith("--")]
    if argv[0] in ("pip", "ruff"):  # other tools' own commands
        return "skip", None, [], []
    if argv[0] == "bash":
        return "file", argv[1], [], []
    if argv[0] in ("python", "python3"):
        if argv[1] == "-m":
            return "module", argv[2], [f for f in flags], []
        return "script", argv[1], flags, []
    if argv[0] == "hf-upipe":
        return "cli", argv[1], flags, []
    if argv[:2] == ["accelerate", "launch"]:
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        before = [a.split("=")[0] for a in argv[2:script] if a.startswith("--")]
        after = [a.split("=")[0] for a in argv[script + 1 :] if a.startswith("--")]
        return "script", argv[script], after, before
    raise AssertionError(f"a command the docs-truth test does not know how to check: {argv}")


# The child: resolve names, collect parsers' flags. Prints one JSON object.
_CHILD = r"""
import argparse, importlib, importlib.util, json, os, runpy, sys
request = json.loads(sys.argv[1])

class _Got(Exception):
    pass

def _flags(parser):
    return sorted(s for a in parser._actions for s in a.option_strings)

def _resolve(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name and not ".".join(parts[:cut]).startswith(err.name):
                return f"import fails: {err}"
            continue
        for attr in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {})
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif attr in fields or attr in getattr(obj, "__annotations__", {}):
                obj = None
            else:
                return f"{'.'.join(parts[:cut])} has no {attr!r} (in {name})"
        return None
    return "no such module"

def _intercepted(run):
    real = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    def grab(self, *a, **k):
        raise _Got(self)
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
    try:
        run()
    except _Got as got:
        return _flags(got.args[0])
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real
    return "never parses arguments"

out = {"names": {n: _resolve(n) for n in request["names"]}, "scripts": {}, "modules": {}, "cli": {}}
argv0 = list(sys.argv)
for path in request["scripts"]:
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    out["scripts"][path] = _intercepted(lambda: runpy.run_path(path, run_name="__main__"))
    sys.path.pop(0)
for name in request["modules"]:
    if not name.startswith("hf_upipe"):
        out["modules"][name] = None if importlib.util.find_spec(name) else "not importable"
        continue
    sys.argv = [name]
    out["modules"][name] = _intercepted(lambda: runpy.run_module(name, run_name="__main__"))
sys.argv = argv0
if request["cli"]:
    from hf_upipe.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out["cli"] = {c: _flags(sub.choices[c]) if c in sub.choices else "no such command"
                  for c in request["cli"]}
if request["accelerate"]:
    from accelerate.commands.launch import launch_command_parser
    out["accelerate"] = _flags(launch_command_parser())
print("\n" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def resolved():
    request = {"names": sorted(_names()), "scripts": [], "modules": [], "cli": []}
    request["accelerate"] = False
    for _, argv in _commands():
        kind, target, _, _ = _targets(argv)
        key = {"script": "scripts", "module": "modules", "cli": "cli"}.get(kind)
        missing = kind == "script" and not os.path.exists(os.path.join(ROOT, target))
        if key and target not in request[key] and not missing:
            request[key].append(target)
        request["accelerate"] |= argv[:2] == ["accelerate", "launch"]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(request)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_quoted_hf_upipe_name_resolves(resolved):
    names = _names()
    bad = [
        f"{name}: {why} (quoted in {', '.join(sorted(set(names[name]))[:3])})"
        for name, why in resolved["names"].items()
        if why
    ]
    assert not bad, "hf_upipe names that do not resolve:\n" + "\n".join(bad)


def test_every_documented_command_parses(resolved):
    bad = []
    for where, argv in _commands():
        kind, target, flags, launcher = _targets(argv)
        if kind == "skip" or target in PLACEHOLDER_SCRIPTS:
            accepted = []
        elif kind == "file":
            accepted = [] if os.path.exists(os.path.join(ROOT, target)) else "does not exist"
        elif kind == "script":
            if not os.path.exists(os.path.join(ROOT, target)):
                bad.append(f"{where}: {target} does not exist")
                continue
            accepted = resolved["scripts"][target]
        elif kind == "module":
            accepted = resolved["modules"][target]
            if target == "pytest" and accepted is None:
                accepted, flags = [], []  # pytest's own flags: pytest checks them
        else:
            accepted = resolved["cli"][target]
        if isinstance(accepted, str):
            bad.append(f"{where}: {target}: {accepted}")
            continue
        bad += [f"{where}: {target} takes no {f}" for f in flags if f not in accepted]
        bad += [
            f"{where}: accelerate launch takes no {f}"
            for f in launcher
            if f not in resolved.get("accelerate", [])
        ]
    assert not bad, "commands in the docs that do not parse:\n" + "\n".join(bad)


def test_the_command_parser_finds_the_readme_commands():
    """The checks above see the README's commands (a parser that found nothing would pass vacuously)."""
    kinds = {_targets(argv)[:2] for where, argv in _commands() if where == "README.md"}
    assert ("script", "examples/finetune_long_context.py") in kinds
    assert ("cli", "plan") in kinds
    assert ("module", "pytest") in kinds


def test_each_layer_folder_names_each_of_its_modules():
    import importlib

    unnamed = []
    for name in ("models", "adapters", "attention", "training", "tools"):
        package = importlib.import_module(f"hf_upipe.{name}")
        folder = os.path.dirname(package.__file__)
        modules = sorted(
            f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"
        )
        unnamed += [f"{name}/{m}" for m in modules if f"``{m}``" not in package.__doc__]
    assert not unnamed, f"the folder's __init__.py does not name: {unnamed}"


def test_the_support_table_of_docs_models_is_generated():
    """docs/models.md's table is `benchmarks/support_table.py`'s output from the committed matrix JSON."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "support_table", os.path.join(ROOT, "benchmarks", "support_table.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    reports = script.reports()
    assert len(reports) >= 1 and all(r["summary"]["decoder_only_tiny"] for r in reports)
    with open(script.PAGE) as f:
        page = f.read()
    assert script.render(page) == page, "docs/models.md: run python benchmarks/support_table.py"
    for r in reports:  # the table says which releases it holds for
        assert f"SP 2, transformers {r['transformers']}" in page
