"""attn_implementation="upipe" in real transformers models: SP on gloo ranks vs the single-process sdpa model.

Llama (with q/k/v/o bias), Qwen2 (q/k/v bias), Mistral and Qwen3 (QK-norm), random weights: logits on every
shard and every parameter gradient (summed over the SP group) equal the single-process model's, for a
sum-over-tokens loss normalised by the global token count.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_upipe
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _loss(logits, shift_labels, n_tokens):
    return (
        F.cross_entropy(
            logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum"
        )
        / n_tokens
    )


def _model_errors(rank, world, arch, geom, chunk, dtype, seed, B=2, S=None, sp_size=None):
    H, Hk = geom
    sp = sp_size or world
    hf_upipe.init_sequence_parallel(sp, heads_per_chunk=chunk)
    state = hf_upipe.get_sequence_parallel_state()
    seed += 1000 * state.dp_rank  # each data-parallel replica works on its own sample
    S = S or 12 * sp
    cfg = tiny_config(arch, heads=H, kv_heads=Hk)
    ref, model = build_pair(cfg, "upipe", seed, dtype=torch.float32)
    model.to(dtype)
    gen = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    labels = torch.cat(
        [ids[:, 1:], torch.full((B, 1), -100)], dim=1
    )  # pre-shifted over the whole sequence
    n_tokens = (labels != -100).sum()
    # single-process reference (fp32, every rank computes it)
    with hf_upipe.without_sequence_parallel():
        ref_logits = ref(ids).logits
    _loss(ref_logits, labels, n_tokens).backward()
    # this rank's shard with global positions
    s = S // sp
    sh = slice(state.sp_rank * s, (state.sp_rank + 1) * s)
    logits = model(ids[:, sh], position_ids=torch.arange(S)[sh].unsqueeze(0)).logits
    _loss(logits, labels[:, sh], n_tokens).backward()
    errs = {"logits": _rel(logits, ref_logits[:, sh])}
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.float().clone()
        dist.all_reduce(g, group=state.sp_group)
        errs[name] = _rel(g, rp.grad)
    base = None
    if dtype != torch.float32:  # the plain single-process model's own error in this dtype
        low = build_pair(cfg, "sdpa", seed)[0].to(dtype)
        with hf_upipe.without_sequence_parallel():
            low_logits = low(ids).logits
        _loss(low_logits, labels, n_tokens).backward()
        base = {"logits": _rel(low_logits[:, sh], ref_logits[:, sh])}
        base.update(
            {
                n: _rel(p.grad, rp.grad)
                for (n, p), (_, rp) in zip(low.named_parameters(), ref.named_parameters())
            }
        )
    hf_upipe.reset_sequence_parallel()
    return errs, base


def _worker(rank, world, cases):
    return [_model_errors(rank, world, *c) for c in cases]


def _check(cases, results):
    for per_rank in results:
        for case, (errs, base) in zip(cases, per_rank):
            for name, e in errs.items():
                if base is None:
                    assert e < 1e-4, f"{name}: rel err {e:.2e} in {case}"
                else:
                    assert e <= 2 * base[name] + 2**-7, (
                        f"{name}: rel err {e:.2e} vs plain {base[name]:.2e} in {case}"
                    )


CASES = {
    2: [
        ("llama", (8, 2), 1, torch.float32, 0),
        ("qwen2", (4, 4), None, torch.float32, 1),
        ("mistral", (8, 4), 2, torch.float32, 2),
        ("qwen3", (6, 2), 1, torch.float32, 3),
        ("llama", (8, 2), 1, torch.bfloat16, 4),
    ],
    4: [
        ("llama", (8, 2), 1, torch.float32, 5),
        ("qwen2", (8, 8), 2, torch.float32, 6),
        ("mistral", (4, 1), None, torch.float32, 7),
        ("qwen3", (8, 4), 1, torch.float32, 8),
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_models_match_single_process_sdpa(world):
    _check(CASES[world], run_distributed(_worker, world, CASES[world]))


def test_sp_groups_with_data_parallel_replicas():
    """World 4 as 2 SP groups of 2 ranks, each group on its own sample."""
    cases = [("llama", (8, 2), 1, torch.float32, 9, 2, None, 2)]
    _check(cases, run_distributed(_worker, 4, cases))
