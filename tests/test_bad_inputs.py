"""Bad input at the public entry points gets a clear error: the argument's name, what it got, what to pass.

`init_sequence_parallel`: every argument of the wrong type (a string, a float, a bool where an int is meant, ...) is
named with the type it got and the value to pass instead, before torch.distributed is even asked (so on every rank
alike, before any collective). The runtime's `count` and `loss` on a shard without labels name what is missing
before their collective.
"""

import pytest

import hf_upipe

CASES = [
    (
        dict(sp_size="2"),
        "sp_size='2' is a str: pass an int that divides the world size, or None for all ranks "
        "(sp_size=2, not the string '2').",
    ),
    (
        dict(sp_size=2.0),
        "sp_size=2.0 is a float: pass an int that divides the world size, or None for all ranks "
        "(sp_size=2).",
    ),
    (dict(sp_size=True), "sp_size=True is a bool: pass an int"),
    (
        dict(ring_size="2"),
        "ring_size='2' is a str: pass a positive int (1: no ring) (ring_size=2, not the string",
    ),
    (dict(ring_size=None), "ring_size=None is a NoneType: pass a positive int (1: no ring)."),
    (
        dict(heads_per_chunk="1"),
        "heads_per_chunk='1' is a str: pass a positive integer (1 = least memory), or None",
    ),
    (dict(heads_per_chunk=0), "heads_per_chunk=0 is invalid: use a positive integer"),
    (dict(kernel=3), "kernel=3 is an int: pass a kernel name such as 'auto' or 'sdpa'."),
    (dict(allow_unverified="yes"), "allow_unverified='yes' is a str: pass True or False."),
]


@pytest.mark.parametrize(
    "kwargs, message",
    CASES,
    ids=[next(iter(c[0])) + "=" + repr(next(iter(c[0].values()))) for c in CASES],
)
def test_init_sequence_parallel_names_the_bad_argument(kwargs, message):
    with pytest.raises(ValueError) as err:
        hf_upipe.init_sequence_parallel(**kwargs)
    assert message in str(err.value), str(err.value)


def test_good_arguments_reach_the_distributed_check():
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        hf_upipe.init_sequence_parallel(
            2, ring_size=1, heads_per_chunk=None, kernel="sdpa", allow_unverified=True
        )


@pytest.mark.parametrize("method", ["count", "loss"])
def test_the_runtime_names_a_shard_without_labels_before_any_collective(method):
    """A batch without labels, or one not cut by `UPipeRuntime.shard`: named (rank 0 alone raised a bare KeyError and
    the other ranks died waiting). Ranks that disagree: tests/test_bad_input_matrix.py."""
    import torch

    from hf_upipe.training.runtime import NO_SP, UPipeRuntime

    shard = {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    runtime = UPipeRuntime(hf_upipe.UPipeConfig(), NO_SP, world_size=1, device="cpu")
    call = (
        (lambda: runtime.count([shard]))
        if method == "count"
        else (lambda: UPipeRuntime.loss_sum(object(), None, shard))
    )
    with pytest.raises(
        ValueError,
        match=r"got a shard without \['shift_labels', 'num_label_tokens'\] \(its keys: "
        r"\['input_ids'\]\): pass the shards UPipeRuntime.shard\(batch\) returns",
    ):
        call()
