"""The planner's two searches: the longest length that fits, and the fastest settings that fit a length.

Entry points:
- `search_max(required, limit, step, max_steps)`: the largest multiple of `step` whose required bytes stay within
  `limit` (secant guesses on the near-linear required(length), inside a bracket: a handful of evaluations).
- `longest_fit(need, rung, *, limit, step, max_seq_len)`: the longest length `rung` fits on the GPU and in the host
  memory (`--max`), 0 if none; `last_rung(pairs)`: the rung it is asked of.
- `fastest_fit(need, pairs, seconds, *, limit, seq_len)`: the fastest candidate that fits `seq_len`, and what was
  judged on the way. Candidates are judged fastest first, so the first that fits is the fastest that fits; a
  variant whose rung does not fit is not simulated (it needs at least the rung's memory).

`need` is a `hf_upipe.planning.requirement.Requirement`; `hf_upipe.planning.planner.plan` runs both searches.
"""

from __future__ import annotations

from hf_upipe.planning.plan_result import host_bytes
from hf_upipe.planning.requirement import Requirement
from hf_upipe.planning.train_step import StepSettings

__all__ = ["fastest_fit", "last_rung", "longest_fit", "search_max"]


def search_max(required, limit: int, step: int, max_steps: int) -> int:
    """Largest k * step (1 <= k <= max_steps) with required(k * step) <= limit, or 0; required grows with length.

    Secant guesses on the near-linear required(length), kept inside the bracket [fits, does not fit]: a handful
    of evaluations.
    """
    points: dict[int, int] = {}
    lo, hi = (
        0,
        max_steps + 1,
    )  # lo fits (0: nothing yet), hi does not (max_steps + 1: beyond the search)
    k, order = min(max_steps, 8), []
    while hi - lo > 1:
        points[k] = required(k * step)
        order.append(k)
        lo, hi = (k, hi) if points[k] <= limit else (lo, k)
        if hi - lo <= 1:
            break
        if len(order) == 1:
            k = 2 * k if lo == k else k // 2
        else:
            a, b = order[-2:]
            k = (
                int(b + (limit - points[b]) * (b - a) / (points[b] - points[a]))
                if points[b] != points[a]
                else (lo + hi) // 2
            )
        if k in points:
            k = lo + 1 if k == lo else hi - 1 if k == hi else (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
    return lo * step


def last_rung(pairs: list) -> StepSettings:
    """The last rung of (candidate, rung) pairs: the most memory-saving settings."""
    return [rung for cand, rung in pairs if cand == rung][-1]


def _fallback(need: Requirement, pairs: list, seq_len: int) -> StepSettings:
    """What a plan reports when nothing fits: the last rung without disk offload, unless its checkpoints do not fit
    the host memory (then the last rung)."""
    kept = [p for p in pairs if p[0].offload != "disk"]
    rung = last_rung(kept) if kept else last_rung(pairs)
    return rung if need.host_ok(rung, seq_len) else last_rung(pairs)


def longest_fit(
    need: Requirement, rung: StepSettings, *, limit: int, step: int, max_seq_len: int
) -> int:
    """The longest multiple of `step` (up to `max_seq_len`) at which `rung` needs at most `limit` bytes of GPU memory
    and its offloaded checkpoints (and model state, model_offload='cpu') fit the host memory; 0 if not even `step`
    fits."""
    steps = max_seq_len // step
    per_step = (
        host_bytes(need.config, rung, step, need.sp_size, need.dtype) * need.gpus
    )  # host memory is linear in the length
    fixed = (
        need.estimate.host(rung, step) * need.gpus
    )  # the model's state: the same at every length
    if need.host is not None and (per_step or fixed):
        steps = min(steps, max(0, need.host - fixed) // per_step if per_step else steps)
        steps = 0 if fixed > need.host else steps
    return search_max(lambda length: need(rung, length), limit, step, steps)


def fastest_fit(
    need: Requirement, pairs: list, seconds, *, limit: int, seq_len: int
) -> tuple[StepSettings, list]:
    """(chosen settings, tried) at `seq_len`: `pairs` are (candidate, its rung); `seconds(settings, seq_len)`, a
    candidate's predicted step seconds.

    The first that fits, fastest first (the ladder's order among equal times), is chosen, candidates with
    offload="disk" judged only after all others (they are chosen only where the host memory binds); if none fits,
    the last rung (the last without disk where that one's checkpoints fit the host). `tried`: (settings, required
    bytes or None when not simulated, host ok, seconds) of each judged; a candidate whose host memory does not fit
    is not simulated.
    """
    times = [seconds(cand, seq_len) for cand, _ in pairs]
    tried, chosen, fits_of = [], _fallback(need, pairs, seq_len), {}
    disk = [cand.offload == "disk" for cand, _ in pairs]
    for k in sorted(range(len(pairs)), key=lambda k: (disk[k], times[k], k)):
        (cand, rung), t = pairs[k], times[k]
        if not need.host_ok(cand, seq_len):
            fits_of[cand] = False
            tried.append((cand, None, False, t))  # its offloaded bytes do not fit the host
            continue
        if rung != cand:
            if rung not in fits_of:
                fits_of[rung] = need(rung, seq_len) <= limit and need.host_ok(rung, seq_len)
            if not fits_of[rung]:
                tried.append(
                    (cand, None, need.host_ok(cand, seq_len), t)
                )  # needs more than its rung, which does not fit
                continue
        required, host_fits = need(cand, seq_len), need.host_ok(cand, seq_len)
        fits_of[cand] = required <= limit and host_fits
        tried.append((cand, required, host_fits, t))
        if fits_of[cand]:
            chosen = cand
            break
    return chosen, tried
