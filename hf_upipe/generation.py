"""Generation under sequence parallelism: each rank prefills its shard of the prompt and keeps that shard's KV cache.

Entry points:
- `generate(model, input_ids, *, max_new_tokens, do_sample=False, temperature=1.0, top_k=None, top_p=None,
  eos_token_id=None, kv_cache=None, generator=None)`: the prompt [1, L] (the same on every rank of the SP group)
  followed by the generated tokens, [1, L + n], on every rank; `model` prepared with `hf_upipe.prepare_model`
  ("upipe" attention) after `hf_upipe.init_sequence_parallel`.
- `ShardKVCache`: one rank's cache (keys and values of all layers and heads, for the tokens this rank holds, with
  their global positions); pass one as `kv_cache=` to see what a rank kept (`numel()`, `nbytes()`). It lives in
  `hf_upipe.generation_cache`, with the schedule of which rank caches which token.

The flow, on every rank of the SP group (P ranks):
1. prefill: the rank's shard of the prompt (`hf_upipe.shard_batch`: global position_ids) runs through the model on
   the training path ("upipe" attention under SP), while `attention_override` records each layer's keys and values
   of the shard (RoPE applied) before the attention's all-to-all. The cache is never gathered: a rank holds
   L / P prompt tokens. The rank holding the last prompt token broadcasts its logits (one [V] vector).
2. decode: every rank runs the new token through the model on its own (embeddings, norms and MLPs are per token),
   with an attention that lets the token's query attend to the rank's cached keys; the partial outputs [H, Dv]
   and their log-sum-exps [H] are all-gathered over the SP group and merged (exact softmax over all keys). The
   token's own keys and values are appended on one rank: the one with the fewest cached tokens (ties: the lowest
   rank), so the caches stay balanced. Positions are global (L + step). Sliding windows mask keys by global
   position (key t seen by query i when i - t < window).
3. the next token: the argmax (greedy) or a draw from the processed distribution (transformers' temperature,
   top-k, top-p warpers, in that order), decided on SP rank 0 and broadcast, so every rank holds the same sequence. It
   stops after `max_new_tokens` or at an `eos_token_id`.

Refused on every rank before any collective: a batch of more than one row, a model in training mode, a model
whose attention is not "upipe", models with token mixers other than attention (hybrid layers), chunked attention,
attention sinks, soft-capped logits, bidirectional attention and attention dropout.
"""

from __future__ import annotations

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


def _check_arguments(model, input_ids, max_new_tokens: int, state) -> None:
    """Raise when `generate` cannot run exactly here (the same verdict on every rank: same model, same arguments)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(
            f"hf_upipe.generate takes one prompt, input_ids of shape [1, L] (the same on every rank); got "
            f"{shape}. Generate the rows one at a time."
        )
    if input_ids.shape[1] < 1 or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(
            f"hf_upipe.generate needs a non-empty prompt and max_new_tokens >= 1 (got {max_new_tokens!r})."
        )
    why = _refusal(model, state)
    if why is not None:
        raise NotImplementedError(why)


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
    """The exact attention output [H, Dv] from every rank's partial (out [H, Dv], lse [H]): one all-gather."""
    packed = torch.cat([out, lse[:, None]], dim=-1).contiguous()  # [H, Dv + 1]
    every = [torch.empty_like(packed) for _ in range(size)]
    dist.all_gather(every, packed, group=group)
    stacked = torch.stack(every)  # [P, H, Dv + 1]
    lses = stacked[..., -1]  # [P, H]
    weights = torch.exp(
        lses - lses.max(dim=0).values
    )  # [P, H]; a rank with no visible key weighs 0
    return (weights[..., None] * stacked[..., :-1]).sum(0) / weights.sum(0)[:, None]  # [H, Dv]


def _decode_step(model, token: int, position: int, owner: bool, state, cache: ShardKVCache):
    """Logits [V] of `token` at global `position`, attending to the whole cache across the SP group; its keys and
    values are appended to this rank's cache when `owner`."""
    device = cache.positions.device
    if owner:
        cache.append_position(position)

    def attend(module, query, key, value, attention_mask, **kwargs):
        _refuse_unexact(module, kwargs)
        layer = module.layer_idx
        window = _window(module, kwargs, cache.windows.get(layer))
        if owner:
            cache.put(layer, key[0, :, 0], value[0, :, 0])  # [Hk, D]
        positions = cache.layer_positions(layer)  # [n]
        visible = torch.ones_like(positions, dtype=torch.bool)
        if window is not None:
            visible = position - positions < window
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out, lse = _partial(query[0, :, 0], cache.key(layer), cache.value(layer), visible, scaling)
        out = _merge(out, lse, state.sp_group, state.sp_size)  # [H, Dv]
        return out[None, None].to(query.dtype), None  # [1, 1, H, Dv]

    ids = torch.tensor([[token]], device=device)
    with without_sequence_parallel(), attention_override(attend):
        out = model(
            input_ids=ids, position_ids=torch.tensor([[position]], device=device), use_cache=False
        )
    return out.logits[0, -1].float()  # [V]


def _next_token(logits, ids, do_sample: bool, warpers: list, state, generator) -> int:
    """The argmax, or a draw, decided on SP rank 0 and shared with the group (so the ranks never disagree, even
    where their logits differ in the last bit)."""
    token = torch.zeros(1, dtype=torch.long, device=logits.device)
    if state.sp_rank == 0 and not do_sample:
        token = logits.argmax().reshape(1)
    elif state.sp_rank == 0:
        scores = logits[None]  # [1, V]
        for warp in warpers:
            scores = warp(ids, scores)
        token = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)[0]
    dist.broadcast(token, src=dist.get_global_rank(state.sp_group, 0), group=state.sp_group)
    return int(token)


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


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    kv_cache: ShardKVCache | None = None,
    generator: torch.Generator | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Generate after a prompt under sequence parallelism, each rank caching its shard (module docstring).

    Args:
        model: a causal LM (plain or PEFT) prepared with `hf_upipe.prepare_model`, in eval mode.
        input_ids: [1, L] the whole prompt, the same on every rank of the SP group.
        max_new_tokens: how many tokens to generate at most.
        do_sample: draw from the distribution (after `temperature`, `top_k`, `top_p`) instead of the argmax.
        eos_token_id: stop after generating one of these (default: the model's generation_config's).
        kv_cache: a `ShardKVCache` to fill (to inspect what this rank kept); a new one by default.
        generator: the random generator of the draws (used on SP rank 0).
        return_scores: also return the model's logits [n, V] (fp32) before each generated token.

    Returns:
        [1, L + n] the prompt and the n <= max_new_tokens generated tokens, the same on every rank (with
        `return_scores`: that and the logits).
    """
    state = get_sequence_parallel_state()
    _check_arguments(model, input_ids, max_new_tokens, state)
    cache = kv_cache if kv_cache is not None else ShardKVCache()
    eos = _eos_ids(model, eos_token_id)
    warpers = _warpers(temperature, top_k, top_p) if do_sample else []
    counts, last, owners = token_schedule(input_ids.shape[1], state, max_new_tokens)
    capacity = counts[state.sp_rank] + owners.count(state.sp_rank)
    logits = _prefill(model, input_ids, state, cache, capacity, last)
    ids, scores = input_ids.long(), []
    for step in range(max_new_tokens):
        scores.append(logits)
        token = _next_token(logits, ids, do_sample, warpers, state, generator)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)  # [1, L + step + 1]
        if token in eos or step == max_new_tokens - 1:
            break
        owner = owners[step] == state.sp_rank  # this rank caches the token
        logits = _decode_step(model, token, ids.shape[1] - 1, owner, state, cache)
    return (ids, torch.stack(scores)) if return_scores else ids
