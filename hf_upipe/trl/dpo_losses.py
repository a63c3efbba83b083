"""The DPO losses of TRL 1.16's `DPOTrainer` from per-sequence quantities, as `UPipeDPOTrainer` computes them.

Entry points:
- `PairLogps`: one micro-batch's B pairs: the policy's and the reference's sequence log-probabilities (sums over
  each completion, already added over the SP group) and the completion token counts of each sequence;
- `DPOLossSettings.from_trainer(trainer)`: the loss types, their weights and the coefficients they read;
- `dpo_loss(settings, pair)`: the weighted sum of the loss types' means over the B pairs, a scalar;
- `LOSSES`: loss type -> its loss per pair, the one table of the loss types; `DPO_LOSS_TYPES = tuple(LOSSES)`.

Every loss type TRL 1.16 offers depends on a sequence only through its summed log-probabilities and its number of
completion tokens ('sft': the chosen sequences' summed log-probabilities over their target tokens), so it is exact
under sequence parallelism once those sums are exact. Under data parallelism each group computes its micro-batch's
loss, as TRL does on each DDP rank: 'aot' and 'aot_unpaired' sort, and 'sft' averages tokens, within a micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DPO_LOSS_TYPES", "LOSSES", "DPOLossSettings", "PairLogps", "dpo_loss"]


@dataclass(frozen=True)
class PairLogps:
    """B pairs: log-probabilities [B] of the chosen / rejected completions under the policy and the reference;
    completion tokens [B] of each (`completion_mask` sums) and target tokens [B] of the chosen ones (the shifted
    mask: the tokens scored)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_targets: torch.Tensor


@dataclass(frozen=True)
class DPOLossSettings:
    loss_types: tuple
    loss_weights: tuple
    beta: float
    label_smoothing: float
    f_divergence_type: str
    f_alpha_divergence_coef: float
    discopop_tau: float

    @classmethod
    def from_trainer(cls, trainer) -> DPOLossSettings:
        """The settings `trl.DPOTrainer.__init__` derived from its `DPOConfig` (read after its checks)."""
        return cls(
            loss_types=tuple(trainer.loss_types),
            loss_weights=tuple(trainer.loss_weights),
            beta=trainer.beta,
            label_smoothing=trainer.label_smoothing,
            f_divergence_type=trainer.f_divergence_type,
            f_alpha_divergence_coef=trainer.f_alpha_divergence_coef,
            discopop_tau=trainer.args.discopop_tau,
        )


def _scores(s: DPOLossSettings, logratio: torch.Tensor) -> torch.Tensor:
    """f'(exp(logratio)) of the f-divergence (reverse KL: the log-ratio itself)."""
    if s.f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratio)
    if s.f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    if s.f_divergence_type == "alpha_divergence" and abs(s.f_alpha_divergence_coef - 1.0) >= 1e-6:
        a = s.f_alpha_divergence_coef - 1.0
        clamp = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}[logratio.dtype]
        t = torch.clamp((a * logratio).float(), max=clamp)
        return (torch.exp(t) - 1.0).to(logratio.dtype) / a
    if s.f_divergence_type in ("reverse_kl", "alpha_divergence"):
        return logratio
    raise ValueError(f"Unknown f_divergence_type: {s.f_divergence_type}")


def _smoothed(s: DPOLossSettings, delta: torch.Tensor) -> torch.Tensor:
    return (
        -F.logsigmoid(s.beta * delta) * (1 - s.label_smoothing)
        - F.logsigmoid(-s.beta * delta) * s.label_smoothing
    )


def _exo(s: DPOLossSettings, z: torch.Tensor) -> torch.Tensor:
    eps = torch.tensor(s.label_smoothing, device=z.device)
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - torch.log(eps)
    )


def _discopop(s: DPOLossSettings, z: torch.Tensor) -> torch.Tensor:
    mix = torch.sigmoid(z / s.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


@dataclass(frozen=True)
class _Terms:
    """What the loss types read of B pairs besides the settings: the log-ratios of the chosen and rejected
    completions `cr`, `rr` [B], the f-divergence margin `z` = beta (f'(cr) - f'(rr)) [B], beta `b`, and the
    length-normalised margin `normed` [B]."""

    cr: torch.Tensor
    rr: torch.Tensor
    z: torch.Tensor
    b: float
    normed: torch.Tensor


def _terms(s: DPOLossSettings, p: PairLogps) -> _Terms:
    cr, rr = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected  # log-ratios [B]
    cs, rs = _scores(s, cr), _scores(s, rr)
    normed = cs / p.chosen_tokens.clamp(min=1.0) - rs / p.rejected_tokens.clamp(min=1.0)
    return _Terms(cr=cr, rr=rr, z=s.beta * (cs - rs), b=s.beta, normed=normed)


# loss type -> its loss per pair [B] from (settings, pairs, terms): TRL 1.16's formulas on per-sequence quantities.
# The one list of the loss types: DPO_LOSS_TYPES and the DPOConfig check read it.
LOSSES = {
    "sigmoid": lambda s, p, t: -F.logsigmoid(t.z),
    "hinge": lambda s, p, t: torch.relu(1 - t.z),
    "ipo": lambda s, p, t: (t.normed - 1 / (2 * t.b)) ** 2,
    "exo_pair": lambda s, p, t: _exo(s, t.z),
    "nca_pair": lambda s, p, t: (
        -F.logsigmoid(t.b * t.cr)
        - 0.5 * F.logsigmoid(-t.b * t.cr)
        - 0.5 * F.logsigmoid(-t.b * t.rr)
    ),
    "robust": lambda s, p, t: (
        (-(1 - s.label_smoothing) * F.logsigmoid(t.z) + s.label_smoothing * F.logsigmoid(-t.z))
        / (1 - 2 * s.label_smoothing)
    ),
    "bco_pair": lambda s, p, t: -F.logsigmoid(t.b * t.cr) - F.logsigmoid(-t.b * t.rr),
    "sppo_hard": lambda s, p, t: (t.cr - 0.5 / t.b) ** 2 + (t.rr + 0.5 / t.b) ** 2,
    "aot": lambda s, p, t: _smoothed(
        s,
        torch.sort(p.chosen - p.rejected, dim=0)[0]
        - torch.sort(p.ref_chosen - p.ref_rejected, dim=0)[0],
    ),
    "aot_unpaired": lambda s, p, t: _smoothed(
        s, torch.sort(t.cr, dim=0)[0] - torch.sort(t.rr, dim=0)[0]
    ),
    "apo_zero": lambda s, p, t: 1 - torch.sigmoid(t.b * t.cr) + torch.sigmoid(t.b * t.rr),
    "apo_down": lambda s, p, t: torch.sigmoid(t.b * t.cr) + 1 - torch.sigmoid(t.b * (t.cr - t.rr)),
    "discopop": lambda s, p, t: _discopop(s, t.z),
    "sft": lambda s, p, t: (-p.chosen.sum() / p.chosen_targets.sum()).expand(p.chosen.shape[0]),
    "sigmoid_norm": lambda s, p, t: -F.logsigmoid(t.b * t.normed),
}
DPO_LOSS_TYPES = tuple(LOSSES)


def _per_pair(s: DPOLossSettings, p: PairLogps, loss_type: str) -> torch.Tensor:
    """One loss type's loss per pair [B] (`LOSSES`)."""
    terms = _terms(s, p)
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss type: {loss_type}; TRL 1.16's are {sorted(LOSSES)}.")
    return LOSSES[loss_type](s, p, terms)


def dpo_loss(s: DPOLossSettings, p: PairLogps) -> torch.Tensor:
    """Sum over the loss types of weight x the mean over the B pairs of the type's loss (a scalar)."""
    loss = 0.0
    for loss_type, weight in zip(s.loss_types, s.loss_weights, strict=True):
        loss = loss + _per_pair(s, p, loss_type).mean() * weight
    return loss
