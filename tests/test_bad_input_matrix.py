"""The bad-input matrix: every public entry point times the kinds of bad input a user can give it, each asserted
CLEAR (every rank raises an error of the expected type whose message names the problem, within a bounded wait) or
WORKS (equal to one process).

Entry points: `init_sequence_parallel`, `shard_batch`, `UPipeConfig` (the Trainer's and the plugin's settings),
`prepare_model`, `UPipeTrainer`, `UPipePlugin`, `UPipeRuntime`, a model called on shards, the examples' flags and
the `hf-upipe` command. Kinds: wrong types (strings, floats, tensors where ints are meant), shapes, ranges, missing
keys, disagreeing ranks, wrong order of calls.

Cases that need no process group run in this process; the others run on both ranks of one 2-rank gloo job, one
after another (each CLEAR case raises on every rank alike, so the group stays in step for the next).
"""

import contextlib
import io
import os
import sys
import time

import pytest
import torch

import hf_upipe
from hf_upipe import UPipeConfig, shard_batch
from tests._dist import run_distributed

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = torch.arange(3, 19).reshape(2, 8)
BOUND_S = 60.0  # the longest a CLEAR case may take on a rank (the validation collectives' timeout is 20 s here)


def _sb(**kwargs):
    batch = kwargs.pop("batch", {"input_ids": IDS, "labels": IDS})
    args = kwargs.pop("args", (0, 2))
    return lambda: shard_batch(batch, *args, **kwargs)


# (entry point, case, call, error type, substrings the message must hold)
SINGLE = [
    # init_sequence_parallel: wrong types of every int argument, before torch.distributed is asked
    (
        "init",
        "sp_size str",
        lambda: hf_upipe.init_sequence_parallel("2"),
        ValueError,
        ["'2' is a str"],
    ),
    (
        "init",
        "sp_size float",
        lambda: hf_upipe.init_sequence_parallel(2.0),
        ValueError,
        ["is a float"],
    ),
    (
        "init",
        "sp_size tensor",
        lambda: hf_upipe.init_sequence_parallel(torch.tensor(2)),
        ValueError,
        ["is a Tensor", "pass an int"],
    ),
    (
        "init",
        "ring_size float",
        lambda: hf_upipe.init_sequence_parallel(ring_size=2.0),
        ValueError,
        ["ring_size=2.0 is a float"],
    ),
    (
        "init",
        "heads_per_chunk tensor",
        lambda: hf_upipe.init_sequence_parallel(heads_per_chunk=torch.tensor(1)),
        ValueError,
        ["heads_per_chunk=tensor(1) is a Tensor"],
    ),
    (
        "init",
        "heads_per_chunk range",
        lambda: hf_upipe.init_sequence_parallel(heads_per_chunk=0),
        ValueError,
        ["heads_per_chunk=0 is invalid"],
    ),
    (
        "init",
        "kernel unknown",
        lambda: hf_upipe.init_sequence_parallel(kernel="nope"),
        ValueError,
        ["nope"],
    ),
    (
        "init",
        "order: before init_process_group",
        lambda: hf_upipe.init_sequence_parallel(),
        RuntimeError,
        ["needs torch.distributed", "init_process_group"],
    ),
    # shard_batch: types, shapes, missing keys, ranges
    ("shard_batch", "sp_rank str", _sb(args=("0", 2)), ValueError, ["sp_rank='0' is a str"]),
    ("shard_batch", "sp_size float", _sb(args=(0, 2.0)), ValueError, ["sp_size=2.0 is a float"]),
    ("shard_batch", "sp_rank tensor", _sb(args=(torch.tensor(0), 2)), ValueError, ["is a Tensor"]),
    ("shard_batch", "sp_rank range", _sb(args=(2, 2)), ValueError, ["0 <= sp_rank < sp_size"]),
    ("shard_batch", "ring_size str", _sb(ring_size="1"), ValueError, ["ring_size='1' is a str"]),
    (
        "shard_batch",
        "pad_token_id float",
        _sb(pad_token_id=0.5),
        ValueError,
        ["pad_token_id=0.5 is a float"],
    ),
    (
        "shard_batch",
        "ignore_index tensor",
        _sb(ignore_index=torch.tensor(-100)),
        ValueError,
        ["is a Tensor"],
    ),
    ("shard_batch", "batch a tensor", _sb(batch=IDS), ValueError, ["as a dict", "got a Tensor"]),
    ("shard_batch", "no input_ids", _sb(batch={"labels": IDS}), ValueError, ["batch['input_ids']"]),
    (
        "shard_batch",
        "input_ids 1-D",
        _sb(batch={"input_ids": IDS[0]}),
        ValueError,
        ["[B, S] tensor"],
    ),
    (
        "shard_batch",
        "input_ids float",
        _sb(batch={"input_ids": IDS.float()}),
        ValueError,
        ["dtype"],
    ),
    (
        "shard_batch",
        "labels a list",
        _sb(batch={"input_ids": IDS, "labels": IDS.tolist()}),
        ValueError,
        ["batch['labels'] is a list", "tensor"],
    ),
    (
        "shard_batch",
        "labels shorter",
        _sb(batch={"input_ids": IDS, "labels": IDS[:, :7]}),
        ValueError,
        ["batch['labels'] has shape (2, 7)", "(2, 8)"],
    ),
    (
        "shard_batch",
        "position_ids 1-D",
        _sb(batch={"input_ids": IDS, "position_ids": torch.arange(8)}),
        ValueError,
        ["position_ids has shape (8,)"],
    ),
    (
        "shard_batch",
        "left padding",
        _sb(batch={"input_ids": IDS, "attention_mask": torch.tensor([[0] + [1] * 7] * 2)}),
        ValueError,
        ["left or interior padding"],
    ),
    # UPipeConfig (the Trainer's and the plugin's settings): types and ranges
    (
        "UPipeConfig",
        "sp_size float",
        lambda: UPipeConfig(sp_size=2.5),
        ValueError,
        ["sp_size=2.5 is a float"],
    ),
    (
        "UPipeConfig",
        "heads_per_chunk 0",
        lambda: UPipeConfig(heads_per_chunk=0),
        ValueError,
        ["heads_per_chunk"],
    ),
    (
        "UPipeConfig",
        "offload unknown",
        lambda: UPipeConfig(offload="gpu"),
        ValueError,
        ["offload='gpu'"],
    ),
    (
        "UPipeConfig",
        "bool unreadable",
        lambda: UPipeConfig(tiled_mlp="maybe"),
        ValueError,
        ["tiled_mlp='maybe'"],
    ),
    (
        "UPipeConfig",
        "length unreadable",
        lambda: UPipeConfig(plan_seq_len="1Q"),
        ValueError,
        ["plan_seq_len='1Q'"],
    ),
    (
        "UPipePlugin",
        "sp_size str",
        lambda: hf_upipe.UPipePlugin(sp_size="x"),
        ValueError,
        ["sp_size='x'"],
    ),
    # prepare_model, UPipeTrainer: arguments of the wrong kind
    (
        "prepare_model",
        "model a str",
        lambda: hf_upipe.prepare_model("llama"),
        ValueError,
        ["got a str"],
    ),
    (
        "prepare_model",
        "config a dict",
        lambda: hf_upipe.prepare_model(torch.nn.Linear(2, 2), {"sp_size": 2}),
        ValueError,
        ["upipe_config={'sp_size': 2} is a dict", "UPipeConfig(**upipe_config)"],
    ),
    (
        "UPipeTrainer",
        "config a str",
        lambda: hf_upipe.UPipeTrainer(model=torch.nn.Linear(2, 2), upipe_config="sp2"),
        ValueError,
        ["upipe_config='sp2' is a str"],
    ),
    # the runtime on a shard without labels
    (
        "UPipeRuntime",
        "count without labels",
        lambda: _runtime().count([{"input_ids": IDS}]),
        ValueError,
        ["got a shard without ['shift_labels', 'num_label_tokens']"],
    ),
    (
        "UPipeRuntime",
        "shard without labels",
        lambda: _runtime().shard({"input_ids": IDS}),
        ValueError,
        ["needs 'labels' (or 'shift_labels')"],
    ),
]


def _runtime():
    from hf_upipe.training.runtime import NO_SP, UPipeRuntime

    return UPipeRuntime(UPipeConfig(), NO_SP, world_size=1, device="cpu")


@pytest.mark.parametrize(
    "call, kind, parts", [c[2:] for c in SINGLE], ids=[f"{c[0]}: {c[1]}" for c in SINGLE]
)
def test_in_one_process(call, kind, parts):
    with pytest.raises(kind) as err:
        call()
    for part in parts:
        assert part in str(err.value), str(err.value)


# ---- the command line: hf-upipe and the examples' flags ----------------------------------------------------------
CLI = [
    (["nosuch"], "invalid choice: 'nosuch'"),
    (
        ["plan", "--model", "llama3-8b", "--gpus", "two", "--gpu-memory", "80GiB"],
        "--gpus: invalid int",
    ),
    (["plan", "--model", "llama3-8b", "--gpus", "0", "--gpu-memory", "80GiB", "--max"], "gpus=0"),
    (
        ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80 lots", "--max"],
        "unknown unit",
    ),
    (
        ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-memory", "80GiB", "--seq-len", "1Q"],
        "'1Q'",
    ),
    (["plan", "--model", "nosuch", "--gpus", "8", "--gpu-memory", "80GiB", "--max"], "nosuch"),
    (["selftest", "--model", "llama", "--sp", "x"], "--sp: invalid int"),
    (["selftest", "--model", "llama", "--sp", "0"], "--sp 0"),
]


@pytest.mark.parametrize("argv, named", CLI, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CLI])
def test_the_command_line(argv, named, monkeypatch):
    from hf_upipe.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    assert code == 2 and named in err.getvalue(), (code, err.getvalue())
    assert "Traceback" not in err.getvalue()


EXAMPLE_FLAGS = [
    (["--heads-per-chunk", "two"], "argument --heads-per-chunk: 'two' is neither"),
    (["--kernel", "nope"], "argument --kernel: invalid choice: 'nope'"),
    (["--offload", "disk"], "error: --offload disk offloads what activation checkpointing keeps"),
    (["--data", "no/such/file.txt"], "error: --data no/such/file.txt: no such file"),
]


@pytest.mark.parametrize("argv, named", EXAMPLE_FLAGS, ids=[a[0] for a, _ in EXAMPLE_FLAGS])
def test_the_examples_flags(argv, named, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import _common
        import finetune_long_context
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    with pytest.raises(SystemExit) as exit_:
        _common.run(lambda: finetune_long_context.main([*argv, "--steps", "1"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named in err, err
    assert "Traceback" not in err


# ---- two ranks --------------------------------------------------------------------------------------------------
def _outcome(call) -> tuple:
    start = time.monotonic()
    try:
        value = call()
    except Exception as err:  # noqa: BLE001  (judged in the test)
        return ("raised", type(err).__name__, str(err), time.monotonic() - start)
    return ("works", value, "", time.monotonic() - start)


def _model_calls(rank, model, ids, shard):
    """Bad inputs of a model called on shards (the guard admits it on its first call)."""
    pos, own = shard["position_ids"], shard["input_ids"]
    labels = shard["shift_labels"]
    other = ids[:, :8] if rank == 0 else ids[:, 8:15]
    return {
        "model: the row's position_ids": lambda: model(
            input_ids=own, position_ids=torch.arange(16)[None]
        ),
        "model: the row's shift_labels": lambda: model(
            input_ids=own, position_ids=pos, labels=ids, shift_labels=ids
        ),
        "model: shorter shift_labels": lambda: model(
            input_ids=own, position_ids=pos, labels=labels[:, :5], shift_labels=labels[:, :5]
        ),
        "model: the row's attention_mask (padded)": lambda: model(
            input_ids=own, position_ids=pos, attention_mask=torch.tensor([[1] * 14 + [0] * 2])
        ),
        "model: labels without shift_labels": lambda: model(
            input_ids=own, position_ids=pos, labels=labels
        ),
        "model: local position_ids": lambda: model(
            input_ids=own, position_ids=torch.arange(8)[None]
        ),
        "model: unequal shards (ranks disagree)": lambda: model(
            input_ids=other, position_ids=torch.arange(8 * rank, 8 * rank + other.shape[1])[None]
        ),
        "model: batch sizes disagree": lambda: model(
            input_ids=own.expand(1 + rank, -1), position_ids=pos
        ),
        "model: use_cache": lambda: model(input_ids=own, position_ids=pos, use_cache=True),
        "model: output_attentions": lambda: model(
            input_ids=own, position_ids=pos, output_attentions=True
        ),
        "model: generate": lambda: model.generate(own, max_new_tokens=1),
    }


def _wrong_order(rank, world):
    """prepare_model before init_sequence_parallel, then init: a training step equals one process."""
    from tests.integrations._models import build_pair, sharded_errors, tiny_config

    hf_upipe.reset_sequence_parallel()
    ref, model = build_pair(tiny_config("llama"), "upipe", seed=3)
    hf_upipe.prepare_model(model)
    hf_upipe.init_sequence_parallel()
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(1))
    errors, _ = sharded_errors(ref, model, ids, rank, world)
    return max(errors.values())


def _matrix_rank(rank, world):
    from hf_upipe.data import ShardedDataLoader
    from hf_upipe.training.parallelism import resolve_launch
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.integrations._models import build_pair, tiny_config

    os.environ["UPIPE_VALIDATION_TIMEOUT"] = "20"
    _, model = build_pair(tiny_config("llama"), "upipe", seed=2)
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    cases = {
        "init: sp_size does not divide": lambda: hf_upipe.init_sequence_parallel(3),
        "init: ring_size 0": lambda: hf_upipe.init_sequence_parallel(ring_size=0),
        "init: ranks disagree": lambda: hf_upipe.init_sequence_parallel(
            heads_per_chunk=1 if rank == 0 else None
        ),
        "runtime setup (plugin, Trainer): sp_size does not divide": lambda: UPipeRuntime.setup(
            resolve_launch(UPipeConfig(sp_size=3), None, world),
            model,
            device="cpu",
            checkpointing=False,
            checkpointing_fix="",
        ),
    }
    out = {name: _outcome(call) for name, call in cases.items()}
    state = hf_upipe.init_sequence_parallel()
    out["init: again with other settings"] = _outcome(
        lambda: hf_upipe.init_sequence_parallel(heads_per_chunk=None)
    )
    out["shard_batch: another rank's"] = _outcome(
        lambda: shard_batch({"input_ids": ids}, 1 - rank, 2)
    )
    shard = shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    for name, call in _model_calls(rank, model, ids, shard).items():
        out[name] = _outcome(call)
    runtime = UPipeRuntime(UPipeConfig(), state, world_size=world, device="cpu")
    mixed = shard if rank == 0 else {"input_ids": shard["input_ids"]}
    out["runtime: count, labels on one rank only"] = _outcome(lambda: runtime.count([mixed]))
    loader = ShardedDataLoader(
        [{"input_ids": ids + rank, "labels": ids}], state, check_same_batch=True
    )
    out["ShardedDataLoader: ranks get different batches"] = _outcome(lambda: next(iter(loader)))
    out["order: prepare_model before init_sequence_parallel"] = _outcome(
        lambda: _wrong_order(rank, world)
    )
    plain = (str, float, int)  # a model's output that should not be there is shown, not sent back
    return {
        k: (v[0], v[1] if isinstance(v[1], plain) else repr(v[1])[:200], *v[2:])
        for k, v in out.items()
    }


# (case, error type, substrings), or (case, "works", the largest relative error allowed)
RANKS = [
    ("init: sp_size does not divide", "ValueError", ["sp_size=3 does not divide the world size 2"]),
    ("init: ring_size 0", "ValueError", ["ring_size=0"]),
    ("init: ranks disagree", "ValueError", ["different settings", "heads_per_chunk=None"]),
    (
        "runtime setup (plugin, Trainer): sp_size does not divide",
        "ValueError",
        ["sp_size=3", "does not divide"],
    ),
    ("init: again with other settings", "ValueError", ["reset_sequence_parallel() first"]),
    ("shard_batch: another rank's", "ValueError", ["but this rank is SP rank"]),
    (
        "model: the row's position_ids",
        "ValueError",
        ["position_ids has 16 positions", "has 8", "[:, r*8:(r+1)*8]"],
    ),
    (
        "model: the row's shift_labels",
        "ValueError",
        ["shift_labels has 16 positions", "has 8", "shard_batch"],
    ),
    ("model: shorter shift_labels", "ValueError", ["shift_labels has 5 positions", "has 8"]),
    (
        "model: the row's attention_mask (padded)",
        "ValueError",
        ["attention_mask has [16, 16] tokens per row", "shard of 8 tokens"],
    ),
    ("model: labels without shift_labels", "ValueError", ["labels= under sequence parallelism"]),
    ("model: local position_ids", "ValueError", ["not the global positions of their shard"]),
    ("model: unequal shards (ranks disagree)", "ValueError", ["local lengths [8, 7]"]),
    ("model: batch sizes disagree", "ValueError", ["batch sizes [1, 2]"]),
    ("model: use_cache", "NotImplementedError", ["use_cache=True", "use_cache=False"]),
    ("model: output_attentions", "NotImplementedError", ["output_attentions=True"]),
    (
        "model: generate",
        "NotImplementedError",
        ["generate() under sequence parallelism", "without_sequence_parallel"],
    ),
    ("runtime: count, labels on one rank only", "ValueError", ["without"]),
    ("ShardedDataLoader: ranks get different batches", "ValueError", ["different"]),
    ("order: prepare_model before init_sequence_parallel", "works", 1e-4),
]


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_matrix_rank, 2, timeout=240)


@pytest.mark.parametrize("case, kind, expected", RANKS, ids=[c[0] for c in RANKS])
def test_on_two_ranks(ranks, case, kind, expected):
    for rank, results in enumerate(ranks):
        outcome, got, message, seconds = results[case]
        if kind == "works":
            assert outcome == "works" and got <= expected, (rank, results[case])
            continue
        assert outcome == "raised" and got == kind, (rank, results[case])
        for part in expected:
            assert part in message, (rank, message)
        assert seconds < BOUND_S, (rank, case, seconds)


def test_every_case_is_in_the_table(ranks):
    assert set(ranks[0]) == {c[0] for c in RANKS}
