"""`hf-upipe selftest` fits the machine it runs on: a reduced copy of the user's architecture by default (what the
sequence-parallel path depends on kept), the full size on request and refused with the numbers when the free
memory cannot hold it, and a rank that dies ends the run quickly with its own exit status
(`hf_upipe.tools.selftest_size`,
`hf_upipe.tools.testing`)."""

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest

from hf_upipe.cli import main
from hf_upipe.tools.selftest_size import (
    GIB,
    RANK_BASE,
    RunShape,
    available_memory,
    memory_needed,
    parameter_count,
    reduced_config,
)

# Llama-3-8B's published config.json (no weights), with the dtype key a Hub config carries
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "vocab_size": 128256,
}


def _folder(tmp_path, config=LLAMA3_8B) -> str:
    folder = tmp_path / "llama3-8b-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def test_the_reduced_copy_of_an_8b_folder_keeps_the_geometry_sp_depends_on(tmp_path):
    full = _config(_folder(tmp_path))
    small, changes = reduced_config(full, RunShape(ranks=2))
    assert (
        full.num_hidden_layers == 32 and full.vocab_size == 128256
    )  # the user's config is not changed
    assert (small.head_dim, small.num_attention_heads, small.num_key_value_heads) == (
        128,
        8,
        2,
    )  # 4 per group
    assert (small.hidden_size, small.intermediate_size, small.num_hidden_layers) == (1024, 3584, 2)
    assert small.vocab_size == 1024 and small.bos_token_id is None and small.eos_token_id is None
    assert small.rope_parameters == full.rope_parameters and small.rms_norm_eps == full.rms_norm_eps
    assert "layers: 32 -> 2" in changes and "vocabulary: 128256 -> 1024" in changes
    # by hand: per layer q, o 1024 x 1024; k, v 1024 x 256; gate, up, down 1024 x 3584; 2 norms; embeddings and
    # the untied head 1024 x 1024 each; the final norm
    layer = 2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 3584 + 2 * 1024
    assert parameter_count(small) == 2 * layer + 2 * 1024 * 1024 + 1024
    assert parameter_count(full) == 8_030_261_248  # Llama-3-8B's published count
    # per rank: the process, 2 fp32 copies and their gradients, activations of 2 rows of 61 tokens
    acts = 4 * 122 * (2 * (34 * 1024 + 6 * 3584 + 2 * 8 * 61) + 4 * 1024)
    assert (
        memory_needed(parameter_count(small), small, RunShape(2))
        == RANK_BASE + 16 * 29365248 + acts
    )


@pytest.mark.parametrize(
    ("sp", "hpc", "heads"),
    [(2, 1, (8, 2)), (4, 1, (16, 4)), (8, 1, (32, 8)), (2, None, (8, 2)), (2, 4, (8, 2))],
)
def test_the_reduced_heads_keep_the_split_and_the_chunking(tmp_path, sp, hpc, heads):
    """Whole key-value groups, as few as keep the key-value heads split over the ranks (8 over 2, 4 or 8) and the
    heads-per-chunk valid."""
    small, _ = reduced_config(_config(_folder(tmp_path)), RunShape(ranks=sp, heads_per_chunk=hpc))
    assert (small.num_attention_heads, small.num_key_value_heads) == heads
    assert small.head_dim == 128 and small.hidden_size == heads[0] * 128


def test_replicated_key_value_heads_stay_replicated(tmp_path):
    """2 key-value heads on 4 ranks are replicated; the reduced copy's single group is replicated too."""
    config = dict(LLAMA3_8B, num_attention_heads=16, num_key_value_heads=2, hidden_size=2048)
    small, _ = reduced_config(_config(_folder(tmp_path, config)), RunShape(ranks=4))
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (8, 1, 128)


def test_hybrid_layer_patterns_and_moe_keep_every_kind_of_layer():
    from transformers import AutoConfig

    gemma = AutoConfig.for_model(
        "gemma3_text"
    )  # 5 sliding-window layers, then a global one, 26 layers
    small, _ = reduced_config(gemma, RunShape(ranks=2))
    assert small.layer_types == gemma.layer_types[:6] and set(small.layer_types) == set(
        gemma.layer_types
    )
    assert small.num_hidden_layers == 6 and small.sliding_window == gemma.sliding_window
    assert small.head_dim == gemma.head_dim and parameter_count(small) < 200e6

    nxt = AutoConfig.for_model(
        "qwen3_next"
    )  # 3 linear-attention layers, then a full one; 512 experts, top 10
    small, changes = reduced_config(nxt, RunShape(ranks=2))
    assert small.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (small.num_experts, small.num_experts_per_tok) == (4, 2)
    assert "routed experts: 512 -> 4" in changes

    deepseek = AutoConfig.for_model("deepseek_v3")  # 3 dense layers first, grouped routing (kept)
    small, _ = reduced_config(deepseek, RunShape(ranks=2))
    assert (small.first_k_dense_replace, small.num_hidden_layers) == (
        1,
        2,
    )  # a dense and an MoE layer
    assert small.n_routed_experts == deepseek.n_routed_experts
    assert small.qk_rope_head_dim == deepseek.qk_rope_head_dim


def test_an_architecture_that_refuses_narrower_widths_keeps_them(tmp_path, monkeypatch):
    """A model class that cannot be built with fewer heads (here: refused by a stand-in check) keeps its widths and
    is reduced in depth and vocabulary only."""
    import hf_upipe.tools.selftest_size as sizing

    count = sizing.parameter_count

    def strict(config):
        if config.num_attention_heads != 32:
            raise ValueError("this architecture needs its 32 heads")
        return count(config)

    monkeypatch.setattr(sizing, "parameter_count", strict)
    sized = sizing.size_model("x", _config(_folder(tmp_path)), RunShape(ranks=2))
    assert sized.changes == ("layers: 32 -> 2", "vocabulary: 128256 -> 1024")
    assert sized.config.num_attention_heads == 32 and sized.config.hidden_size == 4096


def test_full_size_is_refused_with_the_numbers_before_anything_is_built(tmp_path, capsys):
    start = time.monotonic()
    assert main(["selftest", "--model", _folder(tmp_path), "--full-size"]) == 3
    err = capsys.readouterr().err
    assert "8,030.3M parameters (full size)" in err and "nothing was built" in err, err
    needed = float(err.split("needs about ")[1].split(" GiB")[0])
    assert needed > 2 * 16 * 8.03e9 / GIB  # 2 ranks x 2 fp32 copies and their gradients
    available = float(err.split(" GiB available")[0].split("; ")[-1])
    assert abs(available - available_memory()[0] / GIB) < 0.3 * available + 1
    assert "Drop --full-size" in err
    assert time.monotonic() - start < 60


def test_a_reduced_copy_that_does_not_fit_is_refused_too(tmp_path, capsys, monkeypatch):
    import hf_upipe.tools.selftest as selftest

    monkeypatch.setattr(selftest, "available_memory", lambda: (2 * (1 << 30), "a 2 GiB machine"))
    assert main(["selftest", "--model", _folder(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert (
        "(reduced copy)" in err
        and "2.0 GiB available (a 2 GiB machine)" in err
        and "lower --sp" in err
    )


def test_free_memory_without_psutil_comes_from_proc_meminfo(monkeypatch):
    monkeypatch.setitem(
        __import__("sys").modules, "psutil", None
    )  # `import psutil` raises ImportError
    got, source = available_memory()
    assert source == "MemAvailable in /proc/meminfo"
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(got - kib * 1024) < 0.2 * kib * 1024 + (256 << 20)


@pytest.mark.slow
def test_an_8b_folder_passes_on_a_reduced_copy_in_under_two_minutes(tmp_path, capsys):
    start = time.monotonic()
    assert main(["selftest", "--model", _folder(tmp_path)]) == 0
    took = time.monotonic() - start
    out = capsys.readouterr().out
    assert "testing a reduced copy of its architecture" in out and "layers: 32 -> 2" in out
    assert "8 passed, 0 failed" in out
    assert took < 120, took


def _kill_rank(rank: int, after: float, killed: list) -> None:
    """SIGKILL the self-test's rank `rank` (a child of this process) `after` seconds after it started."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in multiprocessing.active_children():
            if p.name == f"hf_upipe-rank-{rank}" and p.pid:
                time.sleep(after)
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
                return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_rank_killed_as_by_the_oom_killer_ends_the_selftest_quickly_with_exit_4(tmp_path, capsys):
    """What the out-of-memory killer does to a rank: SIGKILL. The run ends within seconds of it (not after the
    10-minute collective timeout), naming the rank and the cause, with exit 4, not 1 (a numerical mismatch)."""
    killed = []
    thread = threading.Thread(target=_kill_rank, args=(1, 2.0, killed), daemon=True)
    thread.start()
    start = time.monotonic()
    code = main(["selftest", "--model", _folder(tmp_path)])
    took = time.monotonic() - start
    thread.join(timeout=5)
    err = capsys.readouterr().err
    assert killed and code == 4, (code, err)
    assert "rank 1 killed by signal 9 (SIGKILL): likely out of memory" in err and "(exit 4)" in err
    assert took < 90, took
