"""The guard against a model called on shards without hf_upipe (`hf_upipe.adapters.hooks`).

Under SP, a transformers model that `prepare_model` did not prepare is refused when its attention is not "upipe"
or when it has token mixers (Mamba2, gated DeltaNet, short convolutions) that only a prepared model runs across
shards: every hybrid and mixer-only type of the registry, each attention family, and unverified state-space
models. Refused on every rank at the call, before anything runs; a prepared model runs and is exact; the hook is
on only while a state of sp_size > 1 is installed.
"""

import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_upipe.adapters import hooks as guard
from hf_upipe.adapters.hooks import unprepared_refusal
from hf_upipe.adapters.mixers import supported
from hf_upipe.distributed import (
    SequenceParallelState,
    get_sequence_parallel_state,
    set_sequence_parallel_state,
)
from tests._dist import run_distributed
from tests.integrations._models import LAYERS, hybrid_config, tiny_config

# (model type, config builder): every mixer type the registry runs across shards, attention families, and
# state-space models it does not run (refused whatever the attention)
_MIXER_TYPES = sorted(LAYERS)
_ATTENTION_TYPES = ["llama", "qwen3", "gemma3_text", "mixtral"]
_UNVERIFIED = ["mamba", "falcon_mamba"]


def _config(model_type):
    if model_type in LAYERS:
        return hybrid_config(model_type)
    if model_type in _UNVERIFIED:
        from hf_upipe.models.presets import tiny_config as any_config

        return any_config(model_type)
    return tiny_config(model_type)


def _build(config, impl):
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=impl, dtype=torch.float32
        )
    except (ValueError, KeyError):  # a model without attention backends: built with its default
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _model(model_type, impl):
    return _build(_config(model_type), impl)


@pytest.fixture
def sp2():
    """A state of sp_size 2 installed in this process (no collectives run: the guard refuses before any)."""
    previous = set_sequence_parallel_state(SequenceParallelState(None, 2, 0, None, 1, 0))
    try:
        yield get_sequence_parallel_state()
    finally:
        set_sequence_parallel_state(previous)


@pytest.mark.parametrize("model_type", _MIXER_TYPES)
def test_unprepared_mixers_are_refused_whatever_the_attention(sp2, model_type):
    model = _model(model_type, "upipe")
    mixers = sorted({type(m).__name__ for m in model.modules() if supported(m)})
    assert mixers, model_type
    why = unprepared_refusal(model)
    assert why is not None and "prepare_model" in why and all(name in why for name in mixers), why
    ids = torch.randint(3, 50, (1, 8))
    with pytest.raises(NotImplementedError, match="would each mix their rank's shard alone"):
        model(
            input_ids=ids
        )  # the global hook, before anything runs (a collective would fail: no group)


@pytest.mark.parametrize("model_type", _ATTENTION_TYPES)
def test_attention_models_need_upipe_attention_or_prepare(sp2, model_type):
    for impl in ("sdpa", "eager"):
        model = _model(model_type, impl)
        why = unprepared_refusal(model)
        assert why is not None and f"attn_implementation is {impl!r}" in why, why
        with pytest.raises(NotImplementedError, match="attend within its own shard"):
            model(input_ids=torch.randint(3, 50, (1, 8)))
    assert (
        unprepared_refusal(_model(model_type, "upipe")) is None
    )  # the documented from_pretrained path


@pytest.mark.parametrize("model_type", _UNVERIFIED)
def test_unverified_state_space_models_are_refused(sp2, model_type):
    model = _model(model_type, "sdpa")
    why = unprepared_refusal(model)
    assert why is not None and "a Mamba/SSM layer mixes tokens across the whole sequence" in why, (
        why
    )
    with pytest.raises(NotImplementedError, match="cannot run under sequence parallelism"):
        model(input_ids=torch.randint(3, 50, (1, 8)))


def test_hook_is_on_only_while_the_sequence_is_sharded():
    previous = get_sequence_parallel_state()
    try:
        model = _model("llama", "sdpa")
        ids = torch.randint(3, 50, (1, 8))
        for state, on in (
            (None, False),
            (SequenceParallelState(None, 1, 0, None, 1, 0), False),
            (SequenceParallelState(None, 2, 0, None, 1, 0), True),
            (None, False),
        ):
            set_sequence_parallel_state(state)
            assert (guard._HANDLE[0] is not None) == on
            if on:
                with pytest.raises(NotImplementedError):
                    model(input_ids=ids)
            else:
                assert model(input_ids=ids).logits.shape == (1, 8, model.config.vocab_size)
    finally:
        set_sequence_parallel_state(previous)


def _worker(rank, world, model_type):
    """Unprepared: refused on every rank (no hang); prepared (and after unprepare_model, refused again): exact
    against one process."""
    import torch.distributed as dist

    import hf_upipe
    from hf_upipe.data import shard_batch
    from tests.integrations._models import sharded_errors

    hf_upipe.init_sequence_parallel(heads_per_chunk=1)
    config = _config(model_type)
    ref = _build(config, "sdpa")
    model = copy.deepcopy(ref)
    ids = torch.randint(
        3, config.vocab_size, (1, 8 * world), generator=torch.Generator().manual_seed(1)
    )
    shard = shard_batch({"input_ids": ids}, rank, world)
    refused = []
    for step in ("unprepared", "prepared", "unprepared again"):
        if step == "prepared":
            hf_upipe.prepare_model(model)
        elif step == "unprepared again":
            hf_upipe.unprepare_model(model)
        try:
            model(**shard)
            refused.append(None)
        except NotImplementedError as err:
            refused.append(str(err))
        if step == "prepared":
            model.zero_grad()
            errors, _ = sharded_errors(ref, model, ids, rank, world)
    dist.barrier()
    return refused, max(errors.values())


@pytest.mark.parametrize("model_type", ["mamba2", "llama"])
def test_refused_on_every_rank_then_exact_once_prepared(model_type):
    for refused, error in run_distributed(_worker, 2, model_type):
        assert refused[0] is not None and refused[2] is not None and refused[1] is None, refused
        assert error < 1e-4, error


FRESH = """
import sys
import hf_upipe
assert "torch" not in sys.modules and "hf_upipe.adapters.hooks" not in sys.modules, "import hf_upipe is light"
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from hf_upipe.distributed import SequenceParallelState, set_sequence_parallel_state
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
set_sequence_parallel_state(SequenceParallelState(None, 2, 0, None, 1, 0))
try:
    model(input_ids=torch.randint(3, 50, (1, 8)))
except NotImplementedError as err:
    print("refused:", str(err)[:60])
"""


def test_the_guard_is_on_in_a_process_that_only_imported_hf_upipe():
    """`import hf_upipe` imports neither torch nor the hooks: installing an SP state imports them, so a model called
    on shards without hf_upipe is refused in a fresh process whose user imported nothing else of it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("refused:"), (
        out.stdout + out.stderr[-2000:]
    )
