"""Forwards another library replaced: Liger kernels, Hub kernels (`use_kernels=True`), hand-made patches.

Entry points:
- `replaced_forwards(model)`: every forward in `model` that is neither its class's own (as transformers, torch,
  PEFT or bitsandbytes define it) nor hf_upipe's adapter, as `Replacement`s: an instance `forward` set on a module
  (Liger's `_patch_rms_norm_module`, `_patch_swiglu_module`, its fused linear cross-entropy with `model=`; a Hub
  kernel's layer), a class `forward` replaced on the class (`LlamaForCausalLM.forward = ...`), a module of a class
  defined outside those libraries (`LigerRMSNorm` built after `modeling_llama.LlamaRMSNorm = LigerRMSNorm`), and
  the modeling module's `apply_rotary_pos_emb` rebound to another function (Liger's RoPE).
- `replacement_refusal(model)` (`base_refusal(base)` for a model already PEFT-unwrapped): why the model cannot
  run under sequence parallelism because of one of them, or None. A replacement on a per-token module (an
  RMSNorm, LayerNorm or MLP) or on the RoPE function is admitted (a quantized or custom Linear of a library
  hf_upipe does not know: optimum-quanto, HQQ, ...) is admitted once `sequence_local` finds it local by
  behaviour; any other (attention, decoder layer, the causal LM's forward with its fused linear cross-entropy,
  embeddings) is refused: hf_upipe cannot see what it computes on a shard.
- `own_forward(module)`: the replacement on one module (None: its class's own forward, or hf_upipe's adapter).
- `sequence_local(module)`: None when the module's forward, run on its own weights and device, gives every token
  the output and the input gradient it gives that token in the whole sequence (split in two, compared with the
  whole), else what differed or what it raised. Cached per (class, forward function, device type, dtype): the
  property checked is the function's, not the weights'.

Why behaviour, not source: sequence parallelism and the tiled MLP/norms need one property of a per-token module,
that token t's output depends only on token t's input. hf_upipe checks that property on the replaced forward as it
will run (a Triton kernel on the GPU, say), so the comparison is with the same kernel in one process. A forward that
raises in the check (a GPU kernel on a CPU tensor) is refused, never run as if it were the verified module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from hf_upipe.models.peft import base_model

__all__ = [
    "Replacement",
    "base_refusal",
    "own_forward",
    "replaced_forwards",
    "replacement_refusal",
    "sequence_local",
]

# libraries whose module classes hf_upipe sees through (their forwards are what the registry and the gate judge)
_KNOWN = ("transformers.", "torch.", "peft.", "bitsandbytes.", "accelerate.", "hf_upipe.")
_PER_TOKEN = ("RMSNorm", "LayerNorm", "MLP")  # class-name endings of per-token modules
_ROPE = "apply_rotary_pos_emb"


@dataclass(frozen=True)
class Replacement:
    """path: the module's path in the model ("" the model itself), or the modeling module for a function; owner:
    its class or function name; by: the replacing function ("module.qualname"); kind: "instance", "class",
    "foreign class" or "function"; per_token: an RMSNorm, LayerNorm, MLP or Linear (or the RoPE function), whose
    replacement `sequence_local` may verify."""

    path: str
    owner: str
    by: str
    kind: str
    per_token: bool = False

    def describe(self) -> str:
        where = (
            f"{self.owner} ({self.path or 'the model'})" if self.kind != "function" else self.owner
        )
        return f"{where}: its forward is {self.by} ({self.kind} replacement)"


def _name(fn) -> str:
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _defined_by(fn, cls: type) -> bool:
    """Whether `fn` is `cls`'s own method (decorators that keep `__wrapped__` metadata included)."""
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__module__", None) == cls.__module__ and getattr(
        fn, "__qualname__", ""
    ).startswith(f"{cls.__qualname__}.")


def _trl_fused_head(func, cls: type) -> bool:
    """Whether `func` is TRL's fused LM head over `cls.forward` (`trl.trainer.utils`, which DPOTrainer installs on
    the model): the class's forward on the backbone, then per-token log-probabilities of the labels. Token-local
    given `shift_labels` (the call checks refuse `labels=` without them under SP), so it is the class's forward."""
    code = getattr(func, "__code__", None)
    return (
        code is not None
        and code.co_name == "_fused_forward"
        and getattr(func, "__globals__", {}).get("__name__") == "trl.trainer.utils"
        and getattr(func, "__wrapped__", None) is getattr(cls, "forward", None)
    )


def _class_forward(cls: type) -> tuple[type, object] | None:
    """(the class in the MRO that defines `forward`, that forward); None for nn.Module's placeholder. A subclass
    whose forward is only transformers' checkpointing wrapper around its base's forward (what
    `GradientCheckpointingLayer.__init_subclass__` gives every subclass, FSDP2's `FSDP<Layer>` classes included)
    defines nothing new: the base is the owner."""
    mro = [c for c in cls.__mro__ if "forward" in c.__dict__]
    for i, owner in enumerate(mro):
        if owner is nn.Module:
            return None
        fn = owner.__dict__["forward"]
        base = mro[i + 1] if i + 1 < len(mro) else None
        if base is None or not _checkpointing_wrapper(fn, base.__dict__["forward"]):
            return owner, fn
    return None


def _checkpointing_wrapper(fn, inner) -> bool:
    """Whether `fn` is transformers' `forward_with_checkpointing` around `inner` (it only checkpoints `inner`)."""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "forward_with_checkpointing"
        and getattr(fn, "__globals__", {}).get("__name__") == "transformers.modeling_layers"
        and getattr(fn, "__wrapped__", None) is inner
    )


def own_forward(module: nn.Module, path: str = "") -> Replacement | None:
    """See the module docstring."""
    cls, name = type(module), type(module).__name__
    local = isinstance(module, nn.Linear) or name.endswith(_PER_TOKEN)
    forward = module.__dict__.get("forward")
    if (
        "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__
    ):  # accelerate's hook: look inside
        forward = module.__dict__["_old_forward"]
    func = getattr(forward, "__func__", forward)
    if getattr(func, "__module__", "").startswith(
        "hf_upipe."
    ):  # an adapter: what it wraps, if anything
        forward = module.__dict__.get("_upipe_wrapped_forward")
        func = getattr(forward, "__func__", forward)
    if forward is not None and not (
        getattr(forward, "__self__", None) is module
        and (func is getattr(cls, "forward", None) or _trl_fused_head(func, cls))
    ):  # a bound copy of the class's own forward (a Hub kernel's fallback) is the class's forward
        return Replacement(path, name, _name(forward), "instance", local)
    if not cls.__module__.startswith(_KNOWN) and not cls.__module__.startswith(
        "transformers_modules."
    ):
        return Replacement(
            path, name, f"{cls.__module__}.{cls.__qualname__}", "foreign class", local
        )
    found = _class_forward(cls)
    if found is not None and not _defined_by(found[1], found[0]):
        return Replacement(path, name, _name(found[1]), "class", local)
    return None


def _replaced_functions(model: nn.Module) -> list[Replacement]:
    """The modeling modules of `model`'s classes whose `apply_rotary_pos_emb` is not transformers' own."""
    found = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        if not module_name.startswith("transformers.models."):
            continue
        fn = getattr(sys.modules.get(module_name), _ROPE, None)
        if fn is not None and not getattr(fn, "__module__", "").startswith("transformers."):
            found.append(
                Replacement(module_name, f"{module_name}.{_ROPE}", _name(fn), "function", True)
            )
    return found


def replaced_forwards(model: nn.Module) -> list[Replacement]:
    """See the module docstring (a PEFT model is seen through its transformers model)."""
    return _replaced_forwards(base_model(model))


def _replaced_forwards(base: nn.Module) -> list[Replacement]:
    """`replaced_forwards` of a model whose PEFT wrapper is off already (`base_model`)."""
    found = [r for path, m in base.named_modules() if (r := own_forward(m, path)) is not None]
    return found + _replaced_functions(base)


_LOCAL: dict[tuple, str | None] = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _split_equal(whole, parts, dtype, what: str) -> str | None:
    for i, (w, p) in enumerate(zip(whole, parts)):
        err = _rel(p, w)
        if not err <= _tolerance(dtype):
            return f"{what} {i} of the split sequence differs from the whole sequence's (rel {err:.1e})"
    return None


def _module_local(module: nn.Module, forward) -> str | None:
    weight = next(module.parameters(), None)
    device = weight.device if weight is not None else torch.device("cpu")
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    width = (
        getattr(module, "hidden_size", None)
        or getattr(module, "in_features", None)
        or (weight.shape[-1] if weight is not None else 8)
    )
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, int(width), generator=gen).to(device, dtype)  # [B, s, Dm]
    with torch.enable_grad():
        t = x.clone().requires_grad_()
        y = forward(t)  # [B, 7, Dout]
        g = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
        (dx,) = torch.autograd.grad(y, t, g.clone())
        parts = []
        for a, b in ((0, 3), (3, 7)):
            t = x[:, a:b].clone().requires_grad_()  # [B, b - a, Dm]
            part = forward(t)
            parts += [part.detach(), torch.autograd.grad(part, t, g[:, a:b].clone())[0]]
    return _split_equal(
        (y[:, :3], dx[:, :3], y[:, 3:], dx[:, 3:]), parts, dtype, "output/gradient part"
    )


def _rope_local(fn, device: torch.device, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(12)
    q, k = (
        torch.randn(1, 2, 6, 8, generator=gen).to(device, dtype) for _ in range(2)
    )  # [B, H, s, D]
    angle = torch.rand(1, 6, 4, generator=gen) * 6.0
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(device, dtype) for f in (torch.cos, torch.sin))
    whole = fn(q.clone(), k.clone(), cos, sin)  # [B, 6, D] angles; q/k rotated
    parts = [
        fn(q[:, :, a:b].clone(), k[:, :, a:b].clone(), cos[:, a:b], sin[:, a:b])
        for a, b in ((0, 2), (2, 6))
    ]
    return _split_equal(
        (whole[0][:, :, :2], whole[0][:, :, 2:], whole[1][:, :, :2], whole[1][:, :, 2:]),
        (parts[0][0], parts[1][0], parts[0][1], parts[1][1]),
        dtype,
        "rotated q/k part",
    )


def sequence_local(
    module: nn.Module | None, forward=None, *, rope_of: nn.Module | None = None
) -> str | None:
    """See the module docstring. `forward`: the callable to check (default the module's forward); `rope_of`: check
    `forward` as a RoPE function (q, k, cos, sin) on this model's device and dtype instead."""
    forward = forward if forward is not None else module.forward
    holder = rope_of if rope_of is not None else module
    weight = next(holder.parameters(), None)
    where = (weight.device.type, weight.dtype) if weight is not None else None
    key = (type(module), getattr(forward, "__func__", forward), rope_of is None, where)
    if key in _LOCAL:
        return _LOCAL[key]
    try:
        with torch.random.fork_rng(devices=[]):
            if rope_of is not None:
                weight = next(rope_of.parameters())
                detail = _rope_local(forward, weight.device, weight.dtype)
            else:
                detail = _module_local(module, forward)
    except Exception as err:  # noqa: BLE001 - a forward that cannot run here is not verified
        text = str(err).splitlines()[0] if str(err) else ""
        detail = f"it raised {type(err).__name__} when checked ({text[:200]})"
    _LOCAL[key] = detail
    return detail


def _verdict(base: nn.Module, found: Replacement, modules: dict) -> str | None:
    if not found.per_token:
        return "hf_upipe cannot see what it computes on a sequence shard"
    if found.kind == "function":
        fn = getattr(sys.modules[found.path], _ROPE)
        detail = sequence_local(None, fn, rope_of=base)
    else:
        module = modules[found.path]
        forward = module.__dict__.get("_upipe_wrapped_forward") or module.forward
        detail = sequence_local(module, forward)
    return None if detail is None else f"it is not verified to be per-token: {detail}"


def replacement_refusal(model: nn.Module) -> str | None:
    """See the module docstring."""
    return base_refusal(base_model(model))


def base_refusal(base: nn.Module) -> str | None:
    """`replacement_refusal` of a model whose PEFT wrapper is off already (`base_model`): what the support gate
    (`hf_upipe.adapters.support.model_refusal`) asks, with the model it unwrapped."""
    modules = dict(base.named_modules())
    for found in _replaced_forwards(base):
        why = _verdict(base, found, modules)
        if why is not None:
            return f"{found.describe()}, and {why}{_FIX.get(found.per_token, '')}"
    return None


_FIX = {
    False: ". Apply such kernels without this replacement (Liger: fused_linear_cross_entropy=False, which "
    "UPipeTrainer does for use_liger_kernel=True: hf_upipe's tiled loss computes the loss), or restore the "
    "module's forward",
    True: ". Run it where its kernel runs (Liger's and Hub kernels' need a GPU), or load the model without it",
}
