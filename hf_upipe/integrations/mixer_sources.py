"""The mixer classes hf_upipe runs across shards, the sources they were verified on, and their behaviour check.

Entry points:
- `MIXERS`: mixer class name -> the fingerprints of its forward in the verified releases: the mixers that carry a
  state across the sequence (gated DeltaNet, Kimi delta attention, Mamba2), which continue from a shard's cache.
- `HALO_MIXERS`: the same for short convolutions, which reach only k-1 tokens back.
- `MIXER_MODEL_TYPES`: mixer class name -> a model type holding one.
- `mixer_verdict(cls)`: verified by the fingerprint of a verified release, else by `mixer_check(cls)`
  (`hf_upipe.verification`).
- `mixer_check(cls)`: what `hf_upipe.integrations.mixers` relies on, on a tiny model's mixer, in fp32: a state
  mixer run on two halves, the second continuing from the first's `ShardCache` (its convolution tail and final
  state), equals the mixer on the whole sequence, outputs and every gradient (of the input and the parameters,
  through the state handed over); a short convolution run on [halo; second half] gives the whole sequence's
  second half.
"""

from __future__ import annotations

import torch

from hf_upipe.distributed import without_sequence_parallel
from hf_upipe.integrations.shard_exchange import ShardCache
from hf_upipe.verification import Verdict, fingerprint, verify

__all__ = ["HALO_MIXERS", "MIXERS", "MIXER_MODEL_TYPES", "mixer_check", "mixer_verdict"]

# mixer class -> fingerprints of its forward in the verified releases (`hf_upipe.verification.VERIFIED_RELEASES`);
# it reads the cache the way `ShardCache` serves it
_MAMBA2 = (
    "691f3ca98636d473",
    "c215be341ddf22ff",
)  # the Mamba2 mixers of Bamba, Nemotron-H, Granite 4, ...
_DELTA = (
    "8f31ae7d35daf534",
    "08cf65a63ca582a2",
)  # Qwen3.5's gated DeltaNet (and the types that copy it)
MIXERS = {
    "Qwen3NextGatedDeltaNet": ("177c5d3df989a7b4", "d97f22719fb58479"),
    "Qwen3_5GatedDeltaNet": _DELTA,
    "Qwen3_5MoeGatedDeltaNet": _DELTA,
    "Qwen4ExpTextGatedDeltaNet": _DELTA,
    "OlmoHybridGatedDeltaNet": ("167004f14399b33e", "bc540b7a213f93d0"),
    "BailingHybridDeltaAttention": ("cd86b9f6aaf59e3c", "aa638068a776c7df"),
    "BambaMixer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "Mamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "FalconH1Mixer": ("8274bd4cb6961bb4", "d0ddba7970a9ddd1"),
}
# short convolutions: class -> fingerprints of its forward; they reach k-1 tokens back and carry nothing further
_SHORT_CONV = ("dd9e0a8c046f3cb6", "1d07ca85b588af88")
HALO_MIXERS = {"Lfm2ShortConv": _SHORT_CONV, "Lfm2MoeShortConv": _SHORT_CONV}
# mixer class -> a model type holding one, which its behaviour check builds tiny (`mixer_check`)
MIXER_MODEL_TYPES = {
    "Qwen3NextGatedDeltaNet": "qwen3_next",
    "Qwen3_5GatedDeltaNet": "qwen3_5_text",
    "Qwen3_5MoeGatedDeltaNet": "qwen3_5_moe_text",
    "Qwen4ExpTextGatedDeltaNet": "qwen4_exp_text",
    "OlmoHybridGatedDeltaNet": "olmo_hybrid",
    "BailingHybridDeltaAttention": "bailing_hybrid",
    "BambaMixer": "bamba",
    "NemotronHMamba2Mixer": "nemotron_h",
    "GraniteMoeHybridMambaLayer": "granitemoehybrid",
    "Mamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "zamba2",
    "FalconH1Mixer": "falcon_h1",
    "Lfm2ShortConv": "lfm2",
    "Lfm2MoeShortConv": "lfm2_moe",
}


def mixer_verdict(cls) -> Verdict:
    """Whether a mixer class of `MIXERS` / `HALO_MIXERS` continues from a shard's cache (or halo) as the adapter
    relies on, on the installed transformers: by the fingerprint of its forward in a verified release, else by
    `mixer_check` (`hf_upipe.verification`)."""
    name = cls.__name__
    known = MIXERS.get(name, HALO_MIXERS.get(name, ()))
    try:
        source = fingerprint(cls.forward)
    except (OSError, TypeError):
        source = None
    return verify("mixer", name, source, known, lambda: mixer_check(cls))


def _module_of(cls):
    """A tiny model's first mixer of class `cls` (fp32, random weights), or None."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.models import tiny_config

    model_type = MIXER_MODEL_TYPES.get(cls.__name__)
    if model_type is None:
        return None
    config = tiny_config(model_type)
    for key, value in _CONFIG_FIXES.get(model_type, {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return next((m for m in model.modules() if type(m) is cls), None)


# what a type's tiny config needs beyond `hf_upipe.models.tiny_config` to build
_CONFIG_FIXES = {t: dict(layer_types=["conv", "full_attention"]) for t in ("lfm2", "lfm2_moe")}


def _halves(module, x: torch.Tensor, s: int) -> torch.Tensor:
    """The mixer on x [B, S, Dm] as two shards of s and S - s tokens, the way the adapter runs it."""
    forward = type(module).forward
    if type(module).__name__ in HALO_MIXERS:
        reach = getattr(module, "conv_kernel_size", 1) - 1
        first = forward(module, x[:, :s], None, None)
        second = forward(module, x[:, s - reach :], None, None)[:, reach:]
        return torch.cat([first, second], dim=1)
    first_cache = ShardCache(None, None)
    first = forward(module, x[:, :s], first_cache, None)
    second = forward(module, x[:, s:], ShardCache(first_cache.tail, first_cache.final), None)
    return torch.cat([first, second], dim=1)


def mixer_check(cls) -> str | None:
    """See the module docstring: None when equal (relative to the largest value: outputs 1e-5, gradients 1e-4),
    else what differed."""
    with without_sequence_parallel():  # the tiny model runs whole, whatever SP state the caller has
        return _mixer_check(cls)


def _mixer_check(cls) -> str | None:
    module = _module_of(cls)
    if module is None:
        return f"no tiny model with a {cls.__name__} to check it on"
    gen = torch.Generator().manual_seed(1)
    width = getattr(module, "hidden_size", None) or module.config.hidden_size
    x = torch.randn(2, 12, width, generator=gen)  # [B, S, Dm]; shards of 5 and 7 tokens
    results = []
    for run in (
        lambda x: type(module).forward(module, x, None, None),
        lambda x: _halves(module, x, 5),
    ):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = run(xi)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
        (out.double() * weight).sum().backward()
        grads = {
            "input": xi.grad,
            **{n: p.grad for n, p in module.named_parameters() if p.grad is not None},
        }
        results.append((out.detach(), grads))
    (want, want_grads), (got, got_grads) = results
    if (
        _rel(got, want) > 1e-5
    ):  # relative to the largest value: the chunked kernels' rounding is ~1e-7
        return f"its output on two shards differs from the whole sequence's by {_rel(got, want):.2e} (relative)"
    for name, grad in want_grads.items():
        error = _rel(got_grads[name], grad) if name in got_grads else float("inf")
        if error > 1e-4:
            return f"the gradient of its {name} on two shards differs by {error:.2e} (relative)"
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
