"""What a plan that does not fit says instead of a launch line: the longest length that fits, and what would fit
the length asked.

Entry points:
- `advice(model, kwargs, result)`: lines for `Plan.advice`, from more plans of the same request (`kwargs`: the
  keyword arguments `hf_upipe.planning.planner.plan` was called with; `result`: its `Plan`, which did not fit).

What is tried: the longest length the same GPUs fit (`max_context=True`, the planner's own `--max`); then, at the
length asked, with the most memory-saving settings of the ladder (one candidate each: a rung that does not fit
rules out every faster one), twice and four times the nodes with a ring across them (`--nodes`, `--ring`), a LoRA
fine-tune of rank 16 instead of a full one, and expandable segments for the allocator. Each line names the flags;
`hf-upipe plan` with them then chooses the fastest settings that fit.
"""

from __future__ import annotations

from hf_upipe.planning.tracker import GiB
from hf_upipe.units import format_tokens

__all__ = ["advice"]

_LORA = (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def _longest(model, kwargs: dict) -> str:
    from hf_upipe.planning.planner import plan

    best = plan(model, **{**kwargs, "seq_len": None, "max_context": True})
    if not best.max_seq_len:
        return "nothing fits on these GPUs, not even the shortest step (--step)"
    return (
        f"longest that fits on these GPUs: {best.max_seq_len:,} tokens ({format_tokens(best.max_seq_len)}), "
        f"required {best.required / GiB:,.2f} GiB: hf-upipe plan ... --seq-len {format_tokens(best.max_seq_len)}"
    )


def _alternatives(kwargs: dict) -> list[tuple[str, dict]]:
    """(flags, plan keyword arguments) of what may fit the length asked."""
    nodes, ring = kwargs.get("nodes", 1), kwargs.get("ring_size", 1)
    out = []
    if kwargs.get("sp_size") is None and kwargs.get("impl") != "deepspeed":
        for k in (2, 4):
            out.append(
                (
                    f"--nodes {nodes * k} --ring {ring * k}",
                    {"nodes": nodes * k, "ring_size": ring * k},
                )
            )
    if kwargs.get("lora") is None:
        out.append((f"--lora-rank {_LORA[0]}", {"lora": _LORA}))
    if kwargs.get("allocator") in (None, "default") and kwargs.get("margin") is None:
        out.append(
            (
                "--allocator expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
                {"allocator": "expandable"},
            )
        )
    return out


def advice(model, kwargs: dict, result) -> list[str]:
    """See the module docstring. Alternatives that raise (e.g. a ring the heads or the model refuse) are skipped."""
    from hf_upipe.planning.planner import plan

    lines = [_longest(model, kwargs)]
    rung = (
        result.settings
        if kwargs.get("settings") is not None
        else _last_rung(result, kwargs.get("impl"))
    )
    fits = []
    for flags, change in _alternatives(kwargs):
        try:
            p = plan(model, **{**kwargs, "settings": rung, **change})
        except ValueError:
            continue
        if p.fits:
            fits.append(f"{flags} (required {p.required / GiB:,.2f} GiB with {_short(p.settings)})")
    what = format_tokens(result.seq_len)
    lines.append(
        f"fits {what} with: " + "; or ".join(fits)
        if fits
        else f"{what} fits none of: more nodes with a ring (--nodes, --ring), LoRA, expandable segments"
    )
    return lines


def _last_rung(result, impl):
    """The most memory-saving settings the plan judged (the ladder's last rung)."""
    from hf_upipe.planning.ladder import candidates

    pairs = candidates(result.config, result.sp_size // result.settings.ring_size, impl)
    return [r for c, r in pairs if c == r][-1]


def _short(settings) -> str:
    from hf_upipe.planning.plan_report import describe

    return describe(settings)
