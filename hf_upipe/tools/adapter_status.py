"""Every adapter's verdict on the installed transformers, for `hf-upipe env` and for re-verifying a release.

Entry points:
- `adapter_status(check=True)`: one row per adapter and subject: the fused attention and the tiled MLP/norms of
  each fused architecture, each mixer class the installed transformers has, and the global RoPE. Each row holds
  the installed source's fingerprint and how the adapter stands: verified by fingerprint, verified by behaviour on
  this version, or not verified (and why). With `check=False` nothing is checked: a source not seen before is
  "not checked yet" (it is checked when `prepare_model` first needs it).
- `format_status(rows)`: the rows as the lines `hf-upipe env` prints (`hf-upipe fingerprints` adds each row's
  recorded fingerprints: `recorded`, the sources verified in the releases of `hf_upipe.models.verification`).
- `release_report(rows)`: the same rows family by family (`hf-upipe release-check`): for each model type, which of
  its adapters are on and which are off, and why; `format_report(report)` prints it.
"""

from __future__ import annotations

import importlib

from hf_upipe.adapters.mixers import (
    HALO_MIXERS,
    MIXER_MODEL_TYPES,
    MIXERS,
    mixer_verdict,
)
from hf_upipe.adapters.rope import ROPE_FINGERPRINTS, rope_update_fingerprint, rope_verdict
from hf_upipe.adapters.tiled_mlp import tiled_verdict
from hf_upipe.attention.fused import fused_verdict
from hf_upipe.models.architectures import FUSED, source_fingerprint
from hf_upipe.models.verification import fingerprint

__all__ = ["adapter_status", "format_report", "format_status", "release_report"]

# model types whose classes live in another modeling module
_MODULES = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen4_exp_text": "qwen4_exp",
}


def _mixer_class(name: str):
    model_type = MIXER_MODEL_TYPES[name]
    module = _MODULES.get(model_type, model_type)
    try:
        return getattr(
            importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name, None
        )
    except ImportError:
        return None


def _source(read) -> str | None:
    try:
        return read()
    except (ImportError, AttributeError, OSError, TypeError):
        return None


def _row(adapter: str, subject: str, source: str | None, known: tuple, verdict) -> dict:
    if verdict is not None:
        status = verdict.describe()
    elif source is None:
        status = "not checked yet (its source could not be read whole: the check decides)"
    else:
        status = (
            "verified by fingerprint"
            if source in known
            else "not checked yet (a source not seen before)"
        )
    return {
        "adapter": adapter,
        "subject": subject,
        "fingerprint": source,
        "recorded": list(known),
        "status": status,
        "ok": verdict.ok if verdict is not None else source in known,
    }


def adapter_status(check: bool = True) -> list[dict]:
    """See the module docstring."""
    rows = []
    for arch in FUSED:
        for adapter, known, verdict in (
            ("fused", arch.fused_fingerprints, fused_verdict),
            ("tiled", arch.tiled_fingerprints, tiled_verdict),
        ):
            source = source_fingerprint(arch, adapter)
            rows.append(
                _row(adapter, arch.model_type, source, known, verdict(arch) if check else None)
            )
    for name in (*MIXERS, *HALO_MIXERS):
        cls = _mixer_class(name)
        if cls is None:
            continue  # a class this release does not have
        known = MIXERS.get(name, HALO_MIXERS.get(name))
        source = _source(lambda: fingerprint(cls.forward))
        rows.append(_row("mixer", name, source, known, mixer_verdict(cls) if check else None))
    source = _source(rope_update_fingerprint)
    rows.append(
        _row(
            "rope",
            "dynamic_rope_update",
            source,
            ROPE_FINGERPRINTS,
            rope_verdict() if check else None,
        )
    )
    return rows


def format_status(rows: list[dict]) -> list[str]:
    """`  fused    llama                  a0d395fa0cfcaa0f  verified by fingerprint (...)`, one line a row."""
    return [
        f"  {r['adapter']:<6} {r['subject']:<28} {r['fingerprint'] or '-':<16}  {r['status']}"
        for r in rows
    ]


def _families(row: dict) -> list[str]:
    """The model types an adapter row serves: a fused family's own, a mixer's hybrids, every type for the RoPE."""
    if row["adapter"] == "mixer":
        return [MIXER_MODEL_TYPES[row["subject"]]]
    if row["adapter"] == "rope":
        return ["any, with dynamic/longrope RoPE"]
    return [row["subject"]]


def release_report(rows: list[dict]) -> dict:
    """{"families": {model_type: {adapter: {"on": bool, "why": status}}}, "on": n, "off": n} from
    `adapter_status` rows; an adapter that is off keeps transformers' own path (fused, tiled) or makes the family
    refused under SP (mixer, RoPE), as `hf_upipe.models.verification` says."""
    families: dict[str, dict] = {}
    for row in rows:
        label = row["adapter"] if row["adapter"] != "mixer" else f"mixer {row['subject']}"
        for family in _families(row):
            families.setdefault(family, {})[label] = {"on": bool(row["ok"]), "why": row["status"]}
    flags = [a["on"] for adapters in families.values() for a in adapters.values()]
    return {"families": families, "on": sum(flags), "off": len(flags) - sum(flags)}


def format_report(report: dict, version: str) -> list[str]:
    """One line per family: its adapters on, then each one off with its reason; a summary line first."""
    lines = [
        f"transformers {version}: {report['on']} adapters on, {report['off']} off, over "
        f"{len(report['families'])} families"
    ]
    for family, adapters in report["families"].items():
        on = [f"{name} ({_how(a['why'])})" for name, a in adapters.items() if a["on"]]
        off = [f"{name} OFF ({a['why']})" for name, a in adapters.items() if not a["on"]]
        lines.append(f"  {family:<31} on: {', '.join(on) or '-'}" + "".join(f"; {o}" for o in off))
    return lines


def _how(status: str) -> str:
    return "by fingerprint" if "fingerprint" in status else "by behaviour"
