"""Generation under sequence parallelism: each rank prefills its shard of the prompt and keeps that shard's KV cache.

Entry points:
- `generate(model, input_ids, *, max_new_tokens, attention_mask=None, num_return_sequences=1, do_sample=False,
  temperature=1.0, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, kv_cache=None, generator=None)`:
  the left-padded prompts [B, L] (the same on every rank of the SP group), each repeated num_return_sequences times,
  followed by the generated tokens, [B * num_return_sequences, L + n], on every rank; `model` prepared with
  `hf_upipe.prepare_model` ("upipe" attention) after `hf_upipe.init_sequence_parallel`.
- `ShardKVCache`: one rank's cache (keys and values of all layers and heads, for the tokens this rank holds, with
  their global positions); pass one as `kv_cache=` to see what a rank kept (`numel()`, `nbytes()`). It lives in
  `hf_upipe.generation_cache`, with the schedule of which rank caches which token.

The flow, on every rank of the SP group (P ranks), for each row (its prompt without its left padding, at positions
0..L_row - 1, as one process's `generate` numbers them from the attention mask; each sampled draw of a prompt with
its own copy of the prompt's cache; greedy draws of one prompt are decoded once and repeated):
1. prefill: the rank's shard of the prompt (`hf_upipe.shard_batch`: global position_ids) runs through the model on
   the training path ("upipe" attention under SP), while `attention_override` records each layer's keys and values
   of the shard (RoPE applied) before the attention's all-to-all. The cache is never gathered: a rank holds
   L / P prompt tokens. The rank holding the last prompt token broadcasts its logits (one [V] vector).
2. decode: every rank runs the running rows' new tokens [b, 1] through the model in one forward, on its own
   (embeddings, norms and MLPs are per token), with an attention that lets each row's query attend to the row's
   cached keys on this rank; the partial outputs [b, H, Dv] and their log-sum-exps [b, H] are all-gathered over the
   SP group (one all-gather per layer) and merged (exact softmax over all keys). A token's own keys and values are
   appended on one rank: the one with the fewest cached tokens of its row (ties: the lowest rank), so the caches
   stay balanced. Positions are global (L_row + step). Sliding windows mask keys by global
   position (key t seen by query i when i - t < window).
3. the next tokens [B']: the argmax (greedy) or one draw over the whole batch from the processed distribution
   (transformers' temperature, top-k, top-p warpers, in that order; `torch.multinomial` on [B', V], as one process
   draws), decided on SP rank 0 and broadcast, so every rank holds the same sequences. A row stops at an
   `eos_token_id` and is padded after it with `pad_token_id`; generation stops after `max_new_tokens` or when every
   row has stopped.

Refused on every rank before any collective: a row not left-padded, a KV cache to show for more than one row, a
model in training mode, a model whose attention is not "upipe", models with token mixers other than attention
(hybrid layers), chunked attention, attention sinks, soft-capped logits, bidirectional attention and attention
dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_upipe.attention.kernel import sp_window
from hf_upipe.attention.registered import upipe_attention_forward
from hf_upipe.attention.state import attention_override
from hf_upipe.data import shard_batch
from hf_upipe.distributed import get_sequence_parallel_state, without_sequence_parallel
from hf_upipe.generation_cache import ShardKVCache, token_schedule

__all__ = ["ShardKVCache", "generate"]

_ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def _check_arguments(
    model, input_ids, attention_mask, max_new_tokens: int, returns: int, state
) -> None:
    """Raise when `generate` cannot run exactly here (the same verdict on every rank: same model, same arguments)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(
            f"hf_upipe.generate takes input_ids of shape [B, L] (the same on every rank); got {shape}."
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"hf_upipe.generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
            f"{tuple(input_ids.shape)}; they must match."
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"hf_upipe.generate needs max_new_tokens >= 1 (got {max_new_tokens!r}).")
    if not isinstance(returns, int) or returns < 1:
        raise ValueError(f"hf_upipe.generate needs num_return_sequences >= 1 (got {returns!r}).")
    why = _refusal(model, state)
    if why is not None:
        raise NotImplementedError(why)


def _prompt_starts(input_ids: torch.Tensor, attention_mask) -> list[int]:
    """Per row of [B, L], the index of its first prompt token: rows are left-padded (mask 0...0 1...1)."""
    if attention_mask is None:
        return [0] * input_ids.shape[0]
    mask = attention_mask.bool()  # [B, L]
    starts = []
    for row, m in enumerate(mask):
        start = int(m.long().argmax()) if bool(m.any()) else m.numel()
        if start == m.numel() or not bool(m[start:].all()):
            raise ValueError(
                f"hf_upipe.generate: row {row} of attention_mask is {m.long().tolist()}: each row must be left-"
                "padded (zeros, then at least one 1, then only ones). Pad on the left (tokenizer.padding_side = "
                "'left')."
            )
        starts.append(start)
    return starts


def _refusal(model, state) -> str | None:
    """Why the model or the setting is not generated from exactly here, or None."""
    if state is None or state.sp_size < 2:
        return (
            "hf_upipe.generate runs under sequence parallelism: call hf_upipe.init_sequence_parallel(sp_size) "
            "first (without it, use model.generate in one process)."
        )
    config = model.config
    if model.training:
        return (
            "hf_upipe.generate needs the model in eval mode (model.eval()): dropout would draw differently on "
            "each rank while every rank computes the new token."
        )
    if getattr(config, "_attn_implementation", None) != "upipe":
        return (
            f"hf_upipe.generate needs the model's attention to be 'upipe' (it is "
            f"{getattr(config, '_attn_implementation', None)!r}): call hf_upipe.prepare_model(model) first."
        )
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(_ATTENTION_LAYERS))
    if other:
        return (
            f"hf_upipe.generate supports attention layers only; this model has {other} layers (a token mixer's "
            "state is not cached under sequence parallelism). Generate in one process."
        )
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None) is not None:
            return (
                f"hf_upipe.generate does not implement {name}={getattr(config, name)} in its decode step. "
                "Generate in one process."
            )
    return None


def _refuse_unexact(module, kwargs: dict) -> None:
    """Raise for attention settings the decode step does not compute (every rank, same layer, before collectives)."""
    unexact = [n for n in ("s_aux", "sinks", "softcap") if kwargs.get(n) is not None]
    if kwargs.get("dropout"):
        unexact.append(f"dropout={kwargs['dropout']} (call model.eval())")
    if not getattr(module, "is_causal", True):
        unexact.append("bidirectional attention")
    if unexact:
        raise NotImplementedError(
            f"hf_upipe.generate: layer {getattr(module, 'layer_idx', '?')} uses {', '.join(map(str, unexact))}, "
            "which its decode step does not compute. Generate in one process."
        )


def _prefill(model, input_ids: torch.Tensor, state, cache: ShardKVCache, capacity: int, last: int):
    """Run this rank's shard of the prompt [1, L], recording its keys and values into `cache` (room for `capacity`
    tokens). Returns the logits [V] of the last prompt token (held by rank `last`), on every rank."""
    L, P = input_ids.shape[1], state.sp_size
    shard = shard_batch({"input_ids": input_ids}, state.sp_rank, P)
    positions = shard["position_ids"][
        0
    ]  # [s] global positions (shard_batch pads the prompt to P*s)
    real = positions < L  # [s] the prompt's tokens (the padded tail is not cached)
    cache.start(positions[real], capacity)

    def record(module, query, key, value, attention_mask, **kwargs):
        _refuse_unexact(module, kwargs)
        if getattr(attention_mask, "chunk", None) is not None:
            raise NotImplementedError("hf_upipe.generate does not implement chunked attention.")
        layer = module.layer_idx
        window = kwargs.get("sliding_window")
        cache.windows[layer] = sp_window(attention_mask, window, key.shape[2] * P, module)
        # a window of W: no new token (position >= L) sees the prompt's positions <= L - W (a prefix: ascending)
        first = int((positions[real] <= L - window).sum()) if window else 0
        cache.fill(
            layer, key[0][:, real], value[0][:, real], first
        )  # [Hk, n, D]: this shard's tokens
        with attention_override(None):
            return upipe_attention_forward(module, query, key, value, attention_mask, **kwargs)

    index = (positions == L - 1).nonzero()[:1, 0]  # [1] the last prompt token's row, or [0]
    index = index if len(index) else torch.zeros(1, dtype=torch.long, device=positions.device)
    with attention_override(record):
        logits = model(
            input_ids=shard["input_ids"],
            position_ids=shard["position_ids"],
            use_cache=False,
            logits_to_keep=index,
        ).logits[0, -1]  # [V]
    _check_layers(model, cache)
    logits = logits.float().contiguous()
    dist.broadcast(logits, src=dist.get_global_rank(state.sp_group, last), group=state.sp_group)
    return logits


def _check_layers(model, cache: ShardKVCache) -> None:
    """Every layer cached: no other token mixer (the same verdict on every rank, before the next collective)."""
    layers = model.config.num_hidden_layers
    if sorted(cache.keys) != list(range(layers)):
        raise NotImplementedError(
            f"hf_upipe.generate cached {len(cache.keys)} of {layers} layers: the others are not attention "
            "through attn_implementation='upipe'. Generate in one process."
        )


def _window(module, kwargs: dict, prefill_window) -> int | None:
    """The layer's sliding window in the decode step (from the call; the prefill's mask must agree)."""
    window = kwargs.get("sliding_window")
    if prefill_window is not None and window != prefill_window:
        raise NotImplementedError(
            f"hf_upipe.generate: layer {module.layer_idx} has a sliding window of {prefill_window} in its mask that "
            "its attention call does not pass. Generate in one process."
        )
    return window


_KEY_CHUNK = 4096  # keys upcast to fp32 at a time in the decode step


def _partial(q, k, v, visible, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query q [H, D] to this rank's keys k [Hk, n, D] / values v [Hk, n, Dv] where `visible` [n]:
    (output [H, Dv] normalised over these keys, log-sum-exp [H]; -inf with no visible key), in fp32, reading the
    keys and values in chunks (no copy of the cache: neither the GQA heads nor fp32 are materialised whole)."""
    H, Hk, n = q.shape[0], k.shape[0], k.shape[1]
    if n == 0 or not bool(visible.any()):
        zeros = q.new_zeros(H, v.shape[-1], dtype=torch.float32)
        return zeros, q.new_full((H,), float("-inf"), dtype=torch.float32)
    groups = q.float().view(Hk, H // Hk, -1)  # [Hk, G, D]: query head h reads kv head h // G
    scores = torch.cat(
        [
            torch.einsum("kgd,knd->kgn", groups, k[:, i : i + _KEY_CHUNK].float())
            for i in range(0, n, _KEY_CHUNK)
        ],
        dim=-1,
    )  # [Hk, G, n]
    scores = (scores * scaling).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hk, G]
    probs = torch.exp(scores - lse[..., None])  # [Hk, G, n]
    out = sum(
        torch.einsum(
            "kgn,kne->kge", probs[..., i : i + _KEY_CHUNK], v[:, i : i + _KEY_CHUNK].float()
        )
        for i in range(0, n, _KEY_CHUNK)
    )  # [Hk, G, Dv]
    return out.reshape(H, -1), lse.reshape(H)


def _merge(out: torch.Tensor, lse: torch.Tensor, group, size: int) -> torch.Tensor:
    """The exact attention output [b, H, Dv] from every rank's partials (out [b, H, Dv], lse [b, H]): one
    all-gather."""
    packed = torch.cat([out, lse[..., None]], dim=-1).contiguous()  # [b, H, Dv + 1]
    every = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(every, packed, group=group)
    stacked = torch.stack(every)  # [P, b, H, Dv + 1]
    lses = stacked[..., -1]  # [P, b, H]
    weights = torch.exp(
        lses - lses.max(dim=0).values
    )  # [P, b, H]; a rank with no visible key weighs 0
    return (weights[..., None] * stacked[..., :-1]).sum(0) / weights.sum(0)[..., None]  # [b, H, Dv]


@dataclass(frozen=True)
class _Step:
    """One decode step of the rows still running: their tokens [b], global positions, and whether this rank caches
    each token's keys and values; `caches` are the rows' caches."""

    tokens: torch.Tensor
    positions: list
    owners: list
    caches: list


def _decode_step(model, step: _Step, state) -> torch.Tensor:
    """Logits [b, V] of the step's tokens (one batched forward), each row attending to its whole cache across the
    SP group; a token's keys and values are appended to this rank's cache where it is the owner."""
    for cache, owner, position in zip(step.caches, step.owners, step.positions):
        if owner:
            cache.append_position(position)

    def attend(module, query, key, value, attention_mask, **kwargs):
        _refuse_unexact(module, kwargs)  # query [b, H, 1, D], key [b, Hk, 1, D]
        layer, outs, lses = module.layer_idx, [], []
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        for row, cache in enumerate(step.caches):
            window = _window(module, kwargs, cache.windows.get(layer))
            if step.owners[row]:
                cache.put(layer, key[row, :, 0], value[row, :, 0])  # [Hk, D]
            positions = cache.layer_positions(layer)  # [n]
            visible = torch.ones_like(positions, dtype=torch.bool)
            if window is not None:
                visible = step.positions[row] - positions < window
            out, lse = _partial(
                query[row, :, 0], cache.key(layer), cache.value(layer), visible, scaling
            )
            outs.append(out)
            lses.append(lse)
        out = _merge(
            torch.stack(outs), torch.stack(lses), state.sp_group, state.sp_size
        )  # [b, H, Dv]
        return out[:, None].to(query.dtype), None  # [b, 1, H, Dv]

    device = step.tokens.device
    positions = torch.tensor(step.positions, device=device)[:, None]  # [b, 1]
    with without_sequence_parallel(), attention_override(attend):
        out = model(input_ids=step.tokens[:, None], position_ids=positions, use_cache=False)
    return out.logits[:, -1].float()  # [b, V]


def _next_tokens(logits, ids, do_sample: bool, warpers: list, state, generator) -> torch.Tensor:
    """The rows' next tokens [B]: the argmax, or one draw over the whole [B, V] as one process's `generate` draws,
    decided on SP rank 0 and shared with the group (so the ranks never disagree, even where their logits differ in
    the last bit)."""
    tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    if state.sp_rank == 0 and not do_sample:
        tokens = logits.argmax(-1)
    elif state.sp_rank == 0:
        scores = logits  # [B, V]
        for warp in warpers:
            scores = warp(ids, scores)
        tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)[:, 0]
    tokens = tokens.contiguous()
    dist.broadcast(tokens, src=dist.get_global_rank(state.sp_group, 0), group=state.sp_group)
    return tokens


def _warpers(temperature: float, top_k, top_p) -> list:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _pad_id(model, pad_token_id, eos: list[int]) -> int:
    """The token after a row's eos (as `model.generate`: the generation config's pad token, else the first eos)."""
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    return int(pad_token_id)


@dataclass(frozen=True)
class _Rows:
    """The rows decoded: per row its prompt length, its cache, the rank caching each fed-back token; and the
    logits [B', V] after the prompts."""

    lengths: list
    caches: list
    owners: list
    logits: torch.Tensor


def _prefill_rows(
    model, input_ids, starts: list, copies: int, state, max_new_tokens: int, kv_cache
) -> _Rows:
    """Prefill each row's prompt (its left padding dropped) once; `copies` independent caches per row (the draws of
    num_return_sequences), in the order of `repeat_interleave`."""
    lengths, caches, owners, logits = [], [], [], []
    for row, start in enumerate(starts):
        prompt = input_ids[row : row + 1, start:]  # [1, L_row]
        counts, last, owner = token_schedule(prompt.shape[1], state, max_new_tokens)
        capacity = counts[state.sp_rank] + owner.count(state.sp_rank)
        cache = kv_cache if kv_cache is not None else ShardKVCache()
        first = _prefill(model, prompt, state, cache, capacity, last)  # [V]
        for copy in range(copies):
            twin = cache
            if copy:
                twin = ShardKVCache()
                twin.copy_from(cache)
            lengths.append(prompt.shape[1])
            caches.append(twin)
            owners.append(owner)
            logits.append(first)
    return _Rows(lengths, caches, owners, torch.stack(logits))


def _check_cache_argument(kv_cache, rows: int) -> None:
    if kv_cache is not None and rows != 1:
        raise ValueError(
            f"hf_upipe.generate: kv_cache= shows one row's cache; this call decodes {rows} rows. Pass it with one "
            "prompt and one return sequence."
        )


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    num_return_sequences: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    kv_cache: ShardKVCache | None = None,
    generator: torch.Generator | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Generate after prompts under sequence parallelism, each rank caching its shard (module docstring).

    Args:
        model: a causal LM (plain or PEFT) prepared with `hf_upipe.prepare_model`, in eval mode.
        input_ids: [B, L] the prompts, left-padded, the same on every rank of the SP group.
        max_new_tokens: how many tokens to generate at most.
        attention_mask: [B, L] 0 on the left padding, 1 on the prompts (default: no padding).
        num_return_sequences: rows returned per prompt (in `repeat_interleave` order); greedy rows are decoded once.
        do_sample: draw from the distribution (after `temperature`, `top_k`, `top_p`) instead of the argmax.
        eos_token_id: stop a row after one of these (default: the model's generation_config's).
        pad_token_id: what follows a stopped row's eos (default: the generation config's, else the first eos).
        kv_cache: a `ShardKVCache` to fill (one prompt, one return sequence): to inspect what this rank kept.
        generator: the random generator of the draws (used on SP rank 0).
        return_scores: also return the model's logits [n, B * num_return_sequences, V] (fp32) before each
            generated token (zeros for rows that had stopped).

    Returns:
        [B * num_return_sequences, L + n] the prompts (with their padding) and the n <= max_new_tokens generated
        tokens, the same on every rank (with `return_scores`: that and the logits).
    """
    state = get_sequence_parallel_state()
    _check_arguments(model, input_ids, attention_mask, max_new_tokens, num_return_sequences, state)
    starts = _prompt_starts(input_ids, attention_mask)
    copies = num_return_sequences if do_sample else 1  # greedy draws of one prompt are equal
    _check_cache_argument(kv_cache, len(starts) * copies)
    eos = _eos_ids(model, eos_token_id)
    pad = _pad_id(model, pad_token_id, eos)
    warpers = _warpers(temperature, top_k, top_p) if do_sample else []
    rows = _prefill_rows(model, input_ids, starts, copies, state, max_new_tokens, kv_cache)
    ids = input_ids.long().repeat_interleave(copies, 0)  # [B', L]
    logits, scores = rows.logits, []
    running = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)  # [B']
    for step in range(max_new_tokens):
        scores.append(logits)
        tokens = _next_tokens(logits, ids, do_sample, warpers, state, generator)  # [B']
        tokens = torch.where(running, tokens, pad)
        ids = torch.cat([ids, tokens[:, None]], dim=1)  # [B', L + step + 1]
        running &= ~torch.isin(tokens, tokens.new_tensor(eos))
        if not bool(running.any()) or step == max_new_tokens - 1:
            break
        live = running.nonzero()[:, 0].tolist()
        logits = torch.zeros_like(logits)
        logits[live] = _decode_step(model, _live_step(rows, live, tokens, step, state), state)
    scores = torch.stack(scores)  # [n, B', V]
    if copies != num_return_sequences:
        ids = ids.repeat_interleave(num_return_sequences, 0)
        scores = scores.repeat_interleave(num_return_sequences, 1)
    return (ids, scores) if return_scores else ids


def _live_step(rows: _Rows, live: list, tokens: torch.Tensor, step: int, state) -> _Step:
    """The decode step of the running rows `live`: the token each generated at `step` (global position L_row +
    step), and whether this rank caches it."""
    return _Step(
        tokens=tokens[live],
        positions=[rows.lengths[r] + step for r in live],
        owners=[rows.owners[r][step] == state.sp_rank for r in live],
        caches=[rows.caches[r] for r in live],
    )
