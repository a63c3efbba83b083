"""hf_upipe.data: shard_batch against transformers' causal-LM loss convention, padding, masks, packed rows
(DataCollatorWithFlattening, targets never crossing documents, document boundaries) and position_ids;
ShardedDataLoader on 4 gloo ranks (2 SP groups of 2) with a DistributedSampler."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import DataCollatorWithFlattening
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_upipe
from hf_upipe.data import ShardedDataLoader, sampler_kwargs, shard_batch
from tests._dist import run_distributed

V = 11


def _batch(B=2, S=7, seed=0, labels=True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, S), generator=gen)
    out = {"input_ids": ids}
    if labels:
        lab = ids.clone()
        lab[0, :2] = -100  # e.g. a masked prompt
        out["labels"] = lab
    return out


def _shards(batch, P, **kw):
    return [shard_batch(batch, r, P, **kw) for r in range(P)]


def _cat(shards, key):
    return torch.cat([sh[key] for sh in shards], dim=1)


@pytest.mark.parametrize("S", [6, 7, 9])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_loss_over_shards_equals_transformers_loss(S, P, masked):
    B = 3
    batch = _batch(B, S, seed=S * 10 + P)
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(1))
    labels = batch["labels"]
    if (
        masked
    ):  # right padding; the collator left the pad ids in labels, shard_batch must ignore them
        mask = torch.ones(B, S, dtype=torch.long)
        mask[1, S - 3 :] = 0
        mask[2, S - 1 :] = 0
        batch["attention_mask"] = mask
        labels = labels.masked_fill(mask == 0, -100)
    ref = ForCausalLMLoss(logits, labels, V)  # mean over the targets of the full sequence
    shards = _shards(batch, P)
    s = -(-S // P)
    padded = torch.cat([logits, torch.zeros(B, s * P - S, V)], dim=1)  # [B, S_padded, V]
    total = sum(
        ForCausalLMLoss(
            padded[:, r * s : (r + 1) * s].contiguous(),
            None,
            V,
            shift_labels=sh["shift_labels"],
            num_items_in_batch=sh["num_label_tokens"],
        )
        for r, sh in enumerate(shards)
    )
    torch.testing.assert_close(total, ref)
    n = int((torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1) != -100).sum())
    assert all(
        sh["num_label_tokens"].dim() == 0 and sh["num_label_tokens"].dtype == torch.long
        for sh in shards
    )
    assert all(
        int(sh["num_label_tokens"]) == n for sh in shards
    )  # the whole batch's count on every rank


@pytest.mark.parametrize("S,P", [(8, 2), (7, 2), (5, 4), (1, 3), (9, 3)])
def test_shards_concatenate_to_padded_batch(S, P):
    B = 2
    batch = _batch(B, S)
    batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
    batch["token_type_ids"] = torch.ones(B, S, dtype=torch.long)
    batch["meta"], batch["pixel_values"] = "keep", torch.randn(B, 3)
    shards = _shards(batch, P, pad_token_id=0)
    Sp, s = -(-S // P) * P, -(-S // P)
    pad = Sp - S
    for r, sh in enumerate(shards):
        assert "labels" not in sh
        assert sh["input_ids"].shape == (B, s) and sh["shift_labels"].shape == (B, s)
        torch.testing.assert_close(
            sh["position_ids"], torch.arange(r * s, (r + 1) * s).expand(B, s)
        )
        assert sh["meta"] == "keep" and sh["pixel_values"] is batch["pixel_values"]
    zeros, ones = torch.zeros(B, pad, dtype=torch.long), torch.ones(B, S, dtype=torch.long)
    torch.testing.assert_close(_cat(shards, "input_ids"), torch.cat([batch["input_ids"], zeros], 1))
    lab = batch["labels"]
    expect = torch.cat([lab[:, 1:], torch.full((B, 1 + pad), -100)], 1)
    torch.testing.assert_close(_cat(shards, "shift_labels"), expect)
    torch.testing.assert_close(_cat(shards, "attention_mask"), torch.cat([ones, zeros], 1))
    torch.testing.assert_close(_cat(shards, "token_type_ids"), torch.cat([ones, zeros], 1))
    torch.testing.assert_close(_cat(shards, "position_ids"), torch.arange(Sp).expand(B, Sp))


def test_pad_token_and_input_not_mutated():
    batch = _batch(1, 5)
    before = {k: v.clone() for k, v in batch.items()}
    shards = _shards(batch, 2, pad_token_id=7, ignore_index=-1)
    assert _cat(shards, "input_ids")[0, -1] == 7 and _cat(shards, "shift_labels")[0, -1] == -1
    assert set(batch) == set(before) and all(torch.equal(batch[k], before[k]) for k in batch)


def test_given_shift_labels_are_used_as_is():
    batch = _batch(2, 6)
    shift = torch.randint(0, V, (2, 6))
    batch["shift_labels"] = shift
    shards = _shards(batch, 2)
    torch.testing.assert_close(_cat(shards, "shift_labels"), shift)
    assert int(shards[0]["num_label_tokens"]) == 12


def test_no_labels_inference():
    batch = _batch(2, 5, labels=False)
    shards = _shards(batch, 2)
    for sh in shards:
        assert set(sh) == {"input_ids", "position_ids"}
    torch.testing.assert_close(_cat(shards, "input_ids")[:, :5], batch["input_ids"])


@pytest.mark.parametrize("form", ["B", "1"])
def test_position_ids_given(form):
    B, S = 2, 7
    batch = _batch(B, S)
    batch["position_ids"] = torch.arange(S).expand(B if form == "B" else 1, S).clone()
    shards = _shards(batch, 2)
    torch.testing.assert_close(_cat(shards, "position_ids"), torch.arange(8).expand(B, 8))


def test_position_ids_on_padding_are_replaced():
    B, S = 2, 6
    batch = _batch(B, S)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 4:] = 0
    pos = torch.arange(S).repeat(B, 1)
    pos[1, 4:] = 0  # a collator that pads position_ids with 0: not packing, the pads are ignored
    batch.update(attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(
        _cat(_shards(batch, 2), "position_ids"), torch.arange(S).expand(B, S)
    )


def test_non_global_position_ids_raise():
    batch = _batch(1, 6)
    batch["position_ids"] = torch.arange(6)[None] + 3
    with pytest.raises(ValueError, match="global positions"):
        shard_batch(batch, 0, 2)


@pytest.mark.parametrize("where", ["left", "interior"])
def test_left_or_interior_padding_raise(where):
    batch = _batch(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, slice(0, 2) if where == "left" else slice(3, 4)] = 0
    batch["attention_mask"] = mask
    for r in range(2):  # every rank raises the same error
        with pytest.raises(ValueError, match=r"padding_side='right'.*") as err:
            shard_batch(batch, r, 2)
        assert "rows [1]" in str(err.value)


def test_right_padding_all_pad_row_ok():
    batch = _batch(2, 6)
    batch["attention_mask"] = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    shards = _shards(batch, 2)
    assert (
        int(shards[0]["num_label_tokens"]) == 2
    )  # row 0: targets labels[1:4], labels[1] is -100; row 1: none


# ---- packed rows (several documents per row) ----

DOCS = [3, 4, 1, 5]  # one DataCollatorWithFlattening row of 13 tokens, with a 1-token document


def _flattened(**kw):
    gen = torch.Generator().manual_seed(5)
    feats = [{"input_ids": torch.randint(1, V, (n,), generator=gen).tolist()} for n in DOCS]
    for f in feats:
        f["labels"] = list(f["input_ids"])
    return DataCollatorWithFlattening(**kw)(feats)


def _doc_positions(lengths, pad=0):
    pos = torch.cat([torch.arange(n) for n in lengths])
    return torch.cat([pos, pos[-1] + 1 + torch.arange(pad)])  # the tail continues the last document


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("source", ["position_ids", "flash kwargs", "seq_idx", "all"])
def test_packed_flattening_collator(P, source):
    kw = {
        "position_ids": {},
        "all": dict(return_flash_attn_kwargs=True, return_seq_idx=True),
        "flash kwargs": dict(return_position_ids=False, return_flash_attn_kwargs=True),
        "seq_idx": dict(return_position_ids=False, return_seq_idx=True),
    }[source]
    batch = _flattened(**kw)
    S = sum(DOCS)
    s = -(-S // P)
    pad = s * P - S
    shards = _shards(batch, P)
    for sh in shards:
        assert not {
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "seq_idx",
            "labels",
        } & set(sh)
        torch.testing.assert_close(
            sh["upipe_cu_seqlens"], torch.tensor([0, 3, 7, 8, S + pad], dtype=torch.int32)
        )
        assert sh["upipe_max_seqlen"] == 5 + pad and int(sh["num_label_tokens"]) == S - len(DOCS)
    torch.testing.assert_close(_cat(shards, "position_ids"), _doc_positions(DOCS, pad)[None])
    # the collator put -100 on every document's first label, so the plain causal-LM loss is the reference
    logits = torch.randn(1, S, V, generator=torch.Generator().manual_seed(2))
    padded = torch.cat([logits, torch.zeros(1, pad, V)], dim=1)
    total = sum(
        ForCausalLMLoss(
            padded[:, r * s : (r + 1) * s].contiguous(),
            None,
            V,
            shift_labels=sh["shift_labels"],
            num_items_in_batch=sh["num_label_tokens"],
        )
        for r, sh in enumerate(shards)
    )
    torch.testing.assert_close(total, ForCausalLMLoss(logits, batch["labels"], V))


def _rows_batch(layouts, seed=0):
    """B rows of packed documents (labels = input_ids: no separators), with per-document position_ids."""
    gen = torch.Generator().manual_seed(seed)
    S = sum(layouts[0])
    ids = torch.randint(1, V, (len(layouts), S), generator=gen)
    pos = torch.stack([_doc_positions(row) for row in layouts])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _expected_shift(layouts, labels, pad):
    """Target of t is labels[t+1] inside its document, -100 at a document's last token and on the tail."""
    rows = []
    for row, lab in zip(layouts, labels.tolist()):
        out, t = [], 0
        for n in row:
            out += lab[t + 1 : t + n] + [-100]
            t += n
        rows.append(out + [-100] * pad)
    return torch.tensor(rows)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("given", ["labels", "shift_labels"])
def test_packed_targets_never_cross_documents(P, given):
    layouts = [[7, 12, 6], [1, 15, 9]]  # S = 25: odd, padded for every P > 1
    batch = _rows_batch(layouts)
    if given == "shift_labels":  # a given shift_labels is masked at the boundaries too
        batch["shift_labels"] = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], 1)
        del batch["labels"]
        labels = torch.cat([torch.full((2, 1), -100), batch["shift_labels"][:, :-1]], 1)
    else:
        labels = batch["labels"]
    S, s = 25, -(-25 // P)
    pad = s * P - S
    shards = _shards(batch, P)
    expected = _expected_shift(layouts, labels, pad)
    torch.testing.assert_close(_cat(shards, "shift_labels"), expected)
    assert all(int(sh["num_label_tokens"]) == int((expected != -100).sum()) for sh in shards)
    torch.testing.assert_close(
        _cat(shards, "position_ids"),
        torch.stack([_doc_positions(layouts[0], pad), _doc_positions(layouts[1], pad)]),
    )
    cu = [0, 7, 19, 25 + pad, 26 + pad, 41 + pad, 50 + 2 * pad]
    for sh in shards:
        torch.testing.assert_close(sh["upipe_cu_seqlens"], torch.tensor(cu, dtype=torch.int32))
        assert sh["upipe_max_seqlen"] == 15


def test_packed_with_right_padding_and_all_ignored_shards():
    # row 0: documents 3 + 4 then 3 pads; row 1: documents 2 + 6, 2 pads; the pads belong to the last documents
    layouts = [[3, 4, 3], [2, 6, 2]]
    batch = _rows_batch(layouts, seed=1)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:], mask[1, 8:] = 0, 0
    batch["attention_mask"] = mask
    pad0 = torch.zeros(3, dtype=torch.long)  # position_ids padded with 0, as collators do
    batch["position_ids"] = torch.stack(
        [torch.cat([_doc_positions(r), pad0])[:10] for r in ([3, 4], [2, 6])]
    )
    batch["labels"][:, :4] = -100  # a prompt: shard 0 of P=4 has no target at all
    shards = _shards(batch, 4)
    torch.testing.assert_close(
        _cat(shards, "position_ids"),
        torch.stack([_doc_positions([3, 7], 2), _doc_positions([2, 8], 2)]),
    )
    cu = torch.tensor([0, 3, 12, 14, 24], dtype=torch.int32)
    assert all(torch.equal(sh["upipe_cu_seqlens"], cu) for sh in shards)
    assert bool((shards[0]["shift_labels"] == -100).all())
    real_target = torch.cat([mask[:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1).bool()
    expected = _expected_shift([[3, 7], [2, 8]], batch["labels"], 2)
    expected[:, :10] = expected[:, :10].masked_fill(~real_target, -100)
    torch.testing.assert_close(_cat(shards, "shift_labels"), expected)
    logits = torch.randn(2, 12, V, generator=torch.Generator().manual_seed(3))
    losses = [
        ForCausalLMLoss(
            logits[:, 3 * r : 3 * r + 3].contiguous(),
            None,
            V,
            shift_labels=sh["shift_labels"],
            num_items_in_batch=sh["num_label_tokens"],
        )
        for r, sh in enumerate(shards)
    ]
    assert losses[0].item() == 0.0
    torch.testing.assert_close(sum(losses), ForCausalLMLoss(logits, None, V, shift_labels=expected))


def test_packed_errors():
    batch = _rows_batch([[3, 4]])
    bad = dict(
        batch, position_ids=torch.tensor([[0, 1, 2, 5, 6, 7, 8]])
    )  # a document not counting from 0
    with pytest.raises(ValueError, match="count 0, 1, 2"):
        shard_batch(bad, 0, 2)
    other = dict(batch, cu_seq_lens_q=torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(
        ValueError, match="position_ids and cu_seq_lens_q describe different documents"
    ):
        shard_batch(other, 1, 2)
    crossing = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "cu_seq_lens_q": torch.tensor([0, 2, 6, 8]),
    }
    with pytest.raises(ValueError, match="crossing a row boundary"):
        shard_batch(crossing, 0, 2)
    left = dict(batch, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="padding_side='right'"):
        shard_batch(left, 0, 2)
    single = {
        "input_ids": torch.arange(7)[None],
        "cu_seq_lens_q": torch.tensor([0, 7]),
        "max_length_q": 7,
    }
    assert set(shard_batch(single, 0, 2)) == {
        "input_ids",
        "position_ids",
    }  # unsharded varlen kwargs dropped


@pytest.mark.parametrize("bad", [dict(sp_rank=2, sp_size=2), dict(sp_rank=0, sp_size=0)])
def test_bad_rank_or_size(bad):
    with pytest.raises(ValueError, match="sp_rank"):
        shard_batch(_batch(), **bad)


def test_shape_mismatch_and_missing_input_ids():
    batch = _batch(2, 6)
    batch["labels"] = batch["labels"][:, :5]
    with pytest.raises(ValueError, match=r"labels.*\(2, 5\)"):
        shard_batch(batch, 0, 2)
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch({"labels": torch.zeros(1, 4)}, 0, 2)


# ---- ShardedDataLoader on 4 gloo ranks: 2 SP groups of 2 ----


class _Rows(Dataset):
    """Sample i: input_ids = 100*i + [0, 1, ..., S-1] (S odd, so sharding pads), labels the same."""

    def __init__(self, n=8, S=7):
        self.n, self.S = n, S

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.arange(self.S) + 100 * i
        return {"input_ids": ids, "labels": ids.clone()}


def _loader_worker(rank, world):
    state = hf_upipe.init_sequence_parallel(2)
    ds = _Rows()
    sampler = DistributedSampler(ds, shuffle=True, seed=3, **sampler_kwargs(state))
    loader = ShardedDataLoader(
        DataLoader(ds, batch_size=2, sampler=sampler), state, check_same_batch=True
    )
    loader.set_epoch(1)
    shards = [{k: v.tolist() for k, v in sh.items()} for sh in loader]
    # the classic mistake: a sampler over world ranks gives the two ranks of an SP group different samples
    wrong = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    try:
        next(iter(ShardedDataLoader(DataLoader(ds, batch_size=1, sampler=wrong), state)))
        error = None
    except ValueError as err:
        error = str(err)
    return {
        "sp_rank": state.sp_rank,
        "dp_rank": state.dp_rank,
        "len": len(loader),
        "shards": shards,
        "error": error,
    }


def test_sharded_dataloader_distributed():
    out = run_distributed(_loader_worker, 4)
    assert [(o["sp_rank"], o["dp_rank"]) for o in out] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(
        o["len"] == 2 and len(o["shards"]) == 2 for o in out
    )  # 8 samples / 2 SP groups / batch 2
    samples = {}
    for g in range(2):
        first, second = out[2 * g], out[2 * g + 1]
        for a, b in zip(first["shards"], second["shards"]):
            assert len(a["input_ids"][0]) == 4  # S = 7 padded to 8, shards of 4
            ids = torch.cat(
                [torch.tensor(a["input_ids"]), torch.tensor(b["input_ids"])], 1
            )  # [2, 8]
            sample = (ids[:, 0] // 100).tolist()
            torch.testing.assert_close(
                ids[:, :7], torch.arange(7) + 100 * torch.tensor(sample)[:, None]
            )
            assert (
                b["position_ids"][0] == [4, 5, 6, 7]
                and a["num_label_tokens"] == b["num_label_tokens"] == 12
            )
            samples.setdefault(g, []).extend(sample)
    assert sorted(samples[0] + samples[1]) == list(
        range(8)
    )  # the SP groups split the data set, no overlap
    for o in out:
        assert o["error"] is not None and "loaded different batches" in o["error"]
        assert "num_replicas=2" in o["error"]
