"""The fused UPipe attention block on transformers' attention modules: installed, counted and removed.

Entry points:
- `install_fused_attention(model)` / `remove_fused_attention(model)`: replace (and restore, exactly) the forward of
  every attention module of the registry's fused architectures (`hf_upipe.models.architectures.FUSED`: the Llama-shaped
  families, with q/k/v biases, per-head or whole-projection q/k norms, a fused qkv projection, interleaved or
  partial RoPE, NoPE layers, sliding windows), once it is verified on the installed transformers. A module with a
  setting the block does not compute or a layer it does not read (`unfused_reason`) keeps the registered path,
  which runs the module's own forward, with one log line per reason naming the classes. `hf_upipe.prepare_model`
  calls them.
- `count_fused(model)`: how many of the model's attention modules run the fused block.

The sections below: what the block reads off a module (`attention_weights`, `unfused_reason`), the forward it
installs (`fused_forward`), and whether it is verified on the installed transformers (`fused_verdict`,
`fused_check`, `fused_unavailable`).

The installed forward is an instance attribute; removing it is deleting that attribute, which leaves the module
exactly as it was. Not supported in the fused path (raises): DoRA, LoRA bias, merged-and-disabled adapters
(quantized base layers are left on the registered path at installation, above).

What the fused UPipe attention block reads off a transformers attention module, and what it cannot read.

Entry points:
- `attention_weights(module, arch)`: the module's tensors as `hf_upipe.ops.fused_attention.AttentionWeights`,
  reading PEFT LoRA layers (active adapters, scaling, dropout) on q_proj/k_proj/v_proj (or qkv_proj)/o_proj.
  Not supported (raises): DoRA, LoRA bias, merged-and-disabled adapters, projections other than `nn.Linear`.
- `unfused_reason(module)`: why a module keeps the registered path (a setting the block does not compute:
  bidirectional attention, logit soft-capping, Cohere's per-head LayerNorm q/k norms; or a layer it does not read:
  quantized projections such as bitsandbytes' `Linear4bit`, under PEFT LoRA or not; an OLMo 2 q/k norm whose
  forward another library replaced), or None.

The forward the fused UPipe attention block installs on an attention module.

Entry points:
- `fused_forward(self, hidden_states, ...)`: under sequence parallelism, validates the batch like the registered
  path (once per model forward; every rank raises the same error before any all-to-all) and calls
  `fused_upipe_attention` on the normed hidden states (for packed rows, `upipe_cu_seqlens` in the kwargs, with the
  kernel wrapped in `hf_upipe.ops.documents.DocumentKernel`, as the registered path does); without SP, with another
  attention function chosen for the call, or under autocast to a dtype other than the weights', it calls the class's
  own forward (without SP: exact "sdpa", which handles packing itself).
- `OPTIONS_ATTRIBUTE`: the instance attribute holding the block's options, {"save_attention":
  `UPipeConfig.fused_backward` == "save", "overlap": `UPipeConfig.overlap_comm`}, which
  `hf_upipe.attention.fused.install_fused_attention` sets.

Gradients are returned by one autograd Function per layer (never accumulated into `.grad` by hand), so DDP/FSDP
hooks and the model's non-reentrant activation checkpointing see an ordinary op.

Whether the fused UPipe attention block computes what an architecture's attention computes.

Entry points:
- `fused_verdict(arch)`: verified by the fingerprint of a verified release, else by `fused_check(arch)`
  (`hf_upipe.models.verification`).
- `fused_check(arch)`: the block against the module's own forward and backward on a tiny model, plain and with LoRA.
- `fused_unavailable(config)`: why `hf_upipe.attention.fused.install_fused_attention` would not install the block
  on a model of this config (no adapter for its architecture, or the block is not verified on the installed
  transformers), or None.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

from hf_upipe.adapters.call_checks import CACHE_NAMES
from hf_upipe.adapters.replaced import own_forward
from hf_upipe.adapters.zero3 import forget_children, gather_children
from hf_upipe.attention.call import SpCall, sp_call
from hf_upipe.attention.state import (
    active_state,
    attention_overridden,
    local_sequence_parallel,
)
from hf_upipe.distributed import without_sequence_parallel
from hf_upipe.models.architectures import (
    ARCHITECTURES,
    fused_attention_classes,
    model_geometry,
    source_fingerprint,
)
from hf_upipe.models.probe import case_config, compare, model_pair, with_lora
from hf_upipe.models.verification import (
    TESTED_RANGE,
    VERIFIED_RELEASES,
    Verdict,
    installed_version,
    verify,
)
from hf_upipe.ops.fake import is_fake
from hf_upipe.ops.fused_attention import (
    AttentionWeights,
    HeadNorm,
    LoraAdapter,
    Projection,
    ProjectionNorm,
    RopeStyle,
    fused_upipe_attention,
)
from hf_upipe.ops.ring import ring_positions

__all__ = [
    "OPTIONS_ATTRIBUTE",
    "attention_weights",
    "count_fused",
    "fused_check",
    "fused_forward",
    "fused_unavailable",
    "fused_verdict",
    "install_fused_attention",
    "remove_fused_attention",
    "unfused_reason",
]


def _projection(layer: nn.Module, training: bool) -> Projection:
    """nn.Linear or a PEFT LoRA Linear -> Projection (base weight/bias + the active adapters)."""
    if hasattr(layer, "base_layer") and hasattr(layer, "lora_A"):  # peft.tuners.lora.layer.Linear
        base = layer.get_base_layer()
        adapters = []
        if layer.merged and layer.disable_adapters:
            raise NotImplementedError(
                "LoRA adapters are merged and disabled: unmerge them first (unmerge_adapter())."
            )
        if not layer.merged and not layer.disable_adapters:
            for name in layer.active_adapters:
                if name not in layer.lora_A:
                    continue
                if layer.use_dora.get(name, False):
                    raise NotImplementedError(
                        f"DoRA (adapter {name!r}) is not supported by the fused UPipe path."
                    )
                if getattr(layer, "lora_bias", {}).get(name, False):
                    raise NotImplementedError(
                        f"LoRA bias (adapter {name!r}) is not supported by the fused UPipe path."
                    )
                drop = layer.lora_dropout[name]
                p = drop.p if isinstance(drop, nn.Dropout) and training else 0.0
                adapters.append(
                    LoraAdapter(
                        layer.lora_A[name].weight,
                        layer.lora_B[name].weight,
                        float(layer.scaling[name]),
                        p,
                    )
                )
        layer = base
        extra = tuple(adapters)
    else:
        extra = ()
    if type(layer) is not nn.Linear:
        raise NotImplementedError(
            f"{type(layer).__name__} projections (quantized or custom layers) are not supported by the fused "
            "UPipe path; load the model without quantization."
        )
    return Projection(layer.weight, layer.bias, extra)


def _split_rows(proj: Projection, sizes: list[int]) -> list[Projection]:
    """A fused projection (rows q | k | v) -> one Projection per part: row views of the weight, bias and LoRA B;
    the LoRA A is shared (one tensor, so its gradient and dropout mask are one, as in PEFT)."""
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        out.append(
            Projection(
                proj.weight[rows],
                None if proj.bias is None else proj.bias[rows],
                tuple(LoraAdapter(a.A, a.B[rows], a.scaling, a.dropout) for a in proj.adapters),
            )
        )
        start += n
    return out


def attention_weights(module: nn.Module, arch) -> AttentionWeights:
    """The attention module's tensors (PEFT adapters included) for `fused_upipe_attention`."""
    training = module.training
    if arch.qkv_fused:
        D, cfg = module.head_dim, module.config
        q, k, v = _split_rows(
            _projection(module.qkv_proj, training),
            [cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.num_key_value_heads * D],
        )
    else:
        q, k, v = (_projection(getattr(module, f"{n}_proj"), training) for n in "qkv")
    norms = {}
    for name in ("q_norm", "k_norm"):
        norm = getattr(module, name, None)
        if norm is None:
            continue
        if (
            arch.projection_norm
        ):  # the registry's fingerprint covers this norm's forward, re-implemented here
            norms[name] = ProjectionNorm(norm.weight, float(norm.variance_epsilon))
        else:
            norms[name] = HeadNorm(norm, tuple(norm.parameters()))
    rope = RopeStyle(arch.rope_interleaved, arch.rope_fp32, bool(getattr(module, "use_rope", True)))
    return AttentionWeights(
        q=q, k=k, v=v, o=_projection(module.o_proj, training), **norms, rope=rope
    )


def unfused_reason(module: nn.Module) -> str | None:
    """Why this attention module keeps the registered path (a setting or a layer the fused block does not
    compute), or None."""
    if not getattr(module, "is_causal", True):
        return "bidirectional attention"
    if getattr(module, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(module, "use_qk_norm", False):
        return "per-head LayerNorm q/k norms"
    for name in _PROJECTIONS:
        layer = getattr(module, name, None)
        base = layer.get_base_layer() if hasattr(layer, "base_layer") else layer
        if layer is not None and type(base) is not nn.Linear:  # bitsandbytes' Linear4bit, ...
            return f"{type(base).__name__} projections (quantized or custom layers)"
    arch = fused_attention_classes().get(type(module).__name__)
    if arch is not None and arch.projection_norm:  # its norm math is re-implemented, not called
        for name in ("q_norm", "k_norm"):
            norm = getattr(module, name, None)
            if norm is not None and own_forward(norm) is not None:
                return f"a replaced {name} forward ({own_forward(norm).by})"
    return None


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")

logger = logging.getLogger(__name__)

# instance attribute: the fused block's options (see the module docstring)
OPTIONS_ATTRIBUTE = "_upipe_fused_options"


def _call_arguments(args: tuple, kwargs: dict) -> tuple:
    """An attention forward's (position_embeddings, attention_mask, cache, other kwargs), whichever way the decoder
    layer passed them (by position or by name, the cache under either name)."""
    kwargs = dict(kwargs)
    named = [kwargs.pop(n, None) for n in ("position_embeddings", "attention_mask")]
    cache = next((kwargs.pop(n) for n in CACHE_NAMES if kwargs.get(n) is not None), None)
    for n in CACHE_NAMES:
        kwargs.pop(n, None)
    position_embeddings, attention_mask, positional_cache = (*args, None, None, None)[:3]
    return (
        position_embeddings if position_embeddings is not None else named[0],
        attention_mask if attention_mask is not None else named[1],
        positional_cache if positional_cache is not None else cache,
        kwargs,
    )


def fused_forward(self, hidden_states, *args, **kwargs):
    """Forward installed on known attention modules: the fused UPipe block under SP, the original otherwise."""
    state = active_state()
    if state is None or attention_overridden() or _autocast_other_dtype(self, hidden_states):
        return type(self).forward(
            self, hidden_states, *args, **kwargs
        )  # without SP: "sdpa"; else registered
    position_embeddings, attention_mask, cache, kwargs = _call_arguments(args, kwargs)
    arch = fused_attention_classes()[type(self).__name__]
    B, s, _ = hidden_states.shape  # [B, s, hidden]
    window = getattr(self, "sliding_window", None)
    if window is None and arch.window_in_config:
        window = getattr(self.config, "sliding_window", None)
    call = SpCall(
        self,
        attention_mask,
        B,
        s,
        hidden_states.device,
        hidden_states.dtype,
        is_fake(hidden_states),
        dropout=self.attention_dropout if self.training else 0.0,
        window=window,
        past=0 if cache is None else cache.get_seq_length(self.layer_idx),
        path="the fused UPipe block",
        chunks=False,  # the block implements neither chunks nor soft-capping nor sinks (handled=())
    )
    kwargs, kernel = sp_call(state, call, kwargs)
    cos, sin = position_embeddings
    gather_children(self)  # ZeRO-3: q/k/v/o_proj are read here, not called
    y = fused_upipe_attention(
        hidden_states,
        cos,
        sin,
        attention_weights(self, arch),
        num_heads=self.config.num_attention_heads,
        num_kv_heads=self.config.num_key_value_heads,
        head_dim=self.head_dim,
        group=state.attention_group,
        heads_per_chunk=state.heads_per_chunk,
        kernel=kernel,
        scale=self.scaling,
        # LoRA dropout's masks are drawn by global token position (ring shards hold two chunks)
        positions=lambda: ring_positions(
            state.sp_rank, s, state.sp_size, state.ring_size, hidden_states.device
        ),
        **self.__dict__.get(OPTIONS_ATTRIBUTE, {}),
    )
    return y, None


def _autocast_other_dtype(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Autocast to a dtype other than the module's weights' (bf16 autocast over an fp32 model, as the Trainer's
    `bf16=True` runs one): the fused block computes in its inputs' dtype and does not autocast its own products, so
    the call takes the registered "upipe" path, where transformers' projections autocast as they do on one device.
    Logged once."""
    device = hidden_states.device.type
    if not torch.is_autocast_enabled(device):
        return False
    weight = next(module.parameters(), None)
    if weight is None or weight.dtype == torch.get_autocast_dtype(device):
        return False
    if not _AUTOCAST_SAID:
        _AUTOCAST_SAID.append(True)
        logger.info(
            "hf_upipe: under %s autocast over %s weights the attention takes the registered 'upipe' path, "
            "not the fused block (load the model in %s to use it)",
            torch.get_autocast_dtype(device),
            weight.dtype,
            torch.get_autocast_dtype(device),
        )
    return True


_AUTOCAST_SAID: list[bool] = []


def fused_verdict(arch) -> Verdict:
    """Whether the fused block computes what `arch`'s attention computes on the installed transformers: by the
    fingerprint of a verified release, else by `fused_check` (`hf_upipe.models.verification`)."""
    source = source_fingerprint(arch, "fused")
    return verify(
        "fused", arch.model_type, source, arch.fused_fingerprints, lambda: fused_check(arch)
    )


def fused_check(arch) -> str | None:
    """The fused block against the attention's own forward and backward on a tiny model of `arch` (its
    `ADAPTER_CASES` variant: biases, windows, partial rotary, NoPE layers, logit scaling, ...), plain and with
    LoRA, in fp32 on 13 tokens in 8 one-head stages: None when the logits and every gradient agree, else what
    differed."""
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    config = case_config(
        arch.model_type, **({"sliding_window": 5} if arch.window_in_config else {})
    )
    with without_sequence_parallel(), local_sequence_parallel(heads_per_chunk=1):
        for lora in (False, True):
            ref, model = model_pair(config, "upipe", seed=5)
            if lora:
                ref, model = with_lora(ref, 5), with_lora(model, 5)
                if ref is None:  # no peft here: LoRA cannot be used, nor checked
                    break
                model.load_state_dict(ref.state_dict())
            modules = [
                m
                for m in model.modules()
                if type(m).__name__ == arch.attention and unfused_reason(m) is None
            ]
            if not modules:
                return f"the tiny {arch.model_type} model has no {arch.attention} the fused block takes"
            for module in modules:
                module.forward = types.MethodType(fused_forward, module)
            detail = compare(ref, model, ids)
            if detail is not None:
                return f"{detail}{' (with LoRA)' if lora else ''}"


def fused_unavailable(config) -> str | None:
    """Why `install_fused_attention` would keep a model of `config` on the registered "upipe" path, or None where
    it installs the fused block: the registry has no fused adapter for the architecture, or the block is not
    verified on the installed transformers (`fused_verdict`; this runs its check once on a source not seen before).
    """
    model_type = model_geometry(config)["model_type"]
    arch = ARCHITECTURES.get(model_type)
    if arch is None or not arch.fused:
        return f"{model_type} has no fused attention adapter"
    verdict = fused_verdict(arch)
    if not verdict.ok:
        return (
            f"the fused block is not verified for {arch.attention} on transformers {installed_version()} "
            f"({verdict.detail}; it is verified on {', '.join(VERIFIED_RELEASES)}: pip install '{TESTED_RANGE}'), "
            "so a run keeps the registered 'upipe' path"
        )
    return None


def _is_fused(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is fused_forward


def install_fused_attention(
    model: nn.Module, save: bool = False, overlap: bool = False
) -> tuple[int, set[str], set[str]]:
    """Install `fused_forward` on every attention module of the registry's fused architectures (idempotent), with
    its backward in save mode when `save` and its all-to-alls overlapped when `overlap`
    (`hf_upipe.ops.fused_attention`).

    Returns:
        (modules fused, attention classes left on the registered path because the fused block failed its check on
        the installed transformers (`fused_verdict`), other attention classes found).
    """
    classes = fused_attention_classes()
    fused, changed, other, kept = 0, set(), set(), {}
    for module in model.modules():
        name = type(module).__name__
        arch = classes.get(name)
        if arch is None:
            if name.endswith("Attention") and hasattr(module, "q_proj"):
                other.add(name)
            continue
        if not fused_verdict(arch).ok or ("forward" in module.__dict__ and not _is_fused(module)):
            changed.add(
                name
            )  # a changed class, or an instance whose forward someone else replaced: not stacked
            continue
        if (reason := unfused_reason(module)) is not None:
            kept.setdefault(reason, set()).add(name)
            other.add(name)
            continue
        module.forward = types.MethodType(fused_forward, module)
        module.__dict__[OPTIONS_ATTRIBUTE] = {"save_attention": save, "overlap": overlap}
        fused += 1
    for reason, names in sorted(kept.items()):
        logger.info(
            "hf_upipe: %s keep the registered 'upipe' path, not the fused block: %s",
            sorted(names),
            reason,
        )
    return fused, changed, other


def remove_fused_attention(model: nn.Module) -> int:
    """Give every fused attention module its class's forward back (exactly). Returns how many were restored."""
    count = 0
    for module in model.modules():
        if _is_fused(module):
            del module.forward
            module.__dict__.pop(OPTIONS_ATTRIBUTE, None)
            forget_children(module)
            count += 1
    return count


def count_fused(model: nn.Module) -> int:
    """How many of `model`'s attention modules run the fused block (the others keep the registered path)."""
    return sum(_is_fused(module) for module in model.modules())
