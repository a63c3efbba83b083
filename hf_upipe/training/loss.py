"""The causal-LM loss of one sequence shard from a transformers model, with or without the tiled lm_head + CE.

Entry points:
- `shard_loss_sum(model, inputs, shift_labels, *, tiled=True, chunk_tokens=None, ignore_index=-100,
  token_stats=None)`: run the model on this rank's shard and return the SUM of the token losses over its label
  tokens (fp32 scalar, differentiable) and the model outputs; a `hf_upipe.ops.tiled_loss.TokenStats` also receives the
  shard's summed entropy and argmax hits (TRL's `entropy` / `mean_token_accuracy`). Normalising (by the label
  tokens of the whole batch) is the caller's job.
- `output_head(model)`: the model's lm_head as a plain `nn.Linear` (through PEFT and DDP/FSDP wrappers), or an
  error naming why the tiled loss cannot use it.

Tiled path: a forward pre-hook on the lm_head, registered for this one call and removed after it, records the
final-norm hidden states [B, s, Dm] and hands the lm_head a zero-length slice [B, 0, Dm] instead, so the model
computes no logits; `hf_upipe.ops.tiled_loss.tiled_cross_entropy` then computes the loss chunk by chunk from the
recorded hidden states and the lm_head weight, with the architecture's logit scaling (`hf_upipe.models.architectures.
logit_multiplier`: Granite, Cohere) and Gemma-style soft-capping. The first call for an lm_head lets it compute
the logits of 2 tokens and compares them with what the tiles compute (one flag agreed over the SP group); a model
that changes its logits in another way is refused (NotImplementedError: use the untiled loss). The model call
still goes through its wrappers (DDP, FSDP, PEFT, activation
checkpointing), so their hooks see an ordinary forward. Untiled path: the model's own loss with
`shift_labels` and `reduction="sum"` semantics (transformers' `ForCausalLMLoss` with `num_items_in_batch=1`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from hf_upipe.adapters.zero3 import gathered_head, partitioned
from hf_upipe.distributed import get_sequence_parallel_state, validation_failed
from hf_upipe.models.architectures import logit_multiplier
from hf_upipe.models.peft import base_model
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.tiled_loss import TokenStats, tiled_cross_entropy

__all__ = ["head_input", "output_head", "shard_loss_sum"]


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/compile wrappers (`.module`, `._orig_mod`) down to the transformers or PEFT model."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def output_head(model: nn.Module) -> tuple[nn.Linear, nn.Module]:
    """The lm_head of `model` (a transformers causal LM, a PEFT model, or either wrapped by DDP).

    Returns:
        (the nn.Linear whose weight the loss uses, the module the model calls): the same module, except for a PEFT
        `modules_to_save` lm_head, where the active trainable copy sits inside the wrapper the model calls.

    Raises:
        NotImplementedError: no output embeddings, or an lm_head that is not a plain `nn.Linear` (LoRA on the
            lm_head, `modules_to_save`, quantized heads): train with `tiled_loss=False` then.
    """
    base = _unwrap(model)
    base = base_model(base)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        raise NotImplementedError(
            f"{type(base).__name__} has no output embeddings (lm_head): the tiled loss needs a "
            "causal LM; set tiled_loss=False."
        )
    if hasattr(head, "modules_to_save") and hasattr(
        head, "original_module"
    ):  # PEFT modules_to_save=["lm_head"]
        active = [a for a in getattr(head, "active_adapters", []) if a in head.modules_to_save]
        inner = (
            head.original_module
            if getattr(head, "disable_adapters", False) or not active
            else head.modules_to_save[active[0]]
        )
        if type(inner) is nn.Linear:
            return inner, head  # read the active copy's weight, hook the wrapper the model calls
        head = inner
    if _linear_class(head) is not nn.Linear:
        raise NotImplementedError(
            f"The lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA on the lm_head or a quantized "
            "head): the tiled loss cannot read its weight; set tiled_loss=False (UPipeConfig / "
            "UPIPE_TILED_LOSS=0)."
        )
    return head, head


def _linear_class(head: nn.Module) -> type:
    """The module's own class: FSDP2's `fully_shard` (accelerate's FSDP2 shards the lm_head with the final norm)
    makes an `nn.Linear` an `FSDPLinear(FSDPModule, Linear)`, which is still the plain Linear to the loss."""
    own = type(head)
    if own.__name__.startswith("FSDP") and any(c.__name__ == "FSDPModule" for c in own.__mro__):
        own = next(c for c in own.__mro__[1:] if not c.__name__.startswith("FSDP"))
    return own


def _unsharded_weight(head: nn.Module) -> None:
    """Refuse an lm_head whose FSDP2 group resharded after its forward: its weight is then this rank's shard (a
    DTensor), not the matrix the tiles need. accelerate's FSDP2 keeps it gathered (reshard_after_forward=False
    for the final norm and lm_head), as must a model sharded by hand."""
    if type(head.weight).__name__ == "DTensor":
        raise NotImplementedError(
            f"The lm_head ({type(head).__name__}) holds only this rank's shard of its weight after its forward "
            "(an FSDP2 group with reshard_after_forward=True): the tiled loss needs the whole weight. Shard the "
            "lm_head with reshard_after_forward=False (fully_shard([final_norm, lm_head], "
            "reshard_after_forward=False), as accelerate's FSDP2 does), or set tiled_loss=False."
        )


@contextmanager
def _record_head_input(head: nn.Module, probe: int = 0):
    """While active, `head` records its input [B, s, Dm] and computes on its first `probe` tokens [B, probe, Dm]
    instead (0: an empty slice)."""
    recorded: list[torch.Tensor] = []

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("input")
        recorded.append(hidden)
        # [B, probe, Dm]: (nearly) zero-size logits. A copy of the slice, not the view hidden[..., :probe, :]: the
        # head's autograd node saves its input, and a view would keep the whole [B, s, Dm] final-norm output alive
        # through backward. The copy stays in the graph, so the logits still depend on every layer: DDP's search
        # for unused parameters starts from the model's outputs.
        return (hidden[..., :probe, :].clone(),) + tuple(args[1:]), kwargs

    # ZeRO-3 wraps the head's input for its post-backward hook; the loss must read the input before that wrapping
    # (its backward never reaches the head's own), so the hook runs first there
    first = bool(partitioned(head.parameters()))
    handle = head.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=first)
    try:
        yield recorded
    finally:
        handle.remove()


def shard_loss_sum(
    model: nn.Module,
    inputs: dict,
    shift_labels: torch.Tensor,
    *,
    tiled: bool = True,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    token_stats: TokenStats | None = None,
):
    """Summed cross-entropy of this rank's shard, and the model outputs.

    Args:
        model: the model to call (possibly DDP/FSDP/PEFT wrapped); training or eval mode.
        inputs: model inputs of the shard (`input_ids` [B, s], `position_ids`, `attention_mask`, ...), without
            labels.
        shift_labels: [B, s] targets already shifted over the whole sequence (`hf_upipe.shard_batch`).
        tiled: use the tiled lm_head + cross-entropy (no [B*s, V] logits).
        chunk_tokens: tokens per tile (default: `default_chunk_tokens(V)`).
        ignore_index: label that does not count.
        token_stats: receives the entropy and argmax hits of the shard's label tokens (tiled: from the loss's
            own tiles; untiled: from the model's logits, without gradient), or None.

    Returns:
        (loss_sum, outputs): fp32 scalar sum over the shard's label tokens (0 when it has none) and what the
        model returned (its logits are [B, 0, V] on the tiled path).
    """
    if not tiled:
        outputs = model(
            **inputs,
            labels=shift_labels,
            shift_labels=shift_labels,
            num_items_in_batch=1,
            ignore_index=ignore_index,
        )
        if token_stats is not None:
            _stats_from_logits(token_stats, outputs.logits, shift_labels, ignore_index)
        return outputs.loss.float(), outputs
    with head_input(model, inputs) as (scaled, head, bias, softcap, outputs, finish):
        loss_sum, _ = tiled_cross_entropy(
            scaled,
            head.weight,
            shift_labels,
            bias=bias,
            chunk_tokens=chunk_tokens,
            ignore_index=ignore_index,
            logit_softcap=softcap,
            token_stats=token_stats,
        )
        loss_sum = finish(loss_sum)
    return loss_sum, outputs


@contextmanager
def head_input(model: nn.Module, inputs: dict):
    """Run the model on a shard with its lm_head computing no logits (the tiled path of `shard_loss_sum`).

    Yields, while the lm_head's weight can be read (gathered under ZeRO-3):
        (hidden [B, s, Dm] in the lm_head's dtype with the model's logit scaling applied, the lm_head
        `nn.Linear`, its bias scaled alike (or None), the soft-cap (or None), the model outputs with [B, 0, V]
        logits, `finish(loss) -> loss to use`): the model's logits are `softcap(F.linear(hidden, head.weight,
        bias))`, tile by tile.
    """
    head, called = output_head(model)
    ids = inputs.get("input_ids")
    # fake tensors (the planner) probe too, so that its simulation allocates what a real run does
    probe = 0 if head in _CHECKED_HEADS or ids is None else min(_PROBE_TOKENS, ids.shape[-1])
    with _record_head_input(called, probe) as recorded:
        outputs = model(**inputs)
    if len(recorded) != 1:
        raise RuntimeError(
            f"The lm_head ran {len(recorded)} times in one forward; the tiled loss expects exactly "
            "once (set tiled_loss=False for this model)."
        )
    hidden = recorded[0]  # [B, s, Dm] final-norm output
    _unsharded_weight(head)
    config = getattr(base_model(_unwrap(model)), "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = logit_multiplier(config) if config is not None else 1.0
    # ZeRO-3: the head's weight is read here, after the model's forward (`hf_upipe.adapters.zero3`)
    with gathered_head(hidden, (head.weight, head.bias)) as (hidden, finish):
        if probe:
            _check_logits(outputs, hidden[..., :probe, :], head, scale, softcap, config)
            outputs["logits"] = outputs.logits[
                ..., :0, :
            ].clone()  # [B, 0, V] as on every later call (no view)
        weight_dtype = head.weight.dtype
        bias = head.bias if scale == 1.0 or head.bias is None else head.bias * scale
        # scale * (h W^T + b) = (scale * h) W^T + scale * b: the model's logit scaling on the tiles' input
        scaled = (
            hidden.to(weight_dtype) if scale == 1.0 else hidden.to(weight_dtype) * scale
        )  # [B, s, Dm]
        yield scaled, head, bias, softcap, outputs, finish


def _stats_from_logits(stats: TokenStats, logits, shift_labels, ignore_index: int) -> None:
    """The untiled path's statistics, from the model's logits [B, s, V] (what its loss used), without gradient."""
    with torch.no_grad():
        z = logits.detach().float().flatten(0, 1)  # [T, V]
        labels = shift_labels.reshape(-1).to(z.device)  # [T]
        valid = labels != ignore_index
        stats._add(z, labels, valid)
        row_max = z.amax(dim=1, keepdim=True)  # [T, 1]
        probs = (z - row_max).exp_()  # [T, V] unnormalised
        stats._add_entropy(probs, probs.sum(dim=1, keepdim=True), valid)


_PROBE_TOKENS = 2
_CHECKED_HEADS: weakref.WeakSet = (
    weakref.WeakSet()
)  # lm_heads whose model's logits the tiled loss reproduces


def _check_logits(
    outputs, probe_hidden: torch.Tensor, head: nn.Linear, scale: float, softcap, config
) -> None:
    """Once per lm_head: the model's own logits of the first tokens [B, p, V] must be what the tiled loss computes
    from the head's input (scaling, soft-capping); anything else the model does to its logits is refused. Fake
    tensors (the planner) have no values to compare: nothing is checked."""
    if is_fake(probe_hidden):
        _CHECKED_HEADS.add(head)  # as a real run after its check
        return
    with torch.no_grad():
        ours = (
            torch.nn.functional.linear(
                probe_hidden.to(head.weight.dtype), head.weight, head.bias
            ).float()
            * scale
        )
        if softcap:
            ours = softcap * torch.tanh(ours / softcap)
        got = outputs.logits.detach().float()
        agree = got.shape == ours.shape and bool(
            ((got - ours).abs().max() <= 1e-2 * ours.abs().max() + 1e-6)
        )
    state = get_sequence_parallel_state()
    if (
        state is not None and state.check_group is not None
    ):  # the same verdict on every rank of the SP group
        flag = torch.tensor([int(agree)])
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=state.check_group)
        except (RuntimeError, dist.DistError) as err:
            raise validation_failed(err, "the tiled loss's check of the logits") from None
        agree = bool(flag.item())
    if not agree:
        model_type = getattr(config, "model_type", None)
        raise NotImplementedError(
            f"hf_upipe: the logits of this {model_type!r} model are not its lm_head's output "
            f"{'times ' + format(scale, 'g') + ' ' if scale != 1.0 else ''}"
            f"{'soft-capped ' if softcap else ''}(the model changes them in a way the tiled loss does not know), so "
            "the tiled loss would compute another loss. Set tiled_loss=False (UPipeConfig / UPIPE_TILED_LOSS=0): the "
            "model's own loss is used then."
        )
    _CHECKED_HEADS.add(head)
