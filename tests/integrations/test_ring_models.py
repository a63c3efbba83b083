"""UPipe inside a ring shard, ring attention across shards (`init_sequence_parallel(ring_size=R)`), in real
transformers models against one process.

U x R in {1x2, 2x2, 1x4} (1x4 in the slow tier): `shard_batch` gives each rank its tokens in ring order; the
registered attention
(`attn_implementation="upipe"`) and the fused block (both backward modes), full fine-tuning and PEFT LoRA, with
activation checkpointing: loss, every shard's logits and every trainable gradient. What the ring does not
implement is refused on every rank before any collective: packed rows, sliding windows, hybrid mixers, and
positions that are not in ring order (contiguous shards, the usual mistake); interior padding across shards is
refused, right padding runs exactly.
"""

import pytest
import torch

import hf_upipe
from tests._dist import run_distributed
from tests.integrations._models import build_pair, lora_pair, sharded_errors, tiny_config


def _case(rank, world, arch, heads, fused, mode, lora, ckpt, seed):
    ref, model = build_pair(tiny_config(arch, heads=heads[0], kv_heads=heads[1]), "upipe", seed)
    if lora:
        ref, model = lora_pair(ref, model)
    hf_upipe.prepare_model(
        model, hf_upipe.UPipeConfig(fused_attention=fused, fused_backward=mode, tiled_mlp=False)
    )
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref.train()
    ids = torch.randint(3, 96, (2, 8 * world), generator=torch.Generator().manual_seed(seed))
    errors, trained = sharded_errors(ref, model, ids, rank, world)
    return errors, trained


def _worker(rank, world, ring, cases):
    hf_upipe.init_sequence_parallel(world, ring_size=ring)
    try:
        return [(case, *_case(rank, world, *case)) for case in cases]
    finally:
        hf_upipe.reset_sequence_parallel()


# (arch, (H, Hk), fused, backward mode, LoRA, checkpointing, seed)
CASES = [
    ("llama", (8, 2), False, "recompute", False, False, 1),
    ("llama", (8, 2), True, "recompute", False, True, 2),
    ("qwen3", (4, 4), True, "save", True, False, 3),
    ("mistral", (8, 2), False, "recompute", True, True, 4),
]


@pytest.mark.parametrize(
    "U,R",
    [
        pytest.param(1, 2, id="1x2"),
        pytest.param(2, 2, id="2x2"),
        # the longest ring (4 ranks, one per shard): the full suite runs it, 1x2 and 2x2 keep the ring fast
        pytest.param(1, 4, id="1x4", marks=pytest.mark.slow),
    ],
)
def test_ring_models_match_one_process(U, R):
    for per_rank in run_distributed(_worker, U * R, R, CASES, timeout=300):
        for case, errors, trained in per_rank:
            assert trained > 0
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-4, (U, R, case, worst, errors[worst])


def _refusal_worker(rank, world, ring):
    """What this rank raised for each misuse (type: message), or for right padding the worst logit error."""
    from hf_upipe.ops.ring import ring_positions
    from tests.integrations._models import hybrid_config

    hf_upipe.init_sequence_parallel(world, ring_size=ring)
    out = {}

    def attempt(name, model, **kw):
        try:
            model(**kw)
            out[name] = None
        except (ValueError, NotImplementedError) as err:
            out[name] = f"{type(err).__name__}: {err}"

    try:
        S = 8 * world
        s = S // world
        mine = ring_positions(rank, s, world, ring)
        ids = torch.randint(3, 96, (1, S), generator=torch.Generator().manual_seed(0))
        ref, llama = build_pair(tiny_config("llama"), "upipe", 1)
        hf_upipe.prepare_model(llama)
        # contiguous shards with their own positions: the usual mistake, not the ring's order
        attempt(
            "contiguous",
            llama,
            input_ids=ids[:, rank * s : (rank + 1) * s],
            position_ids=torch.arange(rank * s, (rank + 1) * s)[None],
        )
        # a padded token on the last rank's last place, real tokens after it in the sequence (on another rank)
        mask = torch.ones(1, S, dtype=torch.long)
        mask[0, ring_positions(world - 1, s, world, ring)[-1]] = 0
        attempt(
            "interior padding",
            llama,
            input_ids=ids[:, mine],
            position_ids=mine[None],
            attention_mask=mask[:, mine],
        )
        # right padding: exact on the real tokens
        mask = torch.ones(1, S, dtype=torch.long)
        mask[0, S - 5 :] = 0
        with hf_upipe.without_sequence_parallel():
            want = ref(input_ids=ids, attention_mask=mask).logits[:, mine]
        got = llama(
            input_ids=ids[:, mine], position_ids=mine[None], attention_mask=mask[:, mine]
        ).logits
        real = mask[0, mine].bool()
        out["right padding"] = (
            (got - want)[:, real].abs().max() / want[:, real].abs().max()
        ).item()
        _, gemma = build_pair(
            tiny_config("gemma3_text"), "upipe", 2
        )  # a 5-token sliding window on layer 0
        hf_upipe.prepare_model(gemma)
        attempt("window", gemma, input_ids=ids[:, mine], position_ids=mine[None])
        from transformers import AutoModelForCausalLM

        hybrid = AutoModelForCausalLM.from_config(
            hybrid_config("lfm2"), attn_implementation="upipe"
        )
        hf_upipe.prepare_model(hybrid)
        attempt("hybrid", hybrid, input_ids=ids[:, mine], position_ids=mine[None])
        return out
    finally:
        hf_upipe.reset_sequence_parallel()


def test_what_the_ring_does_not_implement_is_refused_on_every_rank():
    results = run_distributed(_refusal_worker, 4, 2, timeout=300)  # 2 x 2
    said = [{k: v for k, v in out.items() if k != "right padding"} for out in results]
    assert all(s == said[0] for s in said), said  # every rank the same error
    for out in results:
        assert (
            out["contiguous"].startswith("ValueError")
            and "ring_positions(r, 8, 4, 2)" in out["contiguous"]
        ), out
        assert (
            out["interior padding"].startswith("ValueError")
            and "interior padding" in out["interior padding"]
        )
        assert out["right padding"] < 1e-5, out["right padding"]
        assert (
            out["window"].startswith("NotImplementedError") and "sliding window" in out["window"]
        ), out["window"]
        assert out["hybrid"].startswith("NotImplementedError") and "ring_size=1" in out["hybrid"], (
            out["hybrid"]
        )


def test_packed_rows_and_odd_lengths_under_a_ring():
    from hf_upipe.ops.ring import ring_positions

    with pytest.raises(
        ValueError,
        match=r"2 shards of 5 tokens \(10\) are not a multiple of 4: pad the sequence to a "
        "multiple of 2 x sp_size = 4",
    ):
        ring_positions(
            0, 5, 2, 2
        )  # the layout check computes it on every rank before its all-gather
    ids = torch.arange(3, 19)[None]  # 16 tokens, two documents
    with pytest.raises(
        ValueError, match="Packed rows .* not implemented with ring attention \\(ring_size=2\\)"
    ):
        hf_upipe.shard_batch(
            {"input_ids": ids, "position_ids": torch.cat([torch.arange(8), torch.arange(8)])[None]},
            0,
            4,
            ring_size=2,
        )
    # 13 tokens on 2 x 2 ranks: padded to 16 (a multiple of 2 * sp_size) with ignored targets, ring order
    shards = [
        hf_upipe.shard_batch({"input_ids": ids[:, :13], "labels": ids[:, :13]}, r, 4, ring_size=2)
        for r in range(4)
    ]
    assert [sh["position_ids"].tolist()[0] for sh in shards] == [
        [0, 1, 2, 3],
        [12, 13, 14, 15],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    assert shards[1]["shift_labels"].tolist() == [[-100, -100, -100, -100]]
    assert sum(int(sh["num_label_tokens"]) for sh in shards) == 4 * 12
