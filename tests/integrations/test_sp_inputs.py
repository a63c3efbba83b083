"""What "upipe" does with inputs it cannot take, and with the inputs it can: every rank must raise the same
clear error before any all-to-all (no hang), and accepted padding must give exact logits on real tokens."""

import pytest
import torch
import torch.distributed as dist

import hf_upipe
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config


def _outcome(fn):
    try:
        return ("ok", fn())
    except (ValueError, NotImplementedError) as err:
        return (type(err).__name__, str(err))


def _worker(rank, world):
    S, B = 16, 2
    s = S // world
    sh = slice(rank * s, (rank + 1) * s)
    cfg = tiny_config("llama")
    ref, model = build_pair(cfg, "upipe", seed=0)
    hf_upipe.init_sequence_parallel()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(S)[sh].unsqueeze(0)
    out = {}

    def run(m=model, ids_=ids[:, sh], **kw):
        kw.setdefault("position_ids", pos)
        return m(ids_, **kw).logits

    out["local positions"] = _outcome(lambda: run(position_ids=torch.arange(s).unsqueeze(0)))
    packed = torch.arange(S)
    packed[S - 5 :] = torch.arange(5)  # a second document starts on the last rank
    out["packed"] = _outcome(lambda: run(position_ids=packed[sh].unsqueeze(0)))
    left = torch.ones(B, S, dtype=torch.long)
    left[1, :3] = 0
    out["left padding"] = _outcome(lambda: run(attention_mask=left[:, sh]))
    interior = torch.ones(B, S, dtype=torch.long)
    interior[0, s - 2 : s] = 0  # padding at the end of rank 0's shard, real tokens again on rank 1
    out["interior padding across shards"] = _outcome(lambda: run(attention_mask=interior[:, sh]))
    short = s + 1 if rank == 0 else s - 1
    out["unequal shards"] = _outcome(
        lambda: run(ids_=ids[:, :short], position_ids=torch.arange(short)[None] + rank * s)
    )
    mis_cfg = tiny_config("mistral", sliding_window=S // 2)
    mis_ref, mistral = build_pair(mis_cfg, "upipe", seed=0)
    with (
        torch.no_grad()
    ):  # a window shorter than the sequence runs in the kernel (hf_upipe.ops.windowed)
        with hf_upipe.without_sequence_parallel():
            want = mis_ref(ids).logits[:, sh]
        out["sliding window error"] = (run(m=mistral) - want).abs().max().item()
    bad_heads = build_pair(tiny_config("llama", heads=3, kv_heads=1, head_dim=16), "upipe", seed=0)[
        1
    ]
    out["heads"] = _outcome(lambda: run(m=bad_heads))
    drop = build_pair(tiny_config("llama", attention_dropout=0.1), "upipe", seed=0)[1].train()
    out["dropout"] = _outcome(lambda: run(m=drop))

    # trailing padding is exact on real tokens: row 0 padded from inside rank 0's shard, row 1 inside the last
    right = torch.ones(B, S, dtype=torch.long)
    right[0, s - 3 :] = 0
    right[1, S - 2 :] = 0
    with torch.no_grad():
        logits = run(attention_mask=right[:, sh])
        with hf_upipe.without_sequence_parallel():
            expected = ref(ids, attention_mask=right).logits[:, sh]
    real = right[:, sh].bool()
    out["right padding error"] = (
        (logits[real] - expected[real]).abs().max().item() if real.any() else 0.0
    )
    out["right padding checked"] = int(real.sum())
    hf_upipe.reset_sequence_parallel()
    return out


EXPECTED = {
    "local positions": ("ValueError", "not the global positions"),
    "packed": ("ValueError", "hf_upipe.shard_batch (it adds 'upipe_cu_seqlens'"),
    "left padding": ("ValueError", "left or interior padding"),
    "interior padding across shards": ("ValueError", "interior padding"),
    "unequal shards": ("ValueError", "different shard shapes"),
    "heads": ("ValueError", "num_attention_heads=3 is not divisible by sp_size=2"),
    "dropout": ("NotImplementedError", "attention dropout=0.1"),
}


def test_bad_inputs_raise_on_every_rank_and_padding_is_exact():
    results = run_distributed(_worker, 2)
    for rank, out in enumerate(results):
        for case, (kind, text) in EXPECTED.items():
            got_kind, message = out[case]
            assert got_kind == kind and text in message, (
                f"rank {rank}, {case}: got {got_kind}: {message}"
            )
        assert out["right padding checked"] > 0
        assert out["right padding error"] < 1e-5, out["right padding error"]
        assert out["sliding window error"] < 1e-5, out["sliding window error"]


def test_without_sp_upipe_is_sdpa_including_generation_with_cache():
    cfg = tiny_config("qwen3", use_cache=True)
    ref, model = build_pair(cfg, "upipe", seed=3)
    ids = torch.randint(1, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding, as in batched generation
    kw = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores):
        torch.testing.assert_close(sb, sa, rtol=0, atol=0)


def _groups_worker(rank, world):
    out = {}
    try:
        hf_upipe.init_sequence_parallel(3)
    except ValueError as err:
        out["bad sp_size"] = str(err)
    state = hf_upipe.init_sequence_parallel(2, heads_per_chunk=None)
    out["sp ranks"] = dist.get_process_group_ranks(state.sp_group)
    out["dp ranks"] = dist.get_process_group_ranks(state.dp_group)
    out["ranks"] = (state.sp_rank, state.dp_rank, state.sp_size, state.dp_size)
    explicit = dist.new_group([0, 1])
    try:
        hf_upipe.init_sequence_parallel(4, group=explicit)
    except ValueError as err:
        out["group mismatch"] = str(err)
    hf_upipe.reset_sequence_parallel()
    return out


def test_groups_are_contiguous_sp_with_dp_across():
    for rank, out in enumerate(run_distributed(_groups_worker, 4)):
        assert (
            "sp_size=3 does not divide the world size 4; use one of [1, 2, 4]" in out["bad sp_size"]
        )
        assert out["sp ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["dp ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert out["ranks"] == (rank % 2, rank // 2, 2, 2)
        expected = (
            "sp_size=4 but the given group has 2 ranks"
            if rank < 2
            else f"rank {rank} is not a member"
        )
        assert expected in out["group mismatch"]


def test_init_needs_distributed_and_checks_arguments():
    with pytest.raises(ValueError, match="heads_per_chunk=0"):
        hf_upipe.init_sequence_parallel(heads_per_chunk=0)
    with pytest.raises(ValueError, match="Unknown attention kernel 'nope'"):
        hf_upipe.init_sequence_parallel(kernel="nope")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="needs torch.distributed"):
            hf_upipe.init_sequence_parallel()


def _validation_worker(rank, world):
    """Count the layout all-gathers of forwards + backwards of a 2-layer checkpointed model."""
    from hf_upipe.attention import layout as upipe_tf

    counted = []
    real = upipe_tf._check_layout
    upipe_tf._check_layout = lambda *a, **k: counted.append(1) or real(*a, **k)
    hf_upipe.init_sequence_parallel()
    out = {}
    for fused in (False, True):
        _, model = build_pair(tiny_config("llama", layers=2), "upipe", seed=0)
        if fused:
            hf_upipe.prepare_model(model)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        model.train()
        counts = []
        for batch in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(batch))
            shard = hf_upipe.shard_batch({"input_ids": ids, "labels": ids}, rank, world)
            counted.clear()
            loss = model(
                input_ids=shard["input_ids"], position_ids=shard["position_ids"]
            ).logits.sum()
            loss.backward()  # recomputes both checkpointed layers
            counts.append(len(counted))
        out["fused" if fused else "registered"] = counts
    bad = (
        torch.arange(8)[rank * 4 : (rank + 1) * 4].unsqueeze(0) * 0
    )  # local positions on every rank: an error
    out["error"] = _outcome(lambda: model(input_ids=ids[:, :4], position_ids=bad).logits)[0]
    return out


def test_the_layout_is_checked_once_per_forward_not_per_layer():
    """Two layers, forward and checkpointed backward (4 attention calls): one layout all-gather per batch."""
    for out in run_distributed(_validation_worker, 2):
        assert out["registered"] == [1, 1] and out["fused"] == [1, 1], out
        assert out["error"] == "ValueError"  # a new (bad) batch is still checked
