"""The causal-LM loss of one sequence shard from a transformers model, with or without the tiled lm_head + CE.

Entry points:
- `shard_loss_sum(model, inputs, shift_labels, *, tiled=True, chunk_tokens=None, ignore_index=-100)`: run the
  model on this rank's shard and return the SUM of the token losses over its label tokens (fp32 scalar,
  differentiable) and the model outputs. Normalising (by the label tokens of the whole batch) is the caller's job.
- `output_head(model)`: the model's lm_head as a plain `nn.Linear` (through PEFT and DDP/FSDP wrappers), or an
  error naming why the tiled loss cannot use it.

Tiled path: a forward pre-hook on the lm_head, registered for this one call and removed after it, records the
final-norm hidden states [B, s, Dm] and hands the lm_head a zero-length slice [B, 0, Dm] instead, so the model
computes no logits; `hf_upipe.ops.tiled_cross_entropy` then computes the loss chunk by chunk from the recorded
hidden states and the lm_head weight. The model call still goes through its wrappers (DDP, FSDP, PEFT, activation
checkpointing), so their hooks see an ordinary forward. Untiled path: the model's own loss with
`shift_labels` and `reduction="sum"` semantics (transformers' `ForCausalLMLoss` with `num_items_in_batch=1`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from hf_upipe.integrations.peft import base_model
from hf_upipe.ops.tiled_loss import tiled_cross_entropy

__all__ = ["output_head", "shard_loss_sum"]


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
        raise NotImplementedError(f"{type(base).__name__} has no output embeddings (lm_head): the tiled loss needs a "
                                  "causal LM; set tiled_loss=False.")
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):  # PEFT modules_to_save=["lm_head"]
        active = [a for a in getattr(head, "active_adapters", []) if a in head.modules_to_save]
        inner = head.original_module if getattr(head, "disable_adapters", False) or not active \
            else head.modules_to_save[active[0]]
        if type(inner) is nn.Linear:
            return inner, head  # read the active copy's weight, hook the wrapper the model calls
        head = inner
    if type(head) is not nn.Linear:
        raise NotImplementedError(
            f"The lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA on the lm_head or a quantized "
            "head): the tiled loss cannot read its weight; set tiled_loss=False (UPipeConfig / "
            "UPIPE_TILED_LOSS=0)."
        )
    return head, head


@contextmanager
def _record_head_input(head: nn.Module):
    """While active, `head` records its input [B, s, Dm] and computes on an empty [B, 0, Dm] slice instead."""
    recorded: list[torch.Tensor] = []

    def pre_hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("input")
        recorded.append(hidden)
        # [B, 0, Dm]: zero-size logits. A copy of the empty slice, not the view hidden[..., :0, :]: the head's
        # autograd node saves its input, and a view would keep the whole [B, s, Dm] final-norm output alive through
        # backward. The copy stays in the graph (slicing saves no data), so the logits still depend on every layer:
        # DDP's search for unused parameters starts from the model's outputs.
        return (hidden[..., :0, :].clone(),) + tuple(args[1:]), kwargs

    handle = head.register_forward_pre_hook(pre_hook, with_kwargs=True)
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

    Returns:
        (loss_sum, outputs): fp32 scalar sum over the shard's label tokens (0 when it has none) and what the
        model returned (its logits are [B, 0, V] on the tiled path).
    """
    if not tiled:
        outputs = model(**inputs, labels=shift_labels, shift_labels=shift_labels, num_items_in_batch=1,
                        ignore_index=ignore_index)
        return outputs.loss.float(), outputs
    head, called = output_head(model)
    with _record_head_input(called) as recorded:
        outputs = model(**inputs)
    if len(recorded) != 1:
        raise RuntimeError(f"The lm_head ran {len(recorded)} times in one forward; the tiled loss expects exactly "
                           "once (set tiled_loss=False for this model).")
    hidden = recorded[0]  # [B, s, Dm] final-norm output
    config = getattr(_unwrap(model), "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    loss_sum, _ = tiled_cross_entropy(hidden.to(head.weight.dtype), head.weight, shift_labels, bias=head.bias,
                                      chunk_tokens=chunk_tokens, ignore_index=ignore_index, logit_softcap=softcap)
    return loss_sum, outputs
