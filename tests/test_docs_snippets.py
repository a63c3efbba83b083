"""Every Python block of `docs/*.md` runs as written, on the README's CPU set-up.

A page's Python blocks are one program, run in order in a fresh folder: with `torchrun --nproc_per_node N` when one
of its blocks says so in a comment (`# torchrun --nproc_per_node 2 ...`), else with `python`. It must exit with 0,
print no warning (`...Warning`, DDP's `Warning:`) and print the log lines its page promises (`PROMISED`). A block
that cannot run there (GPUs, more ranks, a downloaded model) carries a marker on the line above its fence,
`<!-- fragment: why -->`; it must still parse, and such blocks stay few (`MAX_FRAGMENTS`).

The fast tier checks the markers and that every block parses; the slow tier runs the pages.
"""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(?:<!-- fragment: (?P<why>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
LAUNCH = re.compile(r"^# torchrun --nproc_per_node (\d+) ", re.M)
WARNING = re.compile(r"\b\w*Warning\b|Warning:")
MAX_FRAGMENTS = 4
PROMISED = {
    "docs/trl.md": "UPipeSFTTrainer: TRL's fused LM head (chunked log-probabilities) is replaced by hf_upipe's "
    "tiled loss",
}


def _blocks() -> dict[str, list[tuple[int, str, str | None]]]:
    """page -> [(line, code, fragment reason or None)], every page of docs/ with a Python block."""
    pages = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        found = [
            (text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("why"))
            for m in BLOCK.finditer(text)
        ]
        if found:
            pages[os.path.relpath(path, ROOT)] = found
    return pages


def _runnable_pages() -> list[str]:
    return [page for page, blocks in _blocks().items() if any(why is None for *_, why in blocks)]


def test_every_block_parses_and_fragments_say_why():
    pages = _blocks()
    assert len(pages) >= 8, sorted(pages)  # the extraction found the docs' blocks
    fragments = []
    for page, blocks in pages.items():
        for line, code, why in blocks:
            ast.parse(code, filename=f"{page}:{line}")
            if why is not None:
                assert len(why.split()) >= 3, f"{page}:{line}: say why the block cannot run"
                fragments.append(f"{page}:{line}")
    assert len(fragments) <= MAX_FRAGMENTS, fragments
    assert set(PROMISED) <= set(_runnable_pages())


@pytest.mark.slow
@pytest.mark.parametrize("page", _runnable_pages())
def test_the_page_runs_as_written(page, tmp_path):
    code = "\n".join(code for _, code, why in _blocks()[page] if why is None)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    launches = {int(n) for n in LAUNCH.findall(code)}
    assert len(launches) <= 1, f"{page}: one launch line per page"
    if launches:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", str(*launches), str(script)]
    else:
        cmd = [sys.executable, str(script)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    warnings = [line for line in out.splitlines() if WARNING.search(line)]
    assert not warnings, "\n".join(warnings)
    if page in PROMISED:
        assert out.count(PROMISED[page]) == 1, out[-4000:]  # once: from the first rank
