"""Tests for hf_upipe.ops.tiled_loss: tiled lm_head + CE vs the plain full-logits path, and sp_token_mean on gloo.

References: `_plain` builds the full logits like the HF path (lm_head in the input dtype, then fp32, then
F.cross_entropy with reduction="sum"); fp32 inputs must match it tightly, bf16 inputs must have at most twice the
plain bf16 path's error against an fp64 reference (the flash-attention rule).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from hf_upipe.ops.tiled_loss import (
    TokenStats,
    default_chunk_tokens,
    sp_token_mean,
    tiled_cross_entropy,
)
from hf_upipe.planning import MemoryTracker, fake_tensors
from tests._dist import run_distributed

B, S, DM, V = 2, 37, 48, 203  # odd sizes on purpose


def _inputs(
    seed: int = 0, dtype: torch.dtype = torch.float32, b: int = B, s: int = S, ignored: float = 0.3
):
    """Non-symmetric hidden [b, s, DM], weight [V, DM], bias [V] and labels [b, s] with scattered -100s."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, DM, generator=g) + 0.2
    weight = torch.randn(V, DM, generator=g) * 0.3 + 0.05
    bias = torch.randn(V, generator=g) * 0.5 - 0.1
    labels = torch.randint(0, V, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < ignored] = -100
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), labels


def _plain(hidden, weight, labels, bias=None, softcap=None):
    logits = F.linear(hidden, weight, bias).to(
        torch.promote_types(hidden.dtype, torch.float32)
    )  # [B, s, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
    )


def _close(got, want, msg=None):
    """fp32 agreement: relative 2e-6, absolute 2e-6 of the largest reference entry (fp32 summation order)."""
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item(), msg=msg)


def _run(fn, tensors, dtype, scale=1.0):
    """Loss and grads of fn(*leaves) for fresh leaf copies of `tensors` in `dtype` (None entries pass through)."""
    leaves = [None if t is None else t.detach().to(dtype).clone().requires_grad_() for t in tensors]
    loss = fn(*leaves)
    (loss * scale).backward()
    return [loss.detach().double()] + [None if t is None else t.grad.double() for t in leaves]


@pytest.mark.parametrize("chunk", [1, 5, S, 2 * S, 500, None])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_plain(chunk, with_bias):
    hidden, weight, bias, labels = _inputs()
    bias = bias if with_bias else None
    ref = _run(
        lambda h, w, b: _plain(h, w, labels, b), (hidden, weight, bias), torch.float32, scale=0.01
    )
    out = _run(
        lambda h, w, b: tiled_cross_entropy(h, w, labels, bias=b, chunk_tokens=chunk)[0],
        (hidden, weight, bias),
        torch.float32,
        scale=0.01,
    )
    for name, got, want in zip(["loss", "d hidden", "d weight", "d bias"], out, ref):
        if want is not None:
            _close(got, want, msg=name)


@pytest.mark.parametrize("chunk", [1, 7, 500])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_error_at_most_twice_plain(chunk, seed):
    hidden, weight, bias, labels = _inputs(seed, dtype=torch.bfloat16)
    n = int((labels != -100).sum())
    ref = _run(
        lambda h, w, b: _plain(h, w, labels, b), (hidden, weight, bias), torch.float64, 1 / n
    )
    plain = _run(
        lambda h, w, b: _plain(h, w, labels, b), (hidden, weight, bias), torch.bfloat16, 1 / n
    )
    tiled = _run(
        lambda h, w, b: tiled_cross_entropy(h, w, labels, bias=b, chunk_tokens=chunk)[0],
        (hidden, weight, bias),
        torch.bfloat16,
        1 / n,
    )
    for name, got, base, want in zip(["loss", "d hidden", "d weight", "d bias"], tiled, plain, ref):
        err, base_err = (got - want).abs().max().item(), (base - want).abs().max().item()
        floor = (
            1e-6 * want.abs().max().item()
        )  # fp32 summation-order noise where bf16 rounding cancels
        assert err <= 2 * base_err + floor, (
            f"{name}: tiled error {err:.3e} > 2 x plain bf16 error {base_err:.3e}"
        )


def _emulated_fused(acc, a, b, beta):
    """What cuBLAS does for `_addmm_wide` (fp32 output, fp32 accumulation of exact bf16 products), on CPU."""
    if beta == 0:
        acc.zero_()
    acc.addmm_(a.float(), b.float())


@pytest.mark.parametrize("chunk", [1, 7, 500])
def test_bf16_fused_accumulation_path(monkeypatch, chunk):
    """The CUDA path (d weight summed in fp32 inside the GEMM, emulated exactly on CPU): at most twice the plain
    bf16 error, and the d weight of chunk 1 and of one chunk agree to fp32 rounding (no chunk dropped or doubled,
    no per-chunk bf16 rounding)."""
    from hf_upipe.ops import tiled_loss

    monkeypatch.setattr(tiled_loss, "_fused_accumulate", lambda grad_w: True)
    monkeypatch.setattr(tiled_loss, "_addmm_wide", _emulated_fused)
    hidden, weight, bias, labels = _inputs(3, dtype=torch.bfloat16)
    n = int((labels != -100).sum())
    args = ((hidden, weight, bias), torch.bfloat16, 1 / n)
    ref = _run(
        lambda h, w, b: _plain(h, w, labels, b), (hidden, weight, bias), torch.float64, 1 / n
    )
    plain = _run(lambda h, w, b: _plain(h, w, labels, b), *args)
    tiled = _run(
        lambda h, w, b: tiled_cross_entropy(h, w, labels, bias=b, chunk_tokens=chunk)[0], *args
    )
    for name, got, base, want in zip(["loss", "d hidden", "d weight", "d bias"], tiled, plain, ref):
        err, base_err = (got - want).abs().max().item(), (base - want).abs().max().item()
        assert err <= 2 * base_err + 1e-6 * want.abs().max().item(), (name, err, base_err)
    whole = _run(
        lambda h, w, b: tiled_cross_entropy(h, w, labels, bias=b, chunk_tokens=10**6)[0], *args
    )
    acc = {}
    for k, c in (
        ("chunked", chunk),
        ("whole", 10**6),
    ):  # the fp32 accumulators before the bf16 rounding
        with torch.no_grad():
            out = tiled_loss.tiled_cross_entropy_forward(
                hidden, weight, bias, labels, c, -100, None, (True, True, True)
            )
        acc[k] = out[3]
    torch.testing.assert_close(acc["chunked"], acc["whole"], rtol=1e-5, atol=1e-5)
    assert (whole[2] - tiled[2]).abs().max() <= 2 * (plain[2] - ref[2]).abs().max()


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_softcap_and_batch_of_three(chunk):
    hidden, weight, _, labels = _inputs(2, b=3, s=11)
    ref = _run(lambda h, w: _plain(h, w, labels, softcap=2.5), (hidden, weight), torch.float64)
    out = _run(
        lambda h, w: tiled_cross_entropy(h, w, labels, chunk_tokens=chunk, logit_softcap=2.5)[0],
        (hidden, weight),
        torch.float64,
    )
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk,softcap", [(1, None), (6, None), (1000, None), (5, 2.5)])
def test_token_stats_equal_the_full_logits_and_leave_the_loss_bit_identical(chunk, softcap):
    """TokenStats (TRL's entropy and mean_token_accuracy numerators) from the tiles equal those of the full logits,
    over label tokens only; the loss and every gradient are bit-identical with and without them."""
    hidden, weight, bias, labels = _inputs(4)
    with torch.no_grad():  # half of the label tokens are the argmax: accuracy far from 0 and from 1
        full = F.linear(hidden, weight, bias)  # [B, s, V]
        if softcap is not None:
            full = torch.tanh(full / softcap) * softcap
        top = full.argmax(-1)
        pick = (torch.arange(S) % 2 == 0).expand(B, S) & (labels != -100)
        labels = torch.where(pick, top, labels)
    valid = labels != -100
    logp = full.double().log_softmax(-1)
    want_entropy = -(logp.exp() * logp).sum(-1)[valid].sum()
    want_correct = (top == labels)[valid].sum()
    assert 0.3 < want_correct / valid.sum() < 0.9

    def run(stats):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss, _ = tiled_cross_entropy(
            h, w, labels, bias=b, chunk_tokens=chunk, logit_softcap=softcap, token_stats=stats
        )
        loss.backward()
        return [loss.detach(), h.grad, w.grad, b.grad]

    stats = TokenStats()
    for got, want in zip(run(stats), run(None)):
        assert torch.equal(got, want)
    assert stats.correct.item() == want_correct.item()
    torch.testing.assert_close(stats.entropy_sum, want_entropy, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_ignored_shard_gives_zero_and_no_nan(dtype):
    hidden, weight, bias, _ = _inputs(dtype=dtype)
    labels = torch.full((B, S), -100)
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss_sum, n = tiled_cross_entropy(h, w, labels, bias=b, chunk_tokens=8)
    assert loss_sum.item() == 0.0 and n.item() == 0 and n.dtype == torch.int64
    mean = sp_token_mean(loss_sum, n, None)
    mean.backward()
    assert mean.item() == 0.0
    for t in (h, w, b):
        assert t.grad is not None and torch.isfinite(t.grad).all() and not t.grad.any()


def test_frozen_weight_skips_its_gradient():
    hidden, weight, _, labels = _inputs(3)
    ref = _run(lambda h: _plain(h, weight, labels), (hidden,), torch.float32)
    peaks = {}
    for trainable in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        with MemoryTracker() as tracker:
            loss_sum, _ = tiled_cross_entropy(h, w, labels, chunk_tokens=4)
            loss_sum.backward()
        peaks[trainable] = tracker.peak_bytes
        assert (w.grad is not None) == trainable
        _close(h.grad.double(), ref[1])
    # Frozen: no fp32 [V, DM] accumulator and no scaled copy of it.
    assert peaks[False] <= peaks[True] - weight.numel() * 4, peaks


def test_tied_embedding_gets_both_gradients():
    torch.manual_seed(4)
    embed = torch.nn.Embedding(V, DM)
    ids = torch.randint(0, V, (B, S))
    _, _, _, labels = _inputs(4)

    def grad_of(loss_fn):
        embed.zero_grad(set_to_none=True)
        hidden = torch.tanh(
            embed(ids) * 1.5 + 0.1
        )  # [B, S, DM], tied: lm_head weight is embed.weight
        loss_fn(hidden, embed.weight).backward()
        return embed.weight.grad.clone()

    want = grad_of(lambda h, w: _plain(h, w, labels))
    got = grad_of(lambda h, w: tiled_cross_entropy(h, w, labels, chunk_tokens=9)[0])
    _close(got, want)


def test_no_grad_and_noncontiguous_hidden():
    hidden, weight, _, labels = _inputs(5)
    h_t = (
        hidden.transpose(0, 1).contiguous().transpose(0, 1)
    )  # same values, non-contiguous [B, S, DM]
    assert not h_t.is_contiguous()
    with torch.no_grad():
        loss_sum, n = tiled_cross_entropy(h_t, weight.requires_grad_(), labels, chunk_tokens=6)
    assert not loss_sum.requires_grad and weight.grad is None
    torch.testing.assert_close(loss_sum, _plain(hidden, weight, labels).detach())
    assert n.item() == int((labels != -100).sum())
    ref = _run(lambda h: _plain(h, weight.detach(), labels), (hidden,), torch.float32)
    h = h_t.detach().requires_grad_()
    tiled_cross_entropy(h, weight.detach(), labels.int(), chunk_tokens=6)[
        0
    ].backward()  # int32 labels too
    _close(h.grad.double(), ref[1])


def test_default_chunk_and_input_checks():
    assert default_chunk_tokens(32000) == 4096  # ceil(512 MiB / (4 * 32000)) = 4195, to 128s
    assert default_chunk_tokens(128256) == 1024 and default_chunk_tokens(2**40) == 1
    assert default_chunk_tokens(2**22) == 32  # below 128 tokens: rounded up, not to 128s
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match=r"\[V, Dm=48\]"):
        tiled_cross_entropy(hidden, weight[:, :40], labels)
    with pytest.raises(ValueError, match="cast hidden"):
        tiled_cross_entropy(hidden.double(), weight, labels)
    with pytest.raises(ValueError, match=r"\[2, 37\]"):
        tiled_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        tiled_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        tiled_cross_entropy(hidden, weight, labels, logit_softcap=0.0)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_tracked_peak_below_quarter_of_plain(mode):
    """vocab 32000, 4096 tokens, chunk 512: forward + backward peak < 1/4 of the plain path (fake counts equal)."""
    vocab, tokens, dm = 32000, 4096, 64
    peaks = {}
    with fake_tensors() if mode == "fake" else contextlib.nullcontext():
        hidden = torch.randn(1, tokens, dm, requires_grad=True)
        weight = torch.randn(vocab, dm, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        for name in ("tiled", "plain"):
            with MemoryTracker() as tracker:
                if name == "tiled":
                    loss = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=512)[0]
                else:
                    loss = _plain(hidden, weight, labels)
                loss.backward()
            peaks[name] = tracker.peak_bytes
            hidden.grad = weight.grad = None
            del loss
    assert (
        peaks["plain"] == 3 * tokens * vocab * 4 + 8
    )  # logits, log-softmax, its gradient (+ the loss scalar)
    assert peaks["tiled"] < peaks["plain"] / 4, peaks
    assert (
        peaks["tiled"] < 2 * 512 * vocab * 4 + 3 * vocab * dm * 4
    )  # ~ one fp32 chunk + fp32 d weight


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_bf16_peak_at_most_015_of_plain_at_16k_scaled(mode):
    """Llama 3's lm_head at 16K local tokens (vocab 128256, hidden 4096, the default chunk of 1024 tokens), every
    size divided by 16: the tracked forward + backward peak is at most 0.15 of the plain path's (the ratio does
    not depend on the scale: every term is a product of two of the sizes); real and fake counts are equal."""
    tokens, vocab, dm, chunk = 16384 // 16, 128256 // 16, 4096 // 16, 1024 // 16
    peaks = {}
    with fake_tensors() if mode == "fake" else contextlib.nullcontext():
        hidden = torch.randn(1, tokens, dm, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(vocab, dm, dtype=torch.bfloat16).mul_(0.02).requires_grad_()
        labels = torch.randint(0, vocab, (1, tokens))
        labels[:, ::10] = -100
        for name in ("tiled", "plain"):
            with MemoryTracker() as tracker:
                if name == "tiled":
                    loss = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)[0]
                else:
                    loss = _plain(hidden, weight, labels)
                loss.backward()
            peaks[name] = tracker.peak_bytes
            hidden.grad = weight.grad = None
            del loss
    # backward: fp32 accumulator + bf16 result + d hidden twice (+ two loss scalars); the forward's chunk (6 bytes
    # per logit) fits below. On CPU the backward rounds by blocks through an fp32 buffer of vocab / 8 rows.
    expected = vocab * dm * 6 + tokens * dm * 2 * 2 + 16
    assert peaks["tiled"] == expected + (mode == "real") * math.ceil(vocab / 8) * dm * 4, peaks
    assert peaks["tiled"] <= 0.15 * peaks["plain"], peaks


# ---------------------------------------------------------------- distributed: sp_token_mean on 2 gloo ranks
_DIST_CASES = {  # label tokens kept per rank (fraction of the shard), rank 0 first
    "rank0_empty": (0.0, 0.6),
    "uneven": (0.3, 0.9),
    "all_empty": (0.0, 0.0),
}


def _dist_inputs(case: str, world: int):
    """Full-sequence inputs [B, world * S] with rank r's shard keeping the fraction _DIST_CASES[case][r] of labels."""
    hidden, weight, bias, _ = _inputs(7, s=world * S, ignored=0.0)
    g = torch.Generator().manual_seed(8)
    labels = torch.randint(0, V, (B, world * S), generator=g)
    keep = torch.rand(B, world * S, generator=g)
    for r, frac in enumerate(_DIST_CASES[case]):
        shard = labels[:, r * S : (r + 1) * S]  # [B, S] view
        shard[keep[:, r * S : (r + 1) * S] >= frac] = -100
    return hidden, weight, bias, labels


def _sp_mean_worker(rank: int, world: int) -> dict:
    """Every case of _DIST_CASES on this rank: the SP mean, this rank's label count and its gradients."""
    import torch.distributed as dist

    out = {}
    for case in _DIST_CASES:
        hidden, weight, bias, labels = _dist_inputs(case, world)
        shard = slice(rank * S, (rank + 1) * S)
        h = hidden[:, shard].clone().requires_grad_()  # [B, S, DM]: this rank's sequence shard
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        loss_sum, n = tiled_cross_entropy(h, w, labels[:, shard], bias=b, chunk_tokens=10)
        mean = sp_token_mean(loss_sum, n, dist.group.WORLD)
        mean.backward()
        out[case] = {
            "loss": mean.item(),
            "n": int(n),
            "dh": h.grad.tolist(),
            "dw": w.grad.tolist(),
            "db": b.grad.tolist(),
        }
    return out


def test_sp_token_mean_two_ranks_equals_single_process():
    """Loss on every rank = global token mean; d hidden per shard = reference rows; param grads summed = reference."""
    world = 2
    per_rank = run_distributed(_sp_mean_worker, world)
    for case in _DIST_CASES:
        results = [r[case] for r in per_rank]
        hidden, weight, bias, labels = _dist_inputs(case, world)
        n_total = int((labels != -100).sum())
        assert [r["n"] for r in results] == [
            int((labels[:, r * S : (r + 1) * S] != -100).sum()) for r in range(world)
        ]
        if case == "rank0_empty":
            assert results[0]["n"] == 0 < results[1]["n"]
        scale = 1 / max(n_total, 1)
        ref = _run(
            lambda h, w, b: _plain(h, w, labels, b), (hidden, weight, bias), torch.float64, scale
        )
        want_loss = ref[0].item() * scale
        for r, res in enumerate(results):
            assert res["loss"] == pytest.approx(want_loss, rel=1e-6, abs=1e-7), case
            torch.testing.assert_close(
                torch.tensor(res["dh"], dtype=torch.float64),
                ref[1][:, r * S : (r + 1) * S],
                rtol=1e-5,
                atol=1e-7,
                msg=f"{case}: d hidden of rank {r}",
            )
        for key, want in (
            ("dw", ref[2]),
            ("db", ref[3]),
        ):  # parameter grads summed over the SP group
            got = sum(torch.tensor(res[key], dtype=torch.float64) for res in results)
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-7, msg=f"{case}: {key} summed over ranks"
            )
        if case == "all_empty":
            assert want_loss == 0 and all(res["loss"] == 0.0 for res in results)


@pytest.mark.parametrize("tiled", [True, False])
def test_shard_loss_sum_saves_no_view_of_the_final_hidden(tiled):
    """On the tiled path the lm_head gets a fresh empty input, not a view of the final-norm output: its autograd node
    saves that input, and a view would keep the whole [B, s, Dm] tensor alive through the backward (one activation
    per rank). The plain path's lm_head does save it, which shows the check can see it."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.training.loss import shard_loss_sum
    from tests.integrations._models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    final, saved = [], []
    handle = model.model.norm.register_forward_hook(
        lambda m, a, out: final.append(out.untyped_storage().data_ptr())
    )

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = shard_loss_sum(model, {"input_ids": ids}, ids, tiled=tiled)
    handle.remove()
    assert len(final) == 1
    assert (final[0] in saved) is (not tiled)
    loss.backward()
