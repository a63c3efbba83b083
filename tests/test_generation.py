"""`hf_upipe.generate` under sequence parallelism against transformers' `generate` of the same model in one process
(fp32, random non-symmetric weights, a prompt of 21 tokens split across the ranks, 32 new tokens):

- greedy tokens equal token for token, on Llama (plain and with LoRA), Qwen3 with LoRA and Mistral with a
  sliding window (5, shorter than the prompt and than a shard) with LoRA; 2 ranks here, 4 in the slow tier;
- the logits before each generated token equal one process's teacher-forced logits on the generated sequence (the
  log-probabilities, rel 1e-4);
- each rank caches 1/P of the one-process KV cache's elements; with a window, the ranks keep only the prompt's
  last W - 1 tokens (and the new tokens);
- seeded sampling (temperature, top-k, top-p) draws the same tokens as one process with the same seed; stopping
  at an eos token and a one-token prompt (a rank starting with an empty cache) equal one process too;
- a batch of 4 left-padded prompts of different lengths with num_return_sequences=2 equals one process's batched
  `generate` token for token: greedy (with and without an eos that stops the rows at different steps, padded
  after it) and seeded sampling (one draw over the whole batch per step, on SP rank 0, as one process draws);
- refusals: a right-padded row, a KV cache to fill for several rows, a model in training mode, a model whose
  attention is not "upipe", no sequence parallelism.
"""

import pytest
import torch

import hf_upipe
from hf_upipe.generation import ShardKVCache
from tests._dist import run_distributed, settle_collectives

L, NEW, WINDOW = 21, 32, 5
CASES = {
    "llama": ("llama", {}, False),
    "llama lora": ("llama", {}, True),
    "qwen3 lora": ("qwen3", {}, True),
    "mistral window lora": ("mistral", {"sliding_window": WINDOW}, True),
}


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _models(case):
    from tests.integrations._models import build_pair, lora_pair, tiny_config

    arch, overrides, lora = CASES[case]
    ref, model = build_pair(tiny_config(arch, **overrides), "upipe", seed=3)
    if lora:
        ref, model = lora_pair(ref, model)
    ref.eval()
    model.eval()
    hf_upipe.prepare_model(model)
    return ref, model


def _cache_numel(cache) -> int:
    """Elements of the keys and values of a transformers cache (every layer)."""
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)


def _worker(rank, world, cases, ring_size=1):
    hf_upipe.init_sequence_parallel(world, ring_size=ring_size)
    ids = torch.randint(3, 96, (1, L), generator=torch.Generator().manual_seed(11))
    results = {}
    for case in cases:
        ref, model = _models(case)
        with hf_upipe.without_sequence_parallel():
            want = ref.generate(
                ids,
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                use_cache=True,
                return_dict_in_generate=True,
            )
            # teacher-forced: the logits of the whole generated sequence, one call without a cache
            forced = ref(input_ids=want.sequences, use_cache=False).logits[0, L - 1 : -1]
        cache = ShardKVCache()
        got, scores = hf_upipe.generate(
            model, ids, max_new_tokens=NEW, eos_token_id=[], kv_cache=cache, return_scores=True
        )
        results[case] = {
            "equal": got.tolist() == want.sequences.tolist(),
            "new": got.shape[1] - L,
            "distinct": len(set(got[0, L:].tolist())),
            "logprobs": _rel(scores[:, 0].log_softmax(-1), forced.log_softmax(-1)),
            "cache": cache.numel(),
            "tokens": cache.tokens,
            "reference cache": _cache_numel(want.past_key_values),
            # a full (unwindowed) cache of the whole sequence: 2 * layers * kv_heads * head_dim * tokens
            "full cache": 2
            * len(cache.keys)
            * cache.keys[0].shape[0]
            * cache.keys[0].shape[2]
            * (L + NEW - 1),
        }
        if case.startswith("mistral"):  # the window matters: without it the tokens differ
            with hf_upipe.without_sequence_parallel():
                ref.config.sliding_window = None
                unwindowed = ref.generate(
                    ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
                )
            results[case]["window matters"] = unwindowed.tolist() != want.sequences.tolist()
    hf_upipe.reset_sequence_parallel()
    return results


def _check(results, world):
    for case in results[0]:
        every = [r[case] for r in results]
        for got in every:
            assert got["equal"] and got["new"] == NEW, (case, got)
            assert got["distinct"] > 3, (case, got)  # not a degenerate repetition
            assert got["logprobs"] < 1e-4, (case, got)
            assert got.get("window matters", True), (case, got)
        # the one-process cache holds L + NEW - 1 tokens (the last token is not fed back); the ranks share them
        total = L + NEW - 1
        assert sum(g["tokens"] for g in every) == total
        full = every[0]["full cache"]
        for got in every:
            assert got["tokens"] in (total // world, -(-total // world)), every
        if case.startswith("mistral"):
            # one process keeps the window's last W - 1 tokens; the ranks keep the prompt's last W - 1 tokens and
            # every new token fed back (NEW - 1)
            per_token = full // total
            assert every[0]["reference cache"] == per_token * (WINDOW - 1), every
            assert sum(g["cache"] for g in every) == per_token * (WINDOW - 1 + NEW - 1), every
            continue
        assert every[0]["reference cache"] == full, every
        assert sum(g["cache"] for g in every) == full, every
        for got in every:
            assert got["cache"] * total == full * got["tokens"], every


def test_greedy_two_ranks():
    _check(run_distributed(_worker, 2, list(CASES), timeout=300), 2)


@pytest.mark.slow
def test_greedy_four_ranks():
    _check(run_distributed(_worker, 4, list(CASES), timeout=600), 4)


@pytest.mark.slow
def test_greedy_ring():
    """A ring of 2 (ranks hold mirrored chunks, positions not contiguous): the same equalities."""
    _check(run_distributed(_worker, 4, ["llama", "qwen3 lora"], 2, timeout=600), 4)


def test_partial_attention_in_key_chunks(monkeypatch):
    """The decode step's partial attention (GQA, a window's visibility, keys read in chunks of 3) equals softmax
    attention over the visible keys with the KV heads repeated."""
    from hf_upipe import generation

    monkeypatch.setattr(generation, "_KEY_CHUNK", 3)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((8, 4), (2, 10, 4), (2, 10, 6)))
    visible = torch.arange(10) > 2  # [n]
    out, lse = generation._partial(q, k, v, visible, 0.7)
    scores = torch.einsum("hd,hnd->hn", q, k.repeat_interleave(4, 0)) * 0.7  # [8, 10]
    scores[:, ~visible] = float("-inf")
    want = torch.einsum(
        "hn,hne->he", torch.softmax(scores, -1), v.repeat_interleave(4, 0)
    )  # [8, 6]
    assert _rel(out, want) < 1e-6
    assert _rel(lse, torch.logsumexp(scores, -1)) < 1e-6


def _sampling_worker(rank, world):
    hf_upipe.init_sequence_parallel(world)
    ids = torch.randint(3, 96, (1, L), generator=torch.Generator().manual_seed(11))
    ref, model = _models("qwen3 lora")
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=NEW)
    torch.manual_seed(123)
    with hf_upipe.without_sequence_parallel():
        want = ref.generate(ids, eos_token_id=None, pad_token_id=0, **settings)
    torch.manual_seed(123 if rank == 0 else 7)  # only SP rank 0 draws
    got = hf_upipe.generate(model, ids, eos_token_id=[], **settings)
    greedy = hf_upipe.generate(model, ids, max_new_tokens=NEW, eos_token_id=[])
    # stopping at an eos token (the 6th greedy token), and a one-token prompt (rank 1 starts with no token)
    stop = int(greedy[0, L + 5])
    with hf_upipe.without_sequence_parallel():
        want_eos = ref.generate(ids, max_new_tokens=NEW, eos_token_id=stop, pad_token_id=0)
        want_short = ref.generate(ids[:, :1], max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    got_eos = hf_upipe.generate(model, ids, max_new_tokens=NEW, eos_token_id=stop)
    got_short = hf_upipe.generate(model, ids[:, :1], max_new_tokens=NEW, eos_token_id=[])
    hf_upipe.reset_sequence_parallel()
    return {
        "sampled": (got.tolist(), want.tolist()),
        "greedy": greedy.tolist(),
        "eos": (got_eos.tolist(), want_eos.tolist()),
        "short": (got_short.tolist(), want_short.tolist()),
    }


def test_sampling_stopping_and_short_prompts_equal_one_process():
    results = run_distributed(_sampling_worker, 2, timeout=300)
    for got in results:
        assert got["sampled"][0] == got["sampled"][1] == results[0]["sampled"][0]
        assert got["sampled"][0] != got["greedy"]  # the draws are not the argmax
        assert got["eos"][0] == got["eos"][1] and len(got["eos"][0][0]) <= L + 6, got["eos"]
        assert got["short"][0] == got["short"][1] and len(got["short"][0][0]) == 1 + NEW


def _refusal_worker(rank, world):
    from tests.integrations._models import build_pair, tiny_config

    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except (ValueError, NotImplementedError) as error:
            errors[name] = str(error)

    ids = torch.randint(3, 96, (1, 8))
    ref, model = build_pair(tiny_config("llama"), "upipe", seed=0)
    ref.eval()
    model.eval()
    attempt("no sp", lambda: hf_upipe.generate(model, ids, max_new_tokens=2))
    hf_upipe.init_sequence_parallel(world)
    hf_upipe.prepare_model(model)
    right = torch.tensor([[1] * 6 + [0] * 2, [1] * 8])  # the first row padded on the right
    attempt(
        "right padding",
        lambda: hf_upipe.generate(model, ids.repeat(2, 1), attention_mask=right, max_new_tokens=2),
    )
    attempt(
        "cache of two rows",
        lambda: hf_upipe.generate(
            model, ids.repeat(2, 1), max_new_tokens=2, kv_cache=ShardKVCache()
        ),
    )
    attempt("not upipe", lambda: hf_upipe.generate(ref, ids, max_new_tokens=2))
    attempt("model.generate", lambda: model.generate(ids, max_new_tokens=2))
    attempt("training", lambda: hf_upipe.generate(model.train(), ids, max_new_tokens=2))
    hf_upipe.reset_sequence_parallel()
    return errors


def test_refusals():
    for errors in run_distributed(_refusal_worker, 2):
        assert "init_sequence_parallel" in errors["no sp"], errors
        assert "row 0" in errors["right padding"] and "left" in errors["right padding"], errors
        assert "2 rows" in errors["cache of two rows"], errors
        assert "prepare_model" in errors["not upipe"] and "'sdpa'" in errors["not upipe"], errors
        assert "hf_upipe.generate" in errors["model.generate"], errors
        assert "model.eval()" in errors["training"], errors


def _tracked_worker(rank, world):
    from hf_upipe.planning.tracker import MemoryTracker

    settle_collectives()
    hf_upipe.init_sequence_parallel(world)
    ids = torch.randint(3, 96, (1, L), generator=torch.Generator().manual_seed(11))
    ref, model = _models("llama")
    with hf_upipe.without_sequence_parallel(), MemoryTracker() as one:
        want = ref.generate(
            ids,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            use_cache=True,
            return_dict_in_generate=True,
        )
    cache = ShardKVCache()
    with MemoryTracker() as tracker:
        got = hf_upipe.generate(model, ids, max_new_tokens=NEW, eos_token_id=[], kv_cache=cache)
    hf_upipe.reset_sequence_parallel()
    # what stays allocated after the call, less the returned ids: the KV cache (and, here, its positions)
    return {
        "one process": one.current_bytes - want.sequences.nbytes,
        "rank": tracker.current_bytes - got.nbytes - cache.positions.nbytes,
        "cache": cache.nbytes(),
        "tokens": cache.tokens,
    }


def test_tracked_cache_memory_is_one_over_p():
    """The tracker's live bytes after generation: each rank holds exactly its cache, 1/P of one process's."""
    results = run_distributed(_tracked_worker, 2)
    total = L + NEW - 1
    for got in results:
        assert got["rank"] == got["cache"], got
        assert got["rank"] * total == got["one process"] * got["tokens"], got
    assert sum(g["rank"] for g in results) == results[0]["one process"]


PROMPTS = (21, 9, 14, 5)  # the batch's prompt lengths (left-padded to 21)


def _batch():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 96, (len(PROMPTS), max(PROMPTS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPTS):
        mask[row, -n:] = 1
    return ids.masked_fill(mask == 0, 0), mask  # [4, 21]: pad 0 on the left


def _batched_worker(rank, world, case="qwen3 lora"):
    hf_upipe.init_sequence_parallel(world)
    ids, mask = _batch()
    ref, model = _models(case)
    common = dict(max_new_tokens=12, pad_token_id=0)
    out = {}
    with hf_upipe.without_sequence_parallel():
        greedy = ref.generate(
            ids.repeat_interleave(2, 0),
            attention_mask=mask.repeat_interleave(2, 0),
            eos_token_id=None,
            **common,
        )
    got = hf_upipe.generate(
        model, ids, attention_mask=mask, num_return_sequences=2, eos_token_id=[], **common
    )
    out["greedy"] = (got.tolist(), greedy.tolist())
    stop = int(greedy[0, max(PROMPTS) + 3])  # row 0's 4th token: the rows stop at different steps
    with hf_upipe.without_sequence_parallel():
        want = ref.generate(
            ids.repeat_interleave(2, 0),
            attention_mask=mask.repeat_interleave(2, 0),
            eos_token_id=stop,
            **common,
        )
    got = hf_upipe.generate(
        model, ids, attention_mask=mask, num_return_sequences=2, eos_token_id=stop, **common
    )
    out["eos"] = (got.tolist(), want.tolist())
    sampling = dict(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.9, num_return_sequences=2, **common
    )
    torch.manual_seed(123)
    with hf_upipe.without_sequence_parallel():
        want = ref.generate(ids, attention_mask=mask, eos_token_id=stop, **sampling)
    torch.manual_seed(123 if rank == 0 else 7)  # only SP rank 0 draws
    got = hf_upipe.generate(model, ids, attention_mask=mask, eos_token_id=stop, **sampling)
    out["sampled"] = (got.tolist(), want.tolist())
    hf_upipe.reset_sequence_parallel()
    return out


def _check_batched(results):
    for got in results:
        for name in ("greedy", "eos", "sampled"):
            assert got[name][0] == got[name][1] == results[0][name][1], (name, got[name])
        greedy, eos, sampled = (got[n][1] for n in ("greedy", "eos", "sampled"))
        assert len(greedy) == 2 * len(PROMPTS) and greedy[0] == greedy[1]
        assert len({tuple(r) for r in greedy}) == len(PROMPTS)  # the prompts' rows differ
        L, stop = max(PROMPTS), eos[0][max(PROMPTS) + 3]
        # row 0 stopped at its 4th token and is padded after it while another row ran on
        assert len(eos[0]) > L + 4 and set(eos[0][L + 4 :]) == {0}, eos
        assert any(r[L + 4] != 0 for r in eos) and stop != 0, eos
        assert (
            sampled != greedy and sampled[0] != sampled[1]
        )  # draws, not the argmax; the two draws differ


def test_batched_left_padded_num_return_sequences_two_ranks():
    _check_batched(run_distributed(_batched_worker, 2, timeout=300))


@pytest.mark.slow
def test_batched_four_ranks():
    _check_batched(run_distributed(_batched_worker, 4, "llama", timeout=600))
