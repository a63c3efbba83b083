"""The tensors of one attention block, as plain torch, for `hf_upipe.ops.fused_attention`.

Entry points:
- `AttentionWeights`: q/k/v/o `Projection`s, optional q/k norms (`HeadNorm` per head, or `ProjectionNorm` over a
  whole projection, as OLMo 2 has), and the `RopeStyle`.
- `Projection`, `LoraAdapter`: a linear layer and its active LoRA adapters. A fused qkv projection (Phi-3) is
  three `Projection`s over row slices of one weight, whose adapters share one A; `AttentionWeights.tensors()`
  lists a shared tensor once, and `AttentionWeights.lora_inputs` gives each distinct A one dropout stream.

The integration layer (`hf_upipe.attention.fused`) builds these from transformers/PEFT modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "AttentionWeights",
    "HeadNorm",
    "LoraAdapter",
    "Projection",
    "ProjectionNorm",
    "RopeStyle",
]


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter: delta(x) = dropout(x) @ A^T @ B^T * scaling. A [r, in], B [out, r]."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    dropout: float = 0.0


@dataclass(frozen=True)
class Projection:
    """A linear layer with optional bias [out] and LoRA adapters. weight [out, in]."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    adapters: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True)
class HeadNorm:
    """A per-head norm over the last dim D (Qwen3's, Gemma 3's q_norm/k_norm): fn([..., D]) -> [..., D],
    reading `params`."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    params: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class ProjectionNorm:
    """An RMSNorm over a whole projection's output (OLMo 2's q_norm/k_norm over all H*D or Hk*D features):
    y = (weight * (u * rsqrt(mean(u^2) + eps))).to(dtype), u = pre.float(). weight [H*D] (or [Hk*D])."""

    weight: torch.Tensor
    eps: float

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


@dataclass(frozen=True)
class RopeStyle:
    """How the model rotates: `interleaved` pairs (2i, 2i+1) (Cohere) instead of halves (Llama); `fp32` computes
    in float32 and casts back (Cohere); `rotate=False`: no RoPE in this layer (SmolLM3's NoPE layers). cos/sin
    narrower than the head dim rotate only the first dims (partial rotary, Phi-3)."""

    interleaved: bool = False
    fp32: bool = False
    rotate: bool = True


@dataclass(frozen=True)
class AttentionWeights:
    """The attention block's tensors: q/k/v rows are heads in model order (head h = rows [h*D, (h+1)*D))."""

    q: Projection
    k: Projection
    v: Projection
    o: Projection
    q_norm: HeadNorm | ProjectionNorm | None = None
    k_norm: HeadNorm | ProjectionNorm | None = None
    rope: RopeStyle = RopeStyle()

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor of the block, in a fixed order (the autograd Function's inputs)."""
        out, seen = [], set()
        for p in (self.q, self.k, self.v, self.o):
            for t in [p.weight, p.bias] + [t for a in p.adapters for t in (a.A, a.B)]:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        for n in (self.q_norm, self.k_norm):
            for t in () if n is None else n.params:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def lora_streams(self) -> dict[str, list[int]]:
        """Dropout stream of each q/k/v adapter ({"q"|"k"|"v": [index per adapter]}): the index of its distinct A (a
        fused qkv projection's three slices share their A, and so one dropout mask, as PEFT applies them)."""
        index: dict[int, int] = {}
        return {
            name: [index.setdefault(id(a.A), len(index)) for a in getattr(self, name).adapters]
            for name in "qkv"
        }

    def lora_inputs(self, x: torch.Tensor, dropout) -> dict[str, list[torch.Tensor]]:
        """xa = dropout.inputs(x, p, stream) @ A^T [B, s, r] for each q/k/v adapter ({"q"|"k"|"v": [xa per
        adapter]}), computed once per distinct A; `dropout`: a `hf_upipe.ops.lora_dropout.LoraDropout`."""
        cache: dict[int, torch.Tensor] = {}
        streams = self.lora_streams()
        out = {}
        for name in "qkv":
            out[name] = []
            for a, k in zip(getattr(self, name).adapters, streams[name]):
                if id(a.A) not in cache:
                    cache[id(a.A)] = dropout.inputs(x, a.dropout, k) @ a.A.t()
                out[name].append(cache[id(a.A)])
        return out
