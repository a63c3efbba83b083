"""Tiled MLP and RMSNorm: a model's own per-token modules run over sequence chunks, recomputed in backward.

Entry points:
- `tiled_mlp(x, forward_fn, params, *, chunk_tokens)`: the op on an explicit function and its trainable tensors.
- `TiledMLPFunction`: its autograd Function.
- `apply_tiled_mlp(model, chunk_tokens=None, *, norms=True)`: install it on the MLP modules (and the decoder
  layers' and final RMSNorms) of a loaded model (idempotent; plain or PEFT); `remove_tiled_mlp(model)` undoes it
  exactly. The modules handled are the registry's (`hf_upipe.models.architectures`), once verified on the installed
  transformers: `tiled_verdict(arch)`, by the fingerprint of a verified release, else by `tiled_check(arch)`, the
  tiled modules against their own forward and backward on a tiny model (`hf_upipe.models.verification`).
- `default_chunk_tokens(hidden_size)`: the default tile, `hidden_size` tokens (ALST's shards = ceil(s / hidden)).

Why: a gated MLP keeps gate, up, act(gate), act(gate)*up for backward, [B, s, I] each, with I about 3.5 x the
hidden size: at 1M tokens per 8 ranks on Llama3-8B shapes that is ~21 GiB per layer, more than attention. Here
the forward runs chunk by chunk under no_grad, keeping only the input x [B, s, Dm]; the backward recomputes each
chunk with grad enabled and takes its gradients with `torch.autograd.grad`, so at most one chunk's
intermediates [B, c, I] exist at a time. The same holds for RMSNorm, whose autograd keeps fp32 copies of its
[B, s, Dm] input (two to three times the bf16 activation each, the largest tensors of a checkpointed layer's
backward once attention and MLP are tiled); the per-head q_norm/k_norm inside attention are left alone.

Composability: the parameters' gradients are summed over chunks inside the backward (in fp32 for 16-bit
parameters) and returned as the Function's input gradients, so each parameter's gradient is accumulated ONCE per
call: DDP's per-parameter hooks and FSDP2's post-backward reduce-scatter fire once, as for the plain MLP. No
collective runs inside, and the chunk count depends only on the local shape, which is equal on every rank of an
SP group, so no rank can wait on another. RNG (LoRA dropout) is forked and replayed so recomputed chunks draw the
same masks as the forward.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

from hf_upipe.adapters.replaced import own_forward, sequence_local
from hf_upipe.adapters.zero3 import forget_children, gather_children
from hf_upipe.distributed import without_sequence_parallel
from hf_upipe.models.architectures import source_fingerprint, tiled_mlp_classes, tiled_norm_classes
from hf_upipe.models.probe import case_config, compare, model_pair, with_lora
from hf_upipe.models.verification import Verdict, verify
from hf_upipe.ops.fake import chunk_starts

logger = logging.getLogger(__name__)

__all__ = [
    "TiledMLPFunction",
    "apply_tiled_mlp",
    "default_chunk_tokens",
    "remove_tiled_mlp",
    "tiled_check",
    "tiled_mlp",
    "tiled_verdict",
]

_HEAD_NORMS = ("q_norm", "k_norm")  # per-head norms inside attention: [B, s, H, D], not tiled


def default_chunk_tokens(hidden_size: int) -> int:
    """Tokens per chunk: `hidden_size`, so a chunk's [c, I] intermediate is the size of one MLP weight."""
    return max(1, int(hidden_size))


def _rng_state(device: torch.device):
    cpu = torch.get_rng_state()
    acc = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, acc


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class TiledMLPFunction(torch.autograd.Function):
    """y = forward_fn(x) computed over chunks of the sequence (dim 1); only x is saved."""

    @staticmethod
    def forward(ctx, x, forward_fn, chunk_tokens, *params):
        # x: [B, s, Dm]; every chunk x[:, a:b] -> y[:, a:b]
        ctx.forward_fn, ctx.chunk_tokens, ctx.n_params = forward_fn, chunk_tokens, len(params)
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        ctx.params = params  # not saved tensors: FSDP2 frees and refills their storage between forward and backward
        s = x.shape[1]
        out = None
        with torch.no_grad():
            for a in chunk_starts(s, chunk_tokens, x):
                y = forward_fn(x[:, a : a + chunk_tokens])  # [B, c, Dout]
                if out is None:
                    out = y.new_empty(x.shape[0], s, *y.shape[2:])  # [B, s, Dout]
                out[:, a : a + chunk_tokens].copy_(y)
                del y
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,), params = ctx.saved_tensors, ctx.params
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        want_x = ctx.needs_input_grad[0]
        dx = torch.empty_like(x) if want_x else None
        acc = {
            i: torch.zeros_like(
                params[i],
                dtype=torch.float32
                if params[i].dtype in (torch.float16, torch.bfloat16)
                else params[i].dtype,
            )
            for i in wanted
        }
        s, c = x.shape[1], ctx.chunk_tokens
        grad_out = grad_out.contiguous()
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            _set_rng_state(ctx.rng, x.device)
            for a in chunk_starts(s, c, x):
                xc = x[:, a : a + c].detach().requires_grad_(want_x)  # [B, c, Dm]
                with torch.enable_grad():
                    y = ctx.forward_fn(xc)
                inputs = ([xc] if want_x else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(
                    y, inputs, grad_out[:, a : a + c]
                )  # unused: an error, not a silent zero
                del y
                if want_x:
                    dx[:, a : a + c].copy_(grads[0])
                for i, g in zip(wanted, grads[1:] if want_x else grads):
                    acc[i].add_(g)
                del grads
        param_grads = [acc[i].to(params[i].dtype) if i in acc else None for i in range(len(params))]
        return (dx, None, None, *param_grads)


def tiled_mlp(x: torch.Tensor, forward_fn, params, *, chunk_tokens: int) -> torch.Tensor:
    """`forward_fn(x)` over chunks of `chunk_tokens` along dim 1, recomputed per chunk in backward.

    Args:
        x: [B, s, Dm] input.
        forward_fn: a per-token function of x (the MLP's own forward), using the tensors in `params`.
        params: every tensor `forward_fn` reads that may need a gradient (the module's parameters).
        chunk_tokens: tokens per chunk (>= 1).

    Returns:
        [B, s, Dout], equal to `forward_fn(x)` (same GEMMs per token; fp32 rounding of the summed weight grads).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if x.dim() != 3:
        raise ValueError(f"tiled_mlp expects x [B, s, Dm], got shape {tuple(x.shape)}")
    needs = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if x.shape[1] <= chunk_tokens or not needs:
        return forward_fn(x)  # one chunk, or no backward: nothing to save either way
    return TiledMLPFunction.apply(x, forward_fn, int(chunk_tokens), *params)


def _tiled_forward(self, x):
    """Installed as the instance's `forward`: the forward it replaced (a kernel's, verified per-token) or its
    class's own forward, run over sequence chunks."""
    chunk = self._upipe_mlp_chunk or default_chunk_tokens(x.shape[-1])
    gather_children(
        self
    )  # ZeRO-3: whole gate/up/down_proj for the captured params and the backward's recompute
    params = [p for p in self.parameters() if p.requires_grad]
    inner = self.__dict__.get(_WRAPPED) or functools.partial(type(self).forward, self)
    return tiled_mlp(x, inner, params, chunk_tokens=chunk)


# instance attribute: the forward another library had set on the module (Liger, a Hub kernel), which the tiles run
_WRAPPED = "_upipe_wrapped_forward"


def _wrappable(module: nn.Module) -> str | None:
    """None when the tiles may run this module's current forward; else why not. Its class's own forward, or one
    another library set that `hf_upipe.adapters.replaced.sequence_local` finds per-token."""
    found = own_forward(module)
    if found is None:
        return None
    return sequence_local(module, module.forward)


def _is_tiled(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _tiled_forward


def apply_tiled_mlp(
    model: nn.Module, chunk_tokens: int | None = None, *, norms: bool = True
) -> int:
    """Run every known MLP module of `model` (plain or PEFT) tiled; returns how many MLPs were tiled.

    The known modules are the registry's (`hf_upipe.models.architectures`: gated MLPs and RMSNorms of the Llama-shaped
    families), once verified on the installed transformers (`tiled_verdict`); others keep their forward, with a
    warning. Idempotent (a second call only updates `chunk_tokens`).

    Args:
        model: a transformers model, a PEFT model, or any module tree.
        chunk_tokens: tokens per chunk; None = the hidden size (`default_chunk_tokens`).
        norms: also tile the RMSNorms of the decoder layers and the final norm.

    Raises:
        ValueError: chunk_tokens < 1.
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be >= 1 (or None for the hidden size), got {chunk_tokens}"
        )
    mlps, norm_classes = tiled_mlp_classes(), tiled_norm_classes() if norms else {}
    count, other, changed, replaced = 0, set(), set(), {}
    for path, module in model.named_modules():
        name = type(module).__name__
        arch = mlps.get(name) or (
            norm_classes.get(name) if path.rsplit(".", 1)[-1] not in _HEAD_NORMS else None
        )
        if arch is None:
            if name.endswith("MLP"):
                other.add(name)
            continue
        if not tiled_verdict(arch).ok:
            changed.add(name)
            continue
        if not _is_tiled(module):
            if (why := _wrappable(module)) is not None:  # a replaced forward the tiles cannot run
                replaced[name] = why
                continue
            if (
                "forward" in module.__dict__
            ):  # a kernel's forward (or a bound copy of the class's): tiled
                module.__dict__[_WRAPPED] = module.__dict__["forward"]
            module.forward = types.MethodType(_tiled_forward, module)
        module._upipe_mlp_chunk = chunk_tokens
        count += name in mlps
    if changed:
        logger.warning(
            "hf_upipe: tiled MLP not applied to %s: not verified on the installed transformers (the "
            "warning above says why)",
            sorted(changed),
        )
    if other:
        logger.warning(
            "hf_upipe: tiled MLP not applied to %s (not a known gated MLP)", sorted(other)
        )
    for name, why in sorted(replaced.items()):
        logger.warning(
            "hf_upipe: tiled MLP not applied to %s: another library replaced its forward, and %s",
            name,
            why,
        )
    logger.info(
        "hf_upipe: tiled MLP on %d module(s), chunk %s tokens", count, chunk_tokens or "hidden_size"
    )
    return count


def remove_tiled_mlp(model: nn.Module) -> int:
    """Give every tiled module its class's forward back (exactly: no attribute of the tiling is left). Returns how
    many modules were restored."""
    count = 0
    for module in model.modules():
        if _is_tiled(module):
            del module.forward, module._upipe_mlp_chunk
            if _WRAPPED in module.__dict__:  # the kernel's forward it ran, back as it was
                module.forward = module.__dict__.pop(_WRAPPED)
            forget_children(module)
            count += 1
    return count


def tiled_verdict(arch) -> Verdict:
    """Whether the tiled MLP/norm compute what `arch`'s own do on the installed transformers: by the fingerprint
    of a verified release, else by `tiled_check` (`hf_upipe.models.verification`)."""
    source = source_fingerprint(arch, "tiled")
    return verify(
        "tiled", arch.model_type, source, arch.tiled_fingerprints, lambda: tiled_check(arch)
    )


def tiled_check(arch) -> str | None:
    """The tiled MLP and norms (4-token chunks) against the modules' own forward and backward on a tiny model of
    `arch`, plain and with LoRA, fp32 on 13 tokens: None when the logits and every gradient agree, else what
    differed."""
    with without_sequence_parallel():  # the tiny models run whole, whatever SP state the caller has
        return _tiled_check(arch)


def _tiled_check(arch) -> str | None:
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    names = {arch.mlp, arch.norm} - {None}
    for lora in (False, True):
        ref, model = model_pair(case_config(arch.model_type), "sdpa", seed=6)
        if lora:
            ref, model = with_lora(ref, 6), with_lora(model, 6)
            if ref is None:  # no peft here: LoRA cannot be used, nor checked
                break
            model.load_state_dict(ref.state_dict())
        modules = [
            m
            for path, m in model.named_modules()
            if type(m).__name__ in names and path.rsplit(".", 1)[-1] not in _HEAD_NORMS
        ]
        if not modules:
            return f"the tiny {arch.model_type} model has no {sorted(names)}"
        for module in modules:
            module.forward = types.MethodType(_tiled_forward, module)
            module._upipe_mlp_chunk = 4
        detail = compare(ref, model, ids)
        if detail is not None:
            return f"{detail}{' (with LoRA)' if lora else ''}"
    return None
