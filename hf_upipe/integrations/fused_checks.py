"""Whether the fused UPipe attention block computes what an architecture's attention computes.

Entry points:
- `fused_verdict(arch)`: verified by the fingerprint of a verified release, else by `fused_check(arch)`
  (`hf_upipe.verification`).
- `fused_check(arch)`: the block against the module's own forward and backward on a tiny model, plain and with LoRA.
- `fused_unavailable(config)`: why `hf_upipe.integrations.fused.install_fused_attention` would not install the block
  on a model of this config (no adapter for its architecture, or the block is not verified on the installed
  transformers), or None.
"""

from __future__ import annotations

import types

import torch

from hf_upipe.architectures import ARCHITECTURES, model_geometry, source_fingerprint
from hf_upipe.distributed import without_sequence_parallel
from hf_upipe.integrations.fused_call import fused_forward
from hf_upipe.integrations.fused_weights import unfused_reason
from hf_upipe.integrations.probe import case_config, compare, model_pair, with_lora
from hf_upipe.integrations.sp_checks import local_sequence_parallel
from hf_upipe.verification import (
    TESTED_RANGE,
    VERIFIED_RELEASES,
    Verdict,
    installed_version,
    verify,
)

__all__ = ["fused_check", "fused_unavailable", "fused_verdict"]


def fused_verdict(arch) -> Verdict:
    """Whether the fused block computes what `arch`'s attention computes on the installed transformers: by the
    fingerprint of a verified release, else by `fused_check` (`hf_upipe.verification`)."""
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
