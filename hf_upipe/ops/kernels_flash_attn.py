"""FlashAttention-2 (the `flash_attn` package) behind `hf_upipe.ops.kernels.AttentionKernel`.

Entry points:
- `FlashAttnKernel` ("flash_attn", registered by `hf_upipe.ops.kernels` with priority 10, so "auto" prefers it on
  CUDA when the `flash_attn` package is installed and the dtype is fp16/bf16): FlashAttention-2 through
  `flash_attn.flash_attn_interface._flash_attn_forward/_flash_attn_backward`, native [B,S,h,D] layout and native GQA.
  flash-attn >= 2.7 takes `window_size_left, window_size_right` and returns (out, lse, S_dmask, rng_state); 2.6 takes a
  `window_size` tuple and returns (out, q, k, v, out_padded, lse, S_dmask, rng_state). The style is read once from the
  signature (through `CustomOpDef._init_fn`, since 2.7+ wraps these in `torch.library.custom_op`, whose own signature
  is `(*args, **kwargs)`), else from `flash_attn.__version__`. flash-attn < 2.6 (no softcap argument) is refused.
  Packed documents (`hf_upipe.ops.documents.DocumentKernel`): `forward_varlen/backward_varlen` call
  `_flash_attn_varlen_forward/_backward` on the flattened tokens q [T, h, D] with `cu_seqlens` int32 [N+1]; the
  window convention is the same as the dense functions' in every release (2.6 tuple, 2.7+ split), and the varlen lse
  is unpadded, [h, T], in 2.6-2.8 (flash_api.cpp `mha_varlen_fwd`).
  FlashAttention-3 (`flash_attn_interface`, Hopper build) is left out: it has no versioned releases and its private
  `_flash_attn_forward/_backward` signatures kept changing (argument order, return values), so no stable call exists.
- `flash_attn_available(device, dtype)`: whether `FlashAttnKernel` can run.

Indirections (module-level, looked up at call time, patched by the CPU tests): `_flash_attn_installed`,
`_flash_api`, `_flash_varlen_api` (lru-cached). The package is imported inside them only, never at module import.
Head dims are zero-padded to a multiple of 8 as for the aten kernels (`hf_upipe.ops.kernels_aten.pad_head_dim`):
2.7+ expects the caller to pad.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import torch

from hf_upipe.ops.kernels_aten import HALF_DTYPES, pad_head_dim, padded_head_dim

__all__ = ["FlashAttnKernel", "flash_attn_available"]


@functools.lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules with __spec__ None
        return "flash_attn" in sys.modules


def _signature_params(fn) -> set[str]:
    try:
        return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)
    except (TypeError, ValueError):
        return set()


@functools.lru_cache(maxsize=None)
def _flash_api():
    """(forward, backward, split_window) from the installed flash-attn 2; split_window: >= 2.7 calling convention."""
    import flash_attn
    from flash_attn import flash_attn_interface as fai

    params = _signature_params(fai._flash_attn_forward)
    if "window_size_left" in params:
        split = True
    elif "window_size" in params:
        split = False
        if "softcap" not in params:
            raise RuntimeError(
                "flash-attn < 2.6 is not supported by hf_upipe; install flash-attn >= 2.6."
            )
    else:  # signature hidden: go by the version
        ver = tuple(
            int(p)
            for p in str(getattr(flash_attn, "__version__", "0.0")).split(".")[:2]
            if p.isdigit()
        )
        if ver < (2, 6):
            raise RuntimeError(
                f"flash-attn {ver} is not supported by hf_upipe; install flash-attn >= 2.6."
            )
        split = ver >= (2, 7)
    return fai._flash_attn_forward, fai._flash_attn_backward, split


@functools.lru_cache(maxsize=None)
def _flash_varlen_api():
    """(varlen forward, varlen backward, split_window): same calling convention as `_flash_api` in 2.6-2.8."""
    from flash_attn import flash_attn_interface as fai

    return fai._flash_attn_varlen_forward, fai._flash_attn_varlen_backward, _flash_api()[2]


def _window_size(window: int | None, causal: bool) -> tuple[int, int]:
    """flash-attn's (left, right) window: (-1, -1) for none; (w - 1, 0) for keys i-w+1 .. i (causal only)."""
    if window is None:
        return -1, -1
    if not causal:
        raise NotImplementedError("a sliding window is implemented for causal attention only")
    return window - 1, 0


def _flash_padded(q, k, v):
    """(D, q, k, v padded to a multiple of 8 in head_dim): flash-attn's kernels take head_dim <= 256, % 8 == 0."""
    d = q.shape[-1]
    dp = padded_head_dim(d)
    if dp > 256:
        raise ValueError(f"flash_attn supports head_dim <= 256, got {d}")
    return (d, *(pad_head_dim(x, dp) for x in (q, k, v)))


class FlashAttnKernel:
    """FlashAttention-2 (`flash_attn` package), native [B,S,h,D] layout and grouped-query attention."""

    name = "flash_attn"
    supports_window = True  # `window=w`: flash-attn's window_size (w - 1, 0), keys i-w+1 .. i (hf_upipe.ops.windowed)

    def _api(self):
        """(forward, backward, split_window): the installed package's (overridden by the hollow twin)."""
        return _flash_api()

    def forward(self, q, k, v, *, scale, causal=True, window=None):
        fwd, _, split = self._api()
        d, qp, kp, vp = _flash_padded(q, k, v)
        left, right = _window_size(window, causal)
        if split:
            out, lse = fwd(qp, kp, vp, 0.0, scale, causal, left, right, 0.0, None, False)[:2]
        else:  # 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
            res = fwd(qp, kp, vp, 0.0, scale, causal, (left, right), 0.0, None, False)
            out, lse = res[0], res[5]
        return out[..., :d], lse  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True, window=None):
        _, bwd, split = self._api()
        d = q.shape[-1]
        dp = padded_head_dim(d)
        qp, kp, vp, op, dop = (pad_head_dim(x, dp) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        sizes = _window_size(window, causal)
        window_args = sizes if split else (sizes,)
        bwd(
            dop,
            qp,
            kp,
            vp,
            op,
            lse.contiguous(),
            dq,
            dk,
            dv,
            0.0,
            scale,
            causal,
            *window_args,
            0.0,
            None,
            False,
            None,
        )
        return dq[..., :d], dk[..., :d], dv[..., :d]

    def forward_varlen(self, q, k, v, cu_seqlens, max_seqlen, *, scale, causal=True):
        """Flattened documents: q [T, h, D], k/v [T, hk, D], cu_seqlens int32 [N+1] -> out [T, h, D], lse [h, T]."""
        fwd, _, split = _flash_varlen_api()
        d, qp, kp, vp = _flash_padded(q, k, v)
        # max_seqlen >= 2: with max_seqlen_q == 1 and GQA, flash-attn swaps heads into the sequence and its lse
        # layout changes; an over-estimate is always allowed (it only sizes the grid)
        m = max(int(max_seqlen), 2)
        if split:
            out, lse = fwd(
                qp,
                kp,
                vp,
                cu_seqlens,
                cu_seqlens,
                m,
                m,
                0.0,
                scale,
                causal,
                -1,
                -1,
                0.0,
                None,
                False,
            )[:2]
        else:  # 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
            res = fwd(
                qp,
                kp,
                vp,
                cu_seqlens,
                cu_seqlens,
                m,
                m,
                0.0,
                scale,
                causal,
                (-1, -1),
                0.0,
                None,
                False,
            )
            out, lse = res[0], res[5]
        return out[..., :d], lse  # [T, h, D], [h, T] fp32

    def backward_varlen(
        self, dout, q, k, v, out, lse, cu_seqlens, max_seqlen, *, scale, causal=True
    ):
        """Gradients of `forward_varlen`: dq [T, h, D], dk/dv [T, hk, D]; lse [h, T]."""
        _, bwd, split = _flash_varlen_api()
        d = q.shape[-1]
        dp = padded_head_dim(d)
        qp, kp, vp, op, dop = (pad_head_dim(x, dp) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        window = (-1, -1) if split else ((-1, -1),)
        m = max(int(max_seqlen), 2)
        bwd(
            dop,
            qp,
            kp,
            vp,
            op,
            lse.contiguous(),
            dq,
            dk,
            dv,
            cu_seqlens,
            cu_seqlens,
            m,
            m,
            0.0,
            scale,
            causal,
            *window,
            0.0,
            None,
            False,
            None,
        )
        return dq[..., :d], dk[..., :d], dv[..., :d]


def flash_attn_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether FlashAttnKernel can run on `device` with `dtype` (CUDA, fp16/bf16, flash-attn installed)."""
    return (
        device.type == "cuda"
        and (dtype is None or dtype in HALF_DTYPES)
        and torch.cuda.is_available()
        and _flash_attn_installed()
    )
