"""Packed rows (several documents per row) under sequence parallelism, in real transformers models on gloo ranks.

A packed batch (row 0: documents of 7, 12 and 6 tokens; row 1: 15 and 10; 25 tokens, not a multiple of P) is
cut by `hf_upipe.shard_batch`; each rank runs the model on its shard with the loss of its share of the targets
(`labels=shift_labels, shift_labels=..., num_items_in_batch=num_label_tokens`). The loss and every parameter
gradient summed over the SP ranks, and the logits of every shard, must equal the single-process "sdpa" model on
the unsharded batch (position_ids given, attention_mask None: transformers' own packed-sequence masking), for
Llama (q/k/v/o bias) and Qwen3 (QK-norm), through the registered "upipe" path and the fused path
(`hf_upipe.prepare_model`). Also: right padding with packing, the errors every rank must raise together, and
"upipe" without SP (exactly sdpa, `upipe_cu_seqlens` ignored).
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hf_upipe
from hf_upipe.data import shard_batch
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config

LAYOUT = [[7, 12, 6], [15, 10]]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _packed_batch(vocab, seed, layout=LAYOUT):
    """input_ids [B, S], per-document position_ids, labels with -100 on every document's first token (what
    DataCollatorWithFlattening does, so the single-process model's own label shift never crosses documents)."""
    gen = torch.Generator().manual_seed(seed)
    S = sum(layout[0])
    ids = torch.randint(1, vocab, (len(layout), S), generator=gen)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in layout])
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[0, 8:11] = -100  # and a masked stretch inside a document
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _reference(ref, batch, **kw):
    ref.zero_grad()
    with hf_upipe.without_sequence_parallel():  # one process, the whole batch
        out = ref(
            batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], **kw
        )
    out.loss.backward()
    return (
        out.loss.detach(),
        out.logits.detach(),
        {n: p.grad.clone() for n, p in ref.named_parameters()},
    )


def _sharded_errors(model, ref_out, shard, rank, s, group):
    """Run `model` on this rank's shard; relative errors of the summed loss, the shard's logits, every gradient."""
    ref_loss, ref_logits, ref_grads = ref_out
    model.zero_grad()
    kw = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
    out = model(
        **kw,
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=shard["num_label_tokens"],
    )
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    S = ref_logits.shape[1]
    lo, hi = rank * s, min((rank + 1) * s, S)  # the tail beyond S is padding
    errs = {
        "loss": _rel(loss, ref_loss),
        "logits": _rel(out.logits[:, : max(hi - lo, 0)], ref_logits[:, lo:hi]) if hi > lo else 0.0,
    }
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errs[name] = _rel(g, ref_grads[name.replace("base_model.model.", "")])
    return errs


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except (ValueError, NotImplementedError) as err:
        return (type(err).__name__, str(err))


def _worker(rank, world, archs):
    state = hf_upipe.init_sequence_parallel()
    P, group = state.sp_size, state.sp_group
    results = {}
    for n, arch in enumerate(archs):
        cfg = tiny_config(arch)
        ref, model = build_pair(cfg, "upipe", seed=10 + n)
        fused = hf_upipe.prepare_model(copy.deepcopy(model))
        batch = _packed_batch(cfg.vocab_size, seed=20 + n)
        ref_out = _reference(ref, batch)
        shard = shard_batch(batch, rank, P)
        s = shard["input_ids"].shape[1]
        results[f"{arch} registered"] = _sharded_errors(model, ref_out, shard, rank, s, group)
        results[f"{arch} fused"] = _sharded_errors(fused, ref_out, shard, rank, s, group)
        if n == 0:
            # packing with right padding: row 1 ends in 4 pads (part of its last document). Reference: the same
            # tokens without a mask (causal: no real token sees a later pad), pads' labels ignored.
            padded = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
            padded["attention_mask"][1, -4:] = 0
            padded["labels"] = batch["labels"].masked_fill(padded["attention_mask"] == 0, -100)
            ref_pad = _reference(ref, padded)
            shard_pad = shard_batch(padded, rank, P)
            results[f"{arch} right padding"] = _sharded_errors(
                model, ref_pad, shard_pad, rank, s, group
            )
            # errors, raised on every rank before any all-to-all
            ids, pos = shard["input_ids"], shard["position_ids"]
            other = shard_batch(_packed_batch(cfg.vocab_size, 0, [[5, 20], [25]]), rank, P)[
                "upipe_cu_seqlens"
            ]
            results["errors"] = {
                "no documents": _outcome(lambda: model(ids, position_ids=pos)),
                "no documents fused": _outcome(lambda: fused(ids, position_ids=pos)),
                "documents of another batch": _outcome(
                    lambda: model(ids, position_ids=pos, upipe_cu_seqlens=other)
                ),
            }
            window = build_pair(tiny_config("mistral", sliding_window=4), "upipe", seed=0)[1]
            results["errors"]["sliding window"] = _outcome(
                lambda: window(ids, position_ids=pos, upipe_cu_seqlens=shard["upipe_cu_seqlens"])
            )
    hf_upipe.reset_sequence_parallel()
    return results


ERRORS = {
    "no documents": ("ValueError", "hf_upipe.shard_batch (it adds 'upipe_cu_seqlens'"),
    "no documents fused": ("ValueError", "hf_upipe.shard_batch (it adds 'upipe_cu_seqlens'"),
    "documents of another batch": ("ValueError", "do not match upipe_cu_seqlens"),
    "sliding window": ("NotImplementedError", "a mask other than plain causal (a sliding window"),
}


@pytest.mark.parametrize("world,archs", [(2, ("llama", "qwen3")), (4, ("qwen3",))])
def test_packed_batches_match_single_process_sdpa(world, archs):
    results = run_distributed(_worker, world, archs)
    for rank, res in enumerate(results):
        for case, errs in res.items():
            if case == "errors":
                for name, (kind, text) in ERRORS.items():
                    got_kind, message = errs[name]
                    assert got_kind == kind and text in message, (
                        f"rank {rank}, {name}: {got_kind}: {message}"
                    )
                continue
            for name, e in errs.items():
                assert e < 2e-5, f"rank {rank}, {case}, {name}: rel err {e:.2e}"


def test_without_sp_upipe_is_sdpa_on_packed_batches():
    """One process: "upipe" (registered and fused) is transformers' sdpa, which handles packing itself; the
    shard of sp_size 1 (with upipe_cu_seqlens) gives the same loss and logits as the plain batch."""
    cfg = tiny_config("qwen3")
    ref, model = build_pair(cfg, "upipe", seed=4)
    fused = hf_upipe.prepare_model(copy.deepcopy(model))
    batch = _packed_batch(cfg.vocab_size, seed=5)
    want = ref(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
    shard = shard_batch(batch, 0, 1)
    assert shard["upipe_max_seqlen"] == 15 and shard["upipe_cu_seqlens"].tolist() == [
        0,
        7,
        19,
        25,
        40,
        50,
    ]
    kw = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
    for m in (model, fused):
        got = m(**kw, labels=shard["shift_labels"], shift_labels=shard["shift_labels"])
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
