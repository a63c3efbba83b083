"""CUDA attention kernels behind `hf_upipe.ops.kernels.AttentionKernel`.

Entry points:
- `SdpaCudaKernel` ("sdpa" on CUDA; `kernels.get_kernel` builds it): torch SDPA called at the aten level so the
  log-sum-exp comes back from forward and is handed to backward.
  * fp16/bf16, head dim <= 256, sm80+: `aten::_scaled_dot_product_flash_attention` (+ `_backward`).
  * otherwise (fp32, older GPUs, larger head dims): `aten::_scaled_dot_product_efficient_attention` (+ `_backward`).
  These ops are called with as many k/v heads as query heads: k/v are expanded (one copy) and dk/dv are summed back
  over each group of query heads, in fp32.
- `CudnnKernel` ("cudnn", priority 40: "auto" prefers it to "sdpa" on sm90 with fp16/bf16): torch's cuDNN attention
  at the aten level, with the flash kernel's fallbacks for what was not measured (see the class).
- `FlashAttnKernel` ("flash_attn", registered by `kernels` with priority 10, so "auto" prefers it on CUDA when the
  `flash_attn` package is installed and the dtype is fp16/bf16): FlashAttention-2 through
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

Indirections (module-level, looked up at call time, patched by the CPU tests): `_aten_flash_fwd`, `_aten_flash_bwd`,
`_aten_eff_fwd`, `_aten_eff_bwd`, `_aten_cudnn_fwd`, `_aten_cudnn_bwd`, `_device_capability`, `_cudnn_installed`,
`_flash_attn_installed`, `_flash_api`, `_flash_varlen_api` (lru-cached).

Dummy backward arguments (valid for dropout_p == 0, checked against pytorch's attention_backward.cu / flash_api.cpp):
- flash: `cum_seq_q/cum_seq_k = None` (an undefined tensor: the dense path; a *defined* tensor, even an empty one,
  selects the varlen path), `max_q/max_k = S`, `philox_seed/philox_offset`: 0-d int64 zeros (read only with dropout).
- efficient: `attn_bias = None`, `philox_seed/philox_offset`: 0-d int64 zeros, `grad_input_mask = [T, T, T, F]`.
Layouts returned: out [B,S,h,D] (a transposed view of aten's output), lse [B,h,S] fp32. The efficient forward pads
its log_sumexp along S to a multiple of 32 (CUDA; none on ROCm): we slice it to [B,h,S] and re-pad a copy in backward.
The aten flash kernels need head_dim % 8 == 0: other head dims are zero-padded to a multiple of 8 (scores unchanged,
the extra output/grad columns are dropped); FlashAttnKernel does the same (2.7+ expects the caller to pad).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import torch

__all__ = [
    "CudnnKernel",
    "FlashAttnKernel",
    "SdpaCudaKernel",
    "cudnn_available",
    "flash_attn_available",
]

_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- indirections
def _aten_flash_fwd(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, return_debug_mask, scale=scale
    )


def _aten_flash_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cum_q,
    cum_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    seed,
    offset,
    *,
    scale,
):
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cum_q,
        cum_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        seed,
        offset,
        scale=scale,
    )


def _aten_eff_fwd(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale
    )


def _aten_eff_bwd(
    dout,
    q,
    k,
    v,
    attn_bias,
    out,
    lse,
    seed,
    offset,
    dropout_p,
    grad_input_mask,
    is_causal,
    *,
    scale,
):
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        attn_bias,
        out,
        lse,
        seed,
        offset,
        dropout_p,
        grad_input_mask,
        is_causal,
        scale=scale,
    )


def _aten_cudnn_fwd(q, k, v, is_causal, *, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, is_causal, False, scale=scale
    )


def _aten_cudnn_bwd(dout, q, k, v, out, lse, seed, offset, max_q, max_k, is_causal, *, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        seed,
        offset,
        None,
        None,
        None,
        max_q,
        max_k,
        0.0,
        is_causal,
        scale=scale,
    )


def _device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules with __spec__ None
        return "flash_attn" in sys.modules


# ----------------------------------------------------------------------------------------------- helpers
def _round8(d: int) -> int:
    return (d + 7) // 8 * 8


def _pad_d(x: torch.Tensor, dp: int) -> torch.Tensor:
    return x if x.shape[-1] == dp else torch.nn.functional.pad(x, (0, dp - x.shape[-1]))


def _expand_kv(x: torch.Tensor, h: int) -> torch.Tensor:
    """[B,S,hk,D] -> [B,S,h,D], k/v head j serving query heads j*g .. j*g+g-1 (a copy when hk < h)."""
    b, s, hk, d = x.shape
    return x if hk == h else x[:, :, :, None, :].expand(b, s, hk, h // hk, d).reshape(b, s, h, d)


def _sum_groups(dx: torch.Tensor, hk: int) -> torch.Tensor:
    """[B,S,h,D] -> [B,S,hk,D]: sum over the query heads sharing each k/v head (accumulated in fp32)."""
    if dx.shape[2] == hk:
        return dx
    return dx.unflatten(2, (hk, dx.shape[2] // hk)).sum(3, dtype=torch.float32).to(dx.dtype)


def _zero_scalar(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _eff_lse_len(s: int) -> int:
    """Length of the efficient kernel's log_sumexp rows: S rounded up to 32 on CUDA (kAlignLSE), S on ROCm."""
    return s if getattr(torch.version, "hip", None) else (s + 31) // 32 * 32


# ----------------------------------------------------------------------------------------------- torch SDPA
class SdpaCudaKernel:
    """torch SDPA's flash / memory-efficient CUDA kernels at the aten level (see the module docstring)."""

    name = "sdpa"

    @staticmethod
    def _use_flash(q: torch.Tensor) -> bool:
        return (
            q.dtype in _HALF
            and _round8(q.shape[-1]) <= 256
            and _device_capability(q.device) >= (8, 0)
        )

    def forward(self, q, k, v, *, scale, causal=True):
        b, s, h, d = q.shape
        dp = _round8(d)
        qp, kp, vp = (_pad_d(x, dp) for x in (q, _expand_kv(k, h), _expand_kv(v, h)))
        qt, kt, vt = (x.transpose(1, 2) for x in (qp, kp, vp))  # [B, h, S, D] views
        if self._use_flash(q):
            out, lse = _aten_flash_fwd(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
        else:
            out, lse = _aten_eff_fwd(qt, kt, vt, None, True, 0.0, causal, scale=scale)[:2]
            lse = lse[:, :, :s]  # drop the padding along S
        return out.transpose(1, 2)[..., :d], lse  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        b, s, h, d = q.shape
        hk, dp = k.shape[2], _round8(d)
        qp, kp, vp, op, dop = (
            _pad_d(x, dp) for x in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout)
        )
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (qp, kp, vp, op, dop))
        zero = _zero_scalar(q.device)
        if self._use_flash(q):
            dq, dk, dv = _aten_flash_bwd(
                dot,
                qt,
                kt,
                vt,
                ot,
                lse.contiguous(),
                None,
                None,
                s,
                k.shape[1],
                0.0,
                causal,
                zero,
                zero,
                scale=scale,
            )
        else:
            lse_p = lse.new_zeros(b, h, _eff_lse_len(s))
            lse_p[:, :, :s] = lse
            dq, dk, dv, _ = _aten_eff_bwd(
                dot,
                qt,
                kt,
                vt,
                None,
                ot,
                lse_p,
                zero,
                zero,
                0.0,
                [True, True, True, False],
                causal,
                scale=scale,
            )
        dq, dk, dv = (x.transpose(1, 2)[..., :d] for x in (dq, dk, dv))
        return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)


# ----------------------------------------------------------------------------------------------- cuDNN
class CudnnKernel:
    """torch's cuDNN attention (`aten::_scaled_dot_product_cudnn_attention` + `_backward`), fp16/bf16, sm90.

    What torch's own SDPA picks on an H100 (benchmarks/gpu/speed.py: 1.66x faster than the flash kernel at 4 heads
    x 512K tokens, fwd+bwd), verified there against the fp32 CPU reference (benchmarks/gpu/kernels.py). Same layouts
    and GQA handling as `SdpaCudaKernel` (k/v expanded, dk/dv summed back in fp32). cuDNN's softmax statistics come
    back as [B, h, S, 1] (or [B, h, S]); they are handed out as lse [B, h, S] and reshaped back for the backward.
    Calls outside what was measured use `SdpaCudaKernel`, forward and backward alike (the choice depends on the
    shapes only): head dims above 128, and sequences longer than `MAX_S` (524288, the longest verified).
    """

    name = "cudnn"
    _MAX_D = 128
    MAX_S = 2**19

    def __init__(self):
        self._fallback = SdpaCudaKernel()
        self._stats_4d = True

    def _measured(self, q: torch.Tensor) -> bool:
        return _round8(q.shape[-1]) <= self._MAX_D and q.shape[1] <= self.MAX_S

    def forward(self, q, k, v, *, scale, causal=True):
        b, s, h, d = q.shape
        if not self._measured(q):
            return self._fallback.forward(q, k, v, scale=scale, causal=causal)
        dp = _round8(d)
        qt, kt, vt = (
            _pad_d(x, dp).transpose(1, 2) for x in (q, _expand_kv(k, h), _expand_kv(v, h))
        )  # [B,h,S,D]
        res = _aten_cudnn_fwd(qt, kt, vt, causal, scale=scale)
        out, stats = res[0], res[1]
        self._stats_4d = stats.dim() == 4
        return out.transpose(1, 2)[..., :d], stats.reshape(b, h, s)  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        b, s, h, d = q.shape
        if not self._measured(q):
            return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        hk, dp = k.shape[2], _round8(d)
        qt, kt, vt, ot, dot = (
            _pad_d(x, dp).transpose(1, 2)
            for x in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout)
        )  # [B, h, S, D]
        if (
            dot.stride() != ot.stride()
        ):  # cuDNN wants dO laid out like O (torch would copy it with a warning)
            dot = torch.empty_like(ot).copy_(dot)
        stats = lse.reshape(b, h, s, 1) if self._stats_4d else lse.reshape(b, h, s)
        zero = _zero_scalar(q.device)
        dq, dk, dv = _aten_cudnn_bwd(
            dot, qt, kt, vt, ot, stats.contiguous(), zero, zero, s, k.shape[1], causal, scale=scale
        )
        dq, dk, dv = (x.transpose(1, 2)[..., :d] for x in (dq, dk, dv))
        return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)


def cudnn_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether CudnnKernel can run: CUDA, fp16/bf16, sm90 (the Hopper GPUs it was measured on), cuDNN present."""
    return (
        device.type == "cuda"
        and (dtype is None or dtype in _HALF)
        and torch.cuda.is_available()
        and _cudnn_installed()
        and _device_capability(device) >= (9, 0)
    )


def _cudnn_installed() -> bool:
    return torch.backends.cudnn.is_available()


# ----------------------------------------------------------------------------------------------- flash-attn 2
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
    dp = _round8(d)
    if dp > 256:
        raise ValueError(f"flash_attn supports head_dim <= 256, got {d}")
    return (d, *(_pad_d(x, dp) for x in (q, k, v)))


class FlashAttnKernel:
    """FlashAttention-2 (`flash_attn` package), native [B,S,h,D] layout and grouped-query attention."""

    name = "flash_attn"
    supports_window = True  # `window=w`: flash-attn's window_size (w - 1, 0), keys i-w+1 .. i (hf_upipe.ops.windowed)

    def forward(self, q, k, v, *, scale, causal=True, window=None):
        fwd, _, split = _flash_api()
        d, qp, kp, vp = _flash_padded(q, k, v)
        left, right = _window_size(window, causal)
        if split:
            out, lse = fwd(qp, kp, vp, 0.0, scale, causal, left, right, 0.0, None, False)[:2]
        else:  # 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
            res = fwd(qp, kp, vp, 0.0, scale, causal, (left, right), 0.0, None, False)
            out, lse = res[0], res[5]
        return out[..., :d], lse  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True, window=None):
        _, bwd, split = _flash_api()
        d = q.shape[-1]
        dp = _round8(d)
        qp, kp, vp, op, dop = (_pad_d(x, dp) for x in (q, k, v, out, dout))
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
        dp = _round8(d)
        qp, kp, vp, op, dop = (_pad_d(x, dp) for x in (q, k, v, out, dout))
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
        and (dtype is None or dtype in _HALF)
        and torch.cuda.is_available()
        and _flash_attn_installed()
    )
