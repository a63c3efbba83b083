"""Ring attention's seam in the attention paths: the kernel a call runs under `init_sequence_parallel(ring_size=R)`.

Entry point:
- `ring_kernel(state, kernel, device, dtype, *, window=None, chunk=None, softcap=None)`: the state's kernel wrapped
  in `hf_upipe.ops.ring.RingKernel` over `state.ring_group`; the registered attention function and the fused block
  call it in place of their window / chunk / soft-capping kernels, which assume the sequence in order.

What the ring does not implement is refused here, on every rank alike (the same model and call on every rank),
before any all-to-all: sliding windows, chunked attention and soft-capping (their masks are over positions in
sequence order, not the ring's). Packed rows are refused by `hf_upipe.data.shard_batch` and the layout check.
"""

from __future__ import annotations

from hf_upipe.ops.kernels import AttentionKernel, get_kernel
from hf_upipe.ops.ring import RingKernel

__all__ = ["ring_kernel"]


def ring_kernel(
    state, kernel: str | AttentionKernel, device, dtype, *, window=None, chunk=None, softcap=None
) -> AttentionKernel:
    """`kernel` (a name or an `AttentionKernel`) as a `RingKernel` over `state.ring_group`.

    Raises:
        NotImplementedError: the call needs a sliding window, chunked attention or soft-capping (every rank).
    """
    for what, value in (
        ("a sliding window", window),
        ("chunked attention", chunk),
        ("attention soft-capping", softcap),
    ):
        if value is not None:
            raise NotImplementedError(
                f"This model's attention uses {what} ({value}), which ring attention "
                f"(ring_size={state.ring_size}) does not implement: use ring_size=1 (UPipe "
                "over the whole SP group)."
            )
    inner = get_kernel(kernel, device, dtype) if isinstance(kernel, str) else kernel
    return RingKernel(inner, state.ring_group)
