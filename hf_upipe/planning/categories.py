"""Which part of a training step holds each byte: checkpoints, attention, MLP, residual, loss or other.

Entry points:
- `CATEGORIES`: the labels, in report order.
- `decoder_layers(model)`: the decoder layers of a causal LM (plain or PEFT, text or multimodal);
  `layer_parts(layer)`: its token mixer(s) and MLP(s) by their attribute names.
- `StepCategories(model)`: a context manager over a decoder-only HF model; pass its `label` to
  `MemoryTracker(labeler=...)` and call `attach(tracker)` so that checkpointed inputs can be relabeled. The tracker's
  `peak_by_label` then says what was live at the step's peak.

How a storage gets its label, at the moment it is created:
1. Forward, and the recompute of a checkpointed layer inside backward: the innermost categorized module running
   (the token mixer -> "attention", `mlp` (or `feed_forward`, `block_sparse_moe`, ...) -> "mlp"; a model whose
   layer has no MLP module, OPT's fc1/fc2, counts its MLP as "residual"; a decoder layer's own work -> "residual":
   its norms, residual adds and the gradients of the residual stream), kept on a stack by
   forward pre-hooks and popped by forward hooks registered with `always_call=True` (a non-reentrant checkpoint stops
   its recompute with an exception once it has what it needs; the pop still runs). The recompute calls the layer
   without its hooks, so the layer's `_gradient_checkpointing_func` is wrapped to push "residual" around it.
2. Backward: the category of the autograd node being run (`torch._C._current_autograd_node()`). Each categorized
   module's forward hook walks the graph from its outputs back to its inputs and records its category in the
   `metadata` of every node in between (for custom Functions, such as the fused attention or the tiled MLP, the one
   node). Nodes outside any categorized module (the engine summing gradients of the residual stream) are
   "residual".
3. Forward after the base model has returned (the tiled loss, or the plain logits): "loss"; and in backward the
   nodes between the loss and the base model's output are "loss" (`label_loss(loss)`).
4. The first forward of each decoder layer relabels its `hidden_states` input as "checkpoints": the tensor that
   activation checkpointing keeps (or offloads) until that layer's backward.
Anything else (embeddings, the final norm, RoPE tables) is "other".
"""

from __future__ import annotations

import torch
from torch import nn

from hf_upipe.models.peft import base_model

__all__ = ["CATEGORIES", "StepCategories", "decoder_layers", "layer_parts"]

# a decoder layer's children by name: token mixers (attention, linear attention, convolutions, SSMs) and MLPs
_MIXERS = (
    "self_attn",
    "attn",
    "attention",
    "self_attention",
    "linear_attn",
    "mixer",
    "conv",
    "mamba",
    "mamba_mixer",
    "token_mixer",
    "temporal_block",
)
_MLPS = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn", "experts", "shared_mlp")


def decoder_layers(model) -> nn.ModuleList:
    """The decoder layers of a causal LM, plain or PEFT: the `nn.ModuleList` of its language model's
    `num_hidden_layers` layers (`model.layers` in most; `h` in GPT-2, `decoder.layers` in OPT, ...).

    Raises:
        ValueError: no such list (not a decoder-only transformers model).
    """
    causal_lm = base_model(model)
    config = getattr(causal_lm, "config", None)
    n = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    decoder = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm
    for root in (decoder, causal_lm):
        for module in root.modules():
            if isinstance(module, nn.ModuleList) and len(module) == n and n:
                return module
    raise ValueError(
        f"{type(causal_lm).__name__} has no list of its {n} decoder layers; the memory categories need a "
        "decoder-only transformers model"
    )


def layer_parts(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, "attention" | "mlp") for the token mixers and MLPs among a decoder layer's children."""
    return [
        (child, "attention" if name in _MIXERS else "mlp")
        for name, child in layer.named_children()
        if name in _MIXERS or name in _MLPS
    ]


CATEGORIES = ("checkpoints", "attention", "mlp", "residual", "loss", "other")
_KEY, _STOP = (
    "hf_upipe_category",
    "hf_upipe_stop",
)  # in each autograd node's own metadata dict: holding the nodes
# in a dict of ours would keep custom Functions' ctx attributes alive and change the memory being measured


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class StepCategories:
    """Labels the storages of a forward + backward of `model` (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._stack: list[str] = []
        self._after_model = False
        self._tracker = None
        self._base_out: list[torch.Tensor] = []
        self._handles: list = []
        self._checkpointed: list = []

    # ------------------------------------------------------------------ labels
    def label(self) -> str:
        """The category of a storage created now."""
        if self._stack:
            return self._stack[-1]
        if _in_backward():
            node = torch._C._current_autograd_node()
            # an unlabeled node in backward: the engine summing the residual stream's gradient, or the final norm
            return node.metadata.get(_KEY, "residual") if node is not None else "residual"
        return "loss" if self._after_model else "other"

    def attach(self, tracker) -> None:
        """The tracker whose storages `relabel` moves (checkpointed inputs)."""
        self._tracker = tracker

    def label_loss(self, loss: torch.Tensor) -> None:
        """Marks the backward nodes between `loss` and the base model's output as "loss"."""
        self._label_graph([loss], "loss", stop=self._base_out)
        self._base_out = []  # holding the base model's output would keep it alive through backward

    # ------------------------------------------------------------------ graph
    def _label_graph(self, outputs, category: str, stop=()) -> None:
        """Records `category` for the nodes reachable from `outputs`, up to nodes already labeled or in `stop`."""
        stop_nodes = [
            t.grad_fn for t in stop if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        for node in stop_nodes:
            node.metadata.setdefault(_STOP, True)
        todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or _KEY in node.metadata or node.metadata.get(_STOP):
                continue
            node.metadata[_KEY] = category
            todo.extend(next_node for next_node, _ in node.next_functions)
        for node in stop_nodes:
            node.metadata.pop(_STOP, None)

    def _hooks(self, module: nn.Module, category: str, checkpoint_input: bool = False):
        def pre(mod, args, kwargs):
            if checkpoint_input and not _in_backward() and self._tracker is not None:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor):
                    self._tracker.relabel(hidden, "checkpoints")
            self._stack.append(category)

        def post(mod, args, kwargs, output):
            self._stack.pop()
            if not _in_backward() and torch.is_grad_enabled():
                outputs = output if isinstance(output, tuple) else (output,)
                self._label_graph(outputs, category, stop=[*args, *kwargs.values()])

        return (
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True, always_call=True),
        )

    def _labeled_recompute(self, checkpoint_fn):
        """The layer's checkpoint function, running the layer under "residual" (its recompute runs no layer hooks)."""

        def run(function, *args, **kwargs):
            def labeled(*a, **k):
                self._stack.append("residual")
                try:
                    return function(*a, **k)
                finally:
                    self._stack.pop()

            return checkpoint_fn(labeled, *args, **kwargs)

        run.keywords = getattr(
            checkpoint_fn, "keywords", {}
        )  # offload_checkpoints checks use_reentrant there
        return run

    # ------------------------------------------------------------------ context
    def __enter__(self) -> StepCategories:
        causal_lm = base_model(self.model)
        base = (
            causal_lm.get_decoder()
            if hasattr(causal_lm, "get_decoder")
            else getattr(causal_lm, "model", causal_lm)
        )
        layers = decoder_layers(self.model)
        self._checkpointed = [
            (layer, layer._gradient_checkpointing_func)
            for layer in layers
            if callable(getattr(layer, "_gradient_checkpointing_func", None))
        ]
        for layer, checkpoint_fn in self._checkpointed:
            layer._gradient_checkpointing_func = self._labeled_recompute(checkpoint_fn)
        for layer in layers:
            self._handles += self._hooks(layer, "residual", checkpoint_input=True)
            for part, category in layer_parts(layer):
                self._handles += self._hooks(part, category)

        def base_done(mod, args, kwargs, output):
            self._after_model = True
            hidden = (
                output[0]
                if isinstance(output, tuple)
                else getattr(output, "last_hidden_state", output)
            )
            self._base_out = [hidden] if isinstance(hidden, torch.Tensor) else []

        def base_start(mod, args, kwargs):
            self._after_model = False

        self._handles += [
            base.register_forward_pre_hook(base_start, with_kwargs=True),
            base.register_forward_hook(base_done, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for layer, checkpoint_fn in self._checkpointed:
            layer._gradient_checkpointing_func = checkpoint_fn
        self._checkpointed = []
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self._base_out = []
