"""The DPO losses of TRL 1.16's `DPOTrainer` from per-sequence quantities, as `UPipeDPOTrainer` computes them.

Entry points:
- `PairLogps`: one micro-batch's B pairs: the policy's and the reference's sequence log-probabilities (sums over
  each completion, already added over the SP group) and the completion token counts of each sequence;
- `DPOLossSettings.from_trainer(trainer)`: the loss types, their weights and the coefficients they read;
- `dpo_loss(settings, pair)`: the weighted sum of the loss types' means over the B pairs, a scalar.

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

__all__ = ["DPO_LOSS_TYPES", "DPOLossSettings", "PairLogps", "dpo_loss"]


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


def _per_pair(s: DPOLossSettings, p: PairLogps, loss_type: str) -> torch.Tensor:
    """One loss type's loss per pair [B] (TRL's formulas, from per-sequence quantities)."""
    cr, rr = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected  # log-ratios [B]
    cs, rs = _scores(s, cr), _scores(s, rr)
    z, b = s.beta * (cs - rs), s.beta
    normed = cs / p.chosen_tokens.clamp(min=1.0) - rs / p.rejected_tokens.clamp(min=1.0)
    losses = {
        "sigmoid": lambda: -F.logsigmoid(z),
        "hinge": lambda: torch.relu(1 - z),
        "ipo": lambda: (normed - 1 / (2 * b)) ** 2,
        "exo_pair": lambda: _exo(s, z),
        "nca_pair": lambda: (
            -F.logsigmoid(b * cr) - 0.5 * F.logsigmoid(-b * cr) - 0.5 * F.logsigmoid(-b * rr)
        ),
        "robust": lambda: (
            (-(1 - s.label_smoothing) * F.logsigmoid(z) + s.label_smoothing * F.logsigmoid(-z))
            / (1 - 2 * s.label_smoothing)
        ),
        "bco_pair": lambda: -F.logsigmoid(b * cr) - F.logsigmoid(-b * rr),
        "sppo_hard": lambda: (cr - 0.5 / b) ** 2 + (rr + 0.5 / b) ** 2,
        "aot": lambda: _smoothed(
            s,
            torch.sort(p.chosen - p.rejected, dim=0)[0]
            - torch.sort(p.ref_chosen - p.ref_rejected, dim=0)[0],
        ),
        "aot_unpaired": lambda: _smoothed(s, torch.sort(cr, dim=0)[0] - torch.sort(rr, dim=0)[0]),
        "apo_zero": lambda: 1 - torch.sigmoid(b * cr) + torch.sigmoid(b * rr),
        "apo_down": lambda: torch.sigmoid(b * cr) + 1 - torch.sigmoid(b * (cr - rr)),
        "discopop": lambda: _discopop(s, z),
        "sft": lambda: (-p.chosen.sum() / p.chosen_targets.sum()).expand(p.chosen.shape[0]),
        "sigmoid_norm": lambda: -F.logsigmoid(b * normed),
    }
    if loss_type not in losses:
        raise ValueError(f"Unknown loss type: {loss_type}; TRL 1.16's are {sorted(losses)}.")
    return losses[loss_type]()


DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


def dpo_loss(s: DPOLossSettings, p: PairLogps) -> torch.Tensor:
    """Sum over the loss types of weight x the mean over the B pairs of the type's loss (a scalar)."""
    loss = 0.0
    for loss_type, weight in zip(s.loss_types, s.loss_weights, strict=True):
        loss = loss + _per_pair(s, p, loss_type).mean() * weight
    return loss
