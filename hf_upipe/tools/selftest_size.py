"""What the self-test builds, sized to the machine it runs on: a reduced copy of the user's architecture by default,
the full size on request, and either one only when the machine's free memory holds it.

Entry points:
- `size_model(name, config, run)`: the `Sized` model the self-test's ranks build for one model: `config` reduced by
  `reduced_config` (or whole with `run.full_size`; an architecture that does not build narrower is reduced in depth
  and vocabulary only), its parameter count, and the memory the run needs.
- `reduced_config(config, run)`: (a copy of `config` at a size a CPU runs in seconds, the changes as
  "what: old -> new" strings). Same model type and every other key; what the sequence-parallel path depends on
  kept: head_dim, query heads per key-value head, whether the key-value heads are split over the ranks or
  replicated, the heads-per-chunk staging, every layer type of a per-layer list (hybrid `layer_types`: the
  shortest prefix holding each type), a dense and a sparse layer of an MoE, windows, RoPE and scalings.
  Reduced: layers, heads (whole key-value groups), hidden size (with the heads), intermediate sizes (with the
  hidden size), routed experts and experts per token (`EXPERTS`, `TOP_K`; not with grouped routing) and the
  vocabulary (`VOCAB`).
- `memory_needed(params, run)`: bytes the self-test's ranks need for a model of `params` parameters
  (`RunShape`: ranks, LoRA, sequence length, vocabulary, depth and widths for the activations).
- `available_memory()`: (bytes, source): psutil's `virtual_memory().available` when psutil is installed, else
  `MemAvailable` of /proc/meminfo, else (None, why).
- `check_fits(sized, run)`: raises `DoesNotFit` (a ValueError) naming the bytes needed and available.

The estimate, per rank: `RANK_BASE` (a Python process with torch, transformers, peft and a gloo group), two copies
of the model in fp32 (the one-device reference and the sequence-parallel model, `hf_upipe.tools.selftest`), the
gradients
of both (of the adapters only, with LoRA), and the activations of the reference's whole-sequence step (the larger of
the two). The run fits when all ranks together need at most `USABLE` of the memory available now: the machine's
other jobs keep the rest.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass

from hf_upipe.ops.head_layout import geometry_error, valid_heads_per_chunk

__all__ = [
    "DoesNotFit",
    "RunShape",
    "Sized",
    "available_memory",
    "check_fits",
    "memory_needed",
    "model_has_weights",
    "parameter_count",
    "reduced_config",
    "size_model",
]

VOCAB = 1024  # the reduced copy's vocabulary (its largest embedding and logits)
EXPERTS, TOP_K = 4, 2  # the reduced copy's routed experts and experts per token (at most)
RANK_BASE = 1 << 30  # bytes of one rank before any model: torch, transformers, peft, the gloo group
USABLE = 0.8  # the share of the available memory a run may take
GIB = float(1 << 30)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
_WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


class DoesNotFit(ValueError):
    """The self-test's model does not fit the memory available; the message names both numbers."""


@dataclass(frozen=True)
class RunShape:
    """The self-test run a model is sized for: `ranks` processes on this machine, `heads_per_chunk` (None: all),
    `ring` shards, LoRA or not, `seq_len` tokens in each of 2 rows, and `full_size` (no reduction)."""

    ranks: int
    heads_per_chunk: int | None = 1
    ring: int = 1
    lora: bool = False
    seq_len: int = 61
    full_size: bool = False


@dataclass(frozen=True)
class Sized:
    """One model as the self-test builds it: `config`, `changes` from the user's (empty: built as it is), its
    parameter count and the bytes all ranks need (`need`; `per_rank` of it in each)."""

    name: str
    config: object
    changes: tuple[str, ...]
    params: int
    per_rank: int
    need: int


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _heads(t, run: RunShape) -> tuple[int, int] | None:
    """(query, key-value) heads of the reduced copy: whole key-value groups, the fewest that keep the geometry's
    regime (key-value heads split over the ranks, or replicated) and `run.heads_per_chunk` valid."""
    heads = getattr(t, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(t, "num_key_value_heads", None) or heads
    per_ring = max(run.ranks // run.ring, 1)
    ratio = heads // kv
    for kv_new in range(1, kv + 1):
        h_new = ratio * kv_new
        if (kv_new % per_ring == 0) != (kv % per_ring == 0) or geometry_error(
            h_new, kv_new, per_ring
        ):
            continue
        hpc = run.heads_per_chunk
        if hpc is None or hpc in valid_heads_per_chunk(h_new, kv_new, per_ring):
            return h_new, kv_new
    return heads, kv


def _layer_count(t) -> int:
    """The fewest layers (at least 2) whose per-layer lists hold every combination of values the whole model has,
    and a sparse layer of an MoE whose first layers are dense."""
    n = t.num_hidden_layers
    lists = [v for v in t.to_dict().values() if isinstance(v, list) and len(v) == n and n > 0]
    rows = [tuple(str(v[i]) for v in lists) for i in range(n)]
    everything, seen, need = set(rows), set(), n
    for i, row in enumerate(rows):
        seen.add(row)
        if seen == everything:
            need = i + 1
            break
    need = max(need, 2, getattr(t, "decoder_sparse_step", 1) or 1)
    if (getattr(t, "first_k_dense_replace", 0) or 0) > 0:
        need = max(need, 2)
    return min(need, n)


def _set(t, key: str, new, changes: list, label: str | None = None) -> None:
    old = getattr(t, key, None)
    if old != new:
        setattr(t, key, new)
        changes.append(f"{label or key}: {old} -> {new}")


def _reduce_layers(t, changes: list) -> None:
    n, keep = t.num_hidden_layers, _layer_count(t)
    if keep >= n:
        return
    for key, value in t.to_dict().items():
        if isinstance(value, list) and len(value) == n:
            setattr(t, key, value[:keep])
    if isinstance(getattr(t, "mlp_only_layers", None), list):
        t.mlp_only_layers = [i for i in t.mlp_only_layers if i < keep]
    if (getattr(t, "first_k_dense_replace", 0) or 0) > 1:
        _set(t, "first_k_dense_replace", 1, changes)
    _set(t, "num_hidden_layers", keep, changes, "layers")


def _reduce_widths(t, run: RunShape, changes: list) -> None:
    """Heads (whole key-value groups) and the hidden size with them (head_dim kept), the intermediate sizes with
    the hidden size."""
    heads = _heads(t, run)
    hidden = getattr(t, "hidden_size", None)
    if heads is None or not isinstance(hidden, int):
        return
    h_old = t.num_attention_heads
    head_dim = getattr(t, "head_dim", None) or hidden // h_old
    h_new, kv_new = heads
    if hidden == h_old * head_dim:
        hidden_new = h_new * head_dim
    else:  # a hidden size of its own (its head_dim is explicit): in proportion, when that is whole
        hidden_new = hidden * h_new // h_old if hidden * h_new % h_old == 0 else hidden
    if getattr(t, "head_dim", None) is not None:
        t.head_dim = head_dim
    _set(t, "num_attention_heads", h_new, changes, "query heads")
    if getattr(t, "num_key_value_heads", None) is not None:
        _set(t, "num_key_value_heads", kv_new, changes, "key-value heads")
    _set(t, "hidden_size", hidden_new, changes, "hidden size")
    for key in _WIDTH_KEYS:
        width = getattr(t, key, None)
        if isinstance(width, int) and width > 0 and hidden_new < hidden:
            _set(t, key, max(16, math.ceil(width * hidden_new / hidden / 16) * 16), changes)


def _reduce_experts(t, changes: list) -> None:
    if (
        getattr(t, "n_group", None) or 1
    ) > 1:  # grouped routing: experts per group fixed by the checkpoint
        return
    experts = [
        k for k in _EXPERT_KEYS if isinstance(getattr(t, k, None), int) and getattr(t, k) > EXPERTS
    ]
    for key in experts:
        _set(t, key, EXPERTS, changes, "routed experts")
    for key in _TOPK_KEYS if experts else ():
        if isinstance(getattr(t, key, None), int) and getattr(t, key) > TOP_K:
            _set(t, key, TOP_K, changes, "experts per token")


def _reduce_vocab(config, t, changes: list) -> None:
    vocab = getattr(t, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= VOCAB:
        return
    _set(t, "vocab_size", VOCAB, changes, "vocabulary")
    for holder in {
        id(config): config,
        id(t): t,
    }.values():  # token ids beyond the new vocabulary: none
        for key, value in holder.to_dict().items():
            ids = value if isinstance(value, list) else [value]
            if key.endswith("_token_id") and any(isinstance(i, int) and i >= VOCAB for i in ids):
                setattr(holder, key, None)


_STEPS = ("layers", "widths", "experts", "vocabulary")


def reduced_config(config, run: RunShape, steps=_STEPS) -> tuple[object, tuple[str, ...]]:
    """(reduced copy of `config`, its changes): module docstring; `steps` picks the reductions. The copy passes its
    config class's own checks (rebuilt from its dict); `config` is not changed."""
    reduced = copy.deepcopy(config)
    t = _text(reduced)
    changes: list[str] = []
    if "layers" in steps and isinstance(getattr(t, "num_hidden_layers", None), int):
        _reduce_layers(t, changes)
    if "widths" in steps:
        _reduce_widths(t, run, changes)
    if "experts" in steps:
        _reduce_experts(t, changes)
    if "vocabulary" in steps:
        _reduce_vocab(reduced, t, changes)
    if not changes:
        return config, ()
    reduced = type(reduced).from_dict(
        reduced.to_dict()
    )  # the class's own validation of the new sizes
    return reduced, tuple(changes)


def parameter_count(config) -> int:
    """Parameters of the causal LM `config` builds, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def memory_needed(params: int, config, run: RunShape) -> int:
    """Bytes one rank needs (module docstring): fp32 weights of two copies, their gradients (LoRA: the adapters',
    counted as none), the reference's activations on 2 rows of `run.seq_len` tokens, and `RANK_BASE`."""
    t = _text(config)
    hidden = getattr(t, "hidden_size", 0) or 0
    width = max(
        (getattr(t, k, 0) or 0 for k in _WIDTH_KEYS if isinstance(getattr(t, k, 0), int)),
        default=0,
    )
    heads = getattr(t, "num_attention_heads", 0) or 0
    layers = getattr(t, "num_hidden_layers", 1) or 1
    vocab = getattr(t, "vocab_size", 0) or 0
    tokens = 2 * run.seq_len
    # per token and layer, in fp32 values: ~34 of the hidden width (norms, projections, residuals, their
    # saved inputs), ~6 of the MLP's, a row of attention scores per head; the logits' ~4 (logits, log-softmax,
    # their gradients)
    acts = 4 * tokens * (layers * (34 * hidden + 6 * width + 2 * heads * run.seq_len) + 4 * vocab)
    copies = (
        2 if run.lora else 4
    )  # two copies of the weights (+ the gradients of both without LoRA)
    return RANK_BASE + 4 * params * copies + acts


def available_memory() -> tuple[int | None, str]:
    """(bytes available now, where that number comes from), or (None, why not)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError as err:
        return None, f"cannot read /proc/meminfo ({err})"
    return None, "no MemAvailable in /proc/meminfo"


def size_model(name: str, config, run: RunShape) -> Sized:
    """The model the self-test builds for `name` (`config`, the user's): reduced unless `run.full_size`. An
    architecture whose config or model refuses the narrower widths keeps them (fewer layers and a smaller
    vocabulary only), and one that refuses those too is built at full size (then the memory check decides)."""
    params = None
    for steps in (_STEPS, ("layers", "vocabulary")) if not run.full_size else ():
        try:
            built, changes = reduced_config(config, run, steps)
            params = parameter_count(built)
            break
        except Exception:  # noqa: BLE001  (this architecture does not build at that size: reduce less)
            continue
    if params is None:
        built, changes = config, ()
        params = parameter_count(built)
    per_rank = memory_needed(params, built, run)
    return Sized(name, built, changes, params, per_rank, per_rank * run.ranks)


def check_fits(sized: Sized, run: RunShape, available: int | None, source: str) -> str:
    """A line saying what `sized` needs against what is `available`; raises `DoesNotFit` when it needs more than
    `USABLE` of it (an unknown `available`: the line says so, nothing is refused)."""
    size = "reduced copy" if sized.changes else "full size"
    what = (
        f"{sized.name}: {sized.params / 1e6:,.1f}M parameters ({size}); "
        f"the self-test needs about {sized.need / GIB:.1f} GiB ({run.ranks} ranks x "
        f"{sized.per_rank / GIB:.2f} GiB: 2 fp32 copies of the model{'' if run.lora else ' and their gradients'}, "
        "activations and the process)"
    )
    if available is None:
        return f"{what}; free memory unknown ({source}): not checked"
    said = f"{what}; {available / GIB:.1f} GiB available ({source})"
    if sized.need > USABLE * available:
        fix = (
            "drop --full-size to test a reduced copy of the same architecture, or free memory"
            if run.full_size
            else "free memory, or lower --sp"
        )
        raise DoesNotFit(
            f"{said}: more than {USABLE:.0%} of it ({USABLE * available / GIB:.1f} GiB), the most a self-test "
            f"takes (the rest is left to the machine's other jobs); nothing was built. {fix[0].upper()}{fix[1:]}."
        )
    return said


def model_has_weights(path: str) -> bool:
    """Whether `path` is a model folder with weight files (the self-test loads them at full size)."""
    return os.path.isdir(path) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(path)
    )
