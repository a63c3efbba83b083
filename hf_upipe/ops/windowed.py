"""Sliding-window causal attention in the head-parallel layout: query i sees keys i-w+1 .. i.

Entry point:
- `WindowKernel(inner, window)`: an `AttentionKernel` (forward -> (out, lse), backward from (out, lse)) whose
  attention is causal and limited to a window of `window` keys, for `hf_upipe.ops.upipe_attention` and
  `hf_upipe.ops.fused_attention`. After the all-to-all each rank holds its heads over the whole sequence, so the
  window is a property of the kernel only: positions, shards and head chunks are unchanged.

Implemented on CPU (`inner` is the "sdpa" kernel: torch's flash kernel for CPU, which takes an additive mask): the
queries go in blocks of c = min(window, S) tokens; block [i0, i0+c) needs keys [i0-w+1, i0+c), at most c+w-1 of
them, so every call sees an additive mask of at most c x (c+w-1) values and no [S, S] tensor is formed. The forward
returns each block's output and log-sum-exp; the backward runs the kernel's backward per block with that block's
output and log-sum-exp and adds each block's key/value gradients into their range. A kernel with a native window
(`supports_window`: flash-attn, window_size (w - 1, 0)) gets the window passed through; its glue is tested on CPU
against a stand-in, not on a GPU. Other kernels (CUDA sdpa) raise NotImplementedError naming themselves.

The mask semantics are transformers' sliding-window masks: key t is seen by query i when 0 <= i - t < window.
"""

from __future__ import annotations

import torch

from hf_upipe.ops.kernels import SdpaCpuKernel

__all__ = ["WindowKernel"]


class WindowKernel:
    """`inner` restricted to a causal sliding window of `window` keys (module docstring)."""

    def __init__(self, inner, window: int):
        if not (isinstance(inner, SdpaCpuKernel) or getattr(inner, "supports_window", False)):
            raise NotImplementedError(
                f"sliding-window attention (window={window}) under sequence parallelism is implemented for the CPU "
                f"'sdpa' and the 'flash_attn' kernels, not for the {getattr(inner, 'name', type(inner).__name__)!r} "
                "kernel: use one of those (UPipeConfig(kernel=...)), sequences no longer than the window, or a config "
                "without the window."
            )
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={window!r}: need an integer >= 1")
        self.inner, self.window = inner, window
        self.name = f"{inner.name}+window{window}"

    def _blocks(self, S: int):
        """(i0, i1, k0) per query block: queries [i0, i1) and the keys [k0, i1) their windows reach."""
        c = min(self.window, S)
        for i0 in range(0, S, c):
            yield i0, min(S, i0 + c), max(0, i0 - self.window + 1)

    def _mask(self, i0: int, i1: int, k0: int, dtype, device) -> torch.Tensor:
        """[1, 1, i1-i0, i1-k0] additive mask: 0 where 0 <= i - t < window, -inf elsewhere."""
        i = torch.arange(i0, i1, device=device)[:, None]
        t = torch.arange(k0, i1, device=device)[None, :]
        seen = (t <= i) & (t > i - self.window)
        return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(
            ~seen, float("-inf")
        )[None, None]

    def forward(self, q, k, v, *, scale, causal=True):
        """q [B, S, h, D], k/v [B, S, hk, D] -> out [B, S, h, D], lse [B, h, S]."""
        if not causal:
            raise NotImplementedError("WindowKernel is causal only")
        if not isinstance(self.inner, SdpaCpuKernel):  # a kernel with a native window (flash-attn)
            return self.inner.forward(q, k, v, scale=scale, causal=True, window=self.window)
        B, S, h, _ = q.shape
        out, lse = (
            q.new_empty(B, S, h, v.shape[-1]),
            None,
        )  # written block by block: no list of blocks, no cat
        for i0, i1, k0 in self._blocks(S):
            o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, i0:i1].transpose(1, 2),
                k[:, k0:i1].transpose(1, 2),
                v[:, k0:i1].transpose(1, 2),
                0.0,
                False,
                attn_mask=self._mask(i0, i1, k0, q.dtype, q.device),
                scale=scale,
            )  # [B, h, c, D], [B, h, c]
            if lse is None:
                lse = m.new_empty(B, h, S)
            out[:, i0:i1] = o.transpose(1, 2)
            lse[:, :, i0:i1] = m
            del o, m
        return out, lse  # [B, S, h, D], [B, h, S]

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        """Gradients dq [B, S, h, D], dk/dv [B, S, hk, D], block by block (module docstring)."""
        if not causal:
            raise NotImplementedError("WindowKernel is causal only")
        if not isinstance(self.inner, SdpaCpuKernel):
            return self.inner.backward(
                dout, q, k, v, out, lse, scale=scale, causal=True, window=self.window
            )
        S = q.shape[1]
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        for i0, i1, k0 in self._blocks(S):
            dqb, dkb, dvb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, i0:i1].transpose(1, 2),
                q[:, i0:i1].transpose(1, 2),
                k[:, k0:i1].transpose(1, 2),
                v[:, k0:i1].transpose(1, 2),
                out[:, i0:i1].transpose(1, 2),
                lse[:, :, i0:i1].contiguous(),
                0.0,
                False,
                attn_mask=self._mask(i0, i1, k0, q.dtype, q.device),
                scale=scale,
            )
            dq[:, i0:i1] = dqb.transpose(1, 2)
            dk[:, k0:i1] += dkb.transpose(1, 2)  # [B, i1-k0, hk, D]
            dv[:, k0:i1] += dvb.transpose(1, 2)
        return dq, dk, dv
