"""Attention-logit soft-capping (Gemma 2, VaultGemma) in the head-parallel layout: cap * tanh(q.k * scale / cap).

Entry point:
- `SoftcapKernel(inner, softcap, window=None, block_elements=BLOCK_ELEMENTS)`: an `AttentionKernel` (forward ->
  (out, lse), backward from (out, lse)) for `hf_upipe.ops.upipe_attention`, causal, optionally limited to a
  sliding window (key t is seen by query i when 0 <= i - t < window). After the all-to-all each rank holds its
  heads over the whole sequence, so the cap is a property of the kernel only, like the window.

Implemented on CPU (`inner` is the "sdpa" kernel, whose fused flash kernel has no soft-cap) as blocked math in
float32: queries go in blocks of b tokens, chosen so one block's scores [B, hk, g, b, keys] hold at most
`BLOCK_ELEMENTS` values (64 MiB in fp32), against the keys the block's queries reach; no [S, S] tensor is formed.
Forward keeps only out and the log-sum-exp; backward recomputes each block's scores from (q, k, lse):
dS = P * (dO.V - rowsum(dO * O)), then through the cap d raw = dS * (1 - tanh^2), dq = d raw . K * scale,
dk += d raw^T . Q * scale, dv += P^T . dO. Other kernels (CUDA sdpa, flash-attn: its softcap argument is not wired
here) raise NotImplementedError naming themselves. Packed rows: `hf_upipe.ops.documents.DocumentKernel` wraps it.
"""

from __future__ import annotations

import torch

from hf_upipe.ops.kernels import SdpaCpuKernel

__all__ = ["BLOCK_ELEMENTS", "SoftcapKernel"]

BLOCK_ELEMENTS = 2**24  # score values of one query block (fp32: 64 MiB)


class SoftcapKernel:
    """Causal attention with soft-capped scores (module docstring)."""

    def __init__(
        self, inner, softcap: float, window: int | None = None, block_elements: int = BLOCK_ELEMENTS
    ):
        if not isinstance(inner, SdpaCpuKernel):
            raise NotImplementedError(
                f"attention-logit soft-capping (softcap={softcap}) under sequence parallelism is implemented for "
                f"the CPU 'sdpa' kernel only, not for the {getattr(inner, 'name', type(inner).__name__)!r} kernel."
            )
        if not softcap > 0:
            raise ValueError(f"softcap={softcap!r}: need a positive number")
        self.inner, self.softcap, self.window, self.block_elements = (
            inner,
            float(softcap),
            window,
            block_elements,
        )
        self.name = f"softcap{softcap:g}" + (f"+window{window}" if window else "")

    def _blocks(self, B: int, S: int, heads: int):
        """(i0, i1, k0): queries [i0, i1) and the keys [k0, i1) they reach."""
        b = max(1, min(S, self.block_elements // max(1, B * heads * S)))
        for i0 in range(0, S, b):
            i1 = min(S, i0 + b)
            yield i0, i1, 0 if self.window is None else max(0, i0 - self.window + 1)

    def _probs(self, qb, kb, i0, i1, k0, scale, lse=None):
        """qb [B, b, h, D], kb [B, n, hk, D] (fp32) -> (tanh t, probs or logits) [B, hk, g, b, n]; with `lse`
        [B, h, b] the probabilities, else the masked logits."""
        B, b, h, D = qb.shape
        hk = kb.shape[2]
        q5 = qb.view(B, b, hk, h // hk, D).permute(0, 2, 3, 1, 4)  # [B, hk, g, b, D]
        raw = q5 @ kb.permute(0, 2, 3, 1).unsqueeze(2) * scale  # [B, hk, g, b, n]
        t = torch.tanh(raw / self.softcap)
        i = torch.arange(i0, i1, device=qb.device)[:, None]
        j = torch.arange(k0, i1, device=qb.device)[None, :]
        seen = (j <= i) if self.window is None else (j <= i) & (j > i - self.window)  # [b, n]
        logits = (t * self.softcap).masked_fill(~seen, float("-inf"))
        if lse is None:
            return t, logits
        return t, (logits - lse.view(B, hk, h // hk, b, 1)).exp()

    def forward(self, q, k, v, *, scale, causal=True):
        """q [B, S, h, D], k/v [B, S, hk, D] -> out [B, S, h, D], lse [B, h, S] (fp32)."""
        if not causal:
            raise NotImplementedError("SoftcapKernel is causal only")
        B, S, h, D = q.shape
        out = q.new_empty(B, S, h, v.shape[-1])
        lse = torch.empty(B, h, S, dtype=torch.float32, device=q.device)
        for i0, i1, k0 in self._blocks(B, S, h):
            _, logits = self._probs(q[:, i0:i1].float(), k[:, k0:i1].float(), i0, i1, k0, scale)
            m = torch.logsumexp(logits, dim=-1)  # [B, hk, g, b]
            p = (logits - m.unsqueeze(-1)).exp()
            o = p @ v[:, k0:i1].float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, hk, g, b, Dv]
            out[:, i0:i1] = o.permute(0, 3, 1, 2, 4).reshape(B, i1 - i0, h, -1).to(out.dtype)
            lse[:, :, i0:i1] = m.reshape(B, h, i1 - i0)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        """Gradients dq [B, S, h, D], dk/dv [B, S, hk, D] (module docstring)."""
        if not causal:
            raise NotImplementedError("SoftcapKernel is causal only")
        B, S, h, D = q.shape
        hk, g = k.shape[2], h // k.shape[2]
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i0, i1, k0 in self._blocks(B, S, h):
            b = i1 - i0
            qb, kb, vb = q[:, i0:i1].float(), k[:, k0:i1].float(), v[:, k0:i1].float()
            t, p = self._probs(
                qb, kb, i0, i1, k0, scale, lse[:, :, i0:i1].float()
            )  # [B, hk, g, b, n]
            do5 = (
                dout[:, i0:i1].float().view(B, b, hk, g, -1).permute(0, 2, 3, 1, 4)
            )  # [B, hk, g, b, Dv]
            o5 = out[:, i0:i1].float().view(B, b, hk, g, -1).permute(0, 2, 3, 1, 4)
            v4 = vb.permute(0, 2, 1, 3).unsqueeze(2)  # [B, hk, 1, n, Dv]
            dp = do5 @ v4.transpose(-1, -2)  # [B, hk, g, b, n]
            ds = p * (dp - (do5 * o5).sum(-1, keepdim=True))
            draw = ds * (1 - t * t) * scale  # through cap * tanh(raw / cap), then the scale
            k4 = kb.permute(0, 2, 1, 3).unsqueeze(2)  # [B, hk, 1, n, D]
            dq[:, i0:i1] = (draw @ k4).permute(0, 3, 1, 2, 4).reshape(B, b, h, D).to(dq.dtype)
            q5 = qb.view(B, b, hk, g, D).permute(0, 2, 3, 1, 4)  # [B, hk, g, b, D]
            dk[:, k0:i1] += (
                (draw.transpose(-1, -2) @ q5).sum(2).permute(0, 2, 1, 3)
            )  # [B, n, hk, D]
            dv[:, k0:i1] += (p.transpose(-1, -2) @ do5).sum(2).permute(0, 2, 1, 3)
        return dq, dk.to(k.dtype), dv.to(v.dtype)
