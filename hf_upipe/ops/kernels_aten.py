"""torch's own CUDA attention kernels (SDPA flash / memory-efficient, cuDNN) at the aten level.

Entry points:
- `SdpaCudaKernel` ("sdpa" on CUDA; `hf_upipe.ops.kernels.get_kernel` builds it): torch SDPA called at the aten
  level so the log-sum-exp comes back from forward and is handed to backward.
  * fp16/bf16, head dim <= 256, sm80+: `aten::_scaled_dot_product_flash_attention` (+ `_backward`).
  * otherwise (fp32, older GPUs, larger head dims): `aten::_scaled_dot_product_efficient_attention` (+ `_backward`).
  These ops are called with as many k/v heads as query heads: k/v are expanded (one copy) and dk/dv are summed back
  over each group of query heads, in fp32.
- `CudnnKernel` ("cudnn", priority 40: "auto" prefers it to "sdpa" on sm90 with fp16/bf16): torch's cuDNN attention
  at the aten level, with the flash kernel's fallbacks for what was not measured (see the class).
- `cudnn_available(device, dtype)`: whether `CudnnKernel` can run.
- `HALF_DTYPES`, `padded_head_dim(d)`, `pad_head_dim(x, dp)`: the half dtypes and the head-dim padding these
  kernels and `hf_upipe.ops.kernels_flash_attn` share; `efficient_lse_len(s)`: the memory-efficient kernel's
  log-sum-exp row length (also for `hf_upipe.ops.kernels_hollow`).

Indirections (module-level, looked up at call time, patched by the CPU tests): `_aten_flash_fwd`, `_aten_flash_bwd`,
`_aten_eff_fwd`, `_aten_eff_bwd`, `_aten_cudnn_fwd`, `_aten_cudnn_bwd`, `_device_capability`, `_cudnn_installed`.

Dummy backward arguments (valid for dropout_p == 0, checked against pytorch's attention_backward.cu / flash_api.cpp):
- flash: `cum_seq_q/cum_seq_k = None` (an undefined tensor: the dense path; a *defined* tensor, even an empty one,
  selects the varlen path), `max_q/max_k = S`, `philox_seed/philox_offset`: 0-d int64 zeros (read only with dropout).
- efficient: `attn_bias = None`, `philox_seed/philox_offset`: 0-d int64 zeros, `grad_input_mask = [T, T, T, F]`.
Layouts returned: out [B,S,h,D] (a transposed view of aten's output), lse [B,h,S] fp32. The efficient forward pads
its log_sumexp along S to a multiple of 32 (CUDA; none on ROCm): we slice it to [B,h,S] and re-pad a copy in backward.
The aten flash kernels need head_dim % 8 == 0: other head dims are zero-padded to a multiple of 8 (scores unchanged,
the extra output/grad columns are dropped).
"""

from __future__ import annotations

import torch

__all__ = [
    "HALF_DTYPES",
    "CudnnKernel",
    "SdpaCudaKernel",
    "cudnn_available",
    "efficient_lse_len",
    "pad_head_dim",
    "padded_head_dim",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- indirections
def _aten_flash_fwd(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, return_debug_mask, scale=scale
    )


def _aten_flash_bwd(*args, scale):
    """aten's flash backward: (dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed,
    offset) in the order of `_scaled_dot_product_flash_attention_backward`."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(*args, scale=scale)


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


# ----------------------------------------------------------------------------------------------- helpers
def padded_head_dim(d: int) -> int:
    """`d` rounded up to a multiple of 8, the head dims the flash kernels (aten's and flash-attn's) take."""
    return (d + 7) // 8 * 8


def pad_head_dim(x: torch.Tensor, dp: int) -> torch.Tensor:
    """[..., D] -> [..., dp], zero-padded in the last dim (scores unchanged; the extra columns are dropped after)."""
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


def efficient_lse_len(s: int) -> int:
    """Length of the efficient kernel's log_sumexp rows: S rounded up to 32 on CUDA (kAlignLSE), S on ROCm."""
    return s if getattr(torch.version, "hip", None) else (s + 31) // 32 * 32


# ----------------------------------------------------------------------------------------------- torch SDPA
class SdpaCudaKernel:
    """torch SDPA's flash / memory-efficient CUDA kernels at the aten level (see the module docstring)."""

    name = "sdpa"

    # The aten calls, one method each: `hf_upipe.ops.kernels_hollow` overrides them (and only them) with allocations
    # of the same outputs; here they go to the module-level indirections (looked up at call time).
    def _flash_fwd(self, *args, **kwargs):
        return _aten_flash_fwd(*args, **kwargs)

    def _flash_bwd(self, *args, **kwargs):
        return _aten_flash_bwd(*args, **kwargs)

    def _eff_fwd(self, *args, **kwargs):
        return _aten_eff_fwd(*args, **kwargs)

    def _eff_bwd(self, *args, **kwargs):
        return _aten_eff_bwd(*args, **kwargs)

    @staticmethod
    def _use_flash(q: torch.Tensor) -> bool:
        return (
            q.dtype in HALF_DTYPES
            and padded_head_dim(q.shape[-1]) <= 256
            and _device_capability(q.device) >= (8, 0)
        )

    def forward(self, q, k, v, *, scale, causal=True):
        b, s, h, d = q.shape
        dp = padded_head_dim(d)
        qp, kp, vp = (pad_head_dim(x, dp) for x in (q, _expand_kv(k, h), _expand_kv(v, h)))
        qt, kt, vt = (x.transpose(1, 2) for x in (qp, kp, vp))  # [B, h, S, D] views
        if self._use_flash(q):
            out, lse = self._flash_fwd(qt, kt, vt, 0.0, causal, False, scale=scale)[:2]
        else:
            out, lse = self._eff_fwd(qt, kt, vt, None, True, 0.0, causal, scale=scale)[:2]
            lse = lse[:, :, :s]  # drop the padding along S
        return out.transpose(1, 2)[..., :d], lse  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        b, s, h, d = q.shape
        hk, dp = k.shape[2], padded_head_dim(d)
        qp, kp, vp, op, dop = (
            pad_head_dim(x, dp) for x in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout)
        )
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (qp, kp, vp, op, dop))
        zero = _zero_scalar(q.device)
        if self._use_flash(q):
            dq, dk, dv = self._flash_bwd(
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
            lse_p = lse.new_zeros(b, h, efficient_lse_len(s))
            lse_p[:, :, :s] = lse
            dq, dk, dv, _ = self._eff_bwd(
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
    x 512K tokens, fwd+bwd), verified there against the fp32 CPU reference (benchmarks/gpu/kernel_parity.py). Same
    layouts and GQA handling as `SdpaCudaKernel` (k/v expanded, dk/dv summed back in fp32). cuDNN's softmax statistics
    come back as [B, h, S, 1] (or [B, h, S]); they are handed out as lse [B, h, S] and reshaped back for the backward.
    Calls outside what was measured use `SdpaCudaKernel`, forward and backward alike (the choice depends on the
    shapes only): head dims above 128, and sequences longer than `MAX_S` (524288, the longest verified).
    """

    name = "cudnn"
    _MAX_D = 128
    MAX_S = 2**19
    _fallback_class = (
        SdpaCudaKernel  # the hollow twin falls back to the hollow twin of SdpaCudaKernel
    )

    def __init__(self):
        self._fallback = self._fallback_class()
        self._stats_4d = True

    def _cudnn_fwd(
        self, *args, **kwargs
    ):  # overridden by the hollow twin, as SdpaCudaKernel's calls
        return _aten_cudnn_fwd(*args, **kwargs)

    def _cudnn_bwd(self, *args, **kwargs):
        return _aten_cudnn_bwd(*args, **kwargs)

    def _measured(self, q: torch.Tensor) -> bool:
        return padded_head_dim(q.shape[-1]) <= self._MAX_D and q.shape[1] <= self.MAX_S

    def tile_kernel(self, q: torch.Tensor):
        """The kernel that `hf_upipe.ops.tiled_backward` runs on each tile of a call with q [B, S, h, D]: the one
        this call's forward runs (cuDNN, or the fallback beyond what was measured), whatever the tile's length."""
        return self if self._measured(q) else self._fallback

    def forward(self, q, k, v, *, scale, causal=True):
        b, s, h, d = q.shape
        if not self._measured(q):
            return self._fallback.forward(q, k, v, scale=scale, causal=causal)
        dp = padded_head_dim(d)
        qt, kt, vt = (
            pad_head_dim(x, dp).transpose(1, 2) for x in (q, _expand_kv(k, h), _expand_kv(v, h))
        )  # [B,h,S,D]
        res = self._cudnn_fwd(qt, kt, vt, causal, scale=scale)
        out, stats = res[0], res[1]
        self._stats_4d = stats.dim() == 4
        return out.transpose(1, 2)[..., :d], stats.reshape(b, h, s)  # [B, S, h, D], [B, h, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, scale, causal=True):
        b, s, h, d = q.shape
        if not self._measured(q):
            return self._fallback.backward(dout, q, k, v, out, lse, scale=scale, causal=causal)
        hk, dp = k.shape[2], padded_head_dim(d)
        qt, kt, vt, ot, dot = (
            pad_head_dim(x, dp).transpose(1, 2)
            for x in (q, _expand_kv(k, h), _expand_kv(v, h), out, dout)
        )  # [B, h, S, D]
        if (
            dot.stride() != ot.stride()
        ):  # cuDNN wants dO laid out like O (torch would copy it with a warning)
            dot = torch.empty_like(ot).copy_(dot)
        stats = lse.reshape(b, h, s, 1) if self._stats_4d else lse.reshape(b, h, s)
        zero = _zero_scalar(q.device)
        dq, dk, dv = self._cudnn_bwd(
            dot, qt, kt, vt, ot, stats.contiguous(), zero, zero, s, k.shape[1], causal, scale=scale
        )
        dq, dk, dv = (x.transpose(1, 2)[..., :d] for x in (dq, dk, dv))
        return dq, _sum_groups(dk, hk), _sum_groups(dv, hk)


def cudnn_available(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether CudnnKernel can run: CUDA, fp16/bf16, sm90 (the Hopper GPUs it was measured on), cuDNN present."""
    return (
        device.type == "cuda"
        and (dtype is None or dtype in HALF_DTYPES)
        and torch.cuda.is_available()
        and _cudnn_installed()
        and _device_capability(device) >= (9, 0)
    )


def _cudnn_installed() -> bool:
    return torch.backends.cudnn.is_available()
