"""Predicted time of one training step: a model of FLOPs and bytes, not a measurement.

Entry points:
- `step_time(config, settings, *, seq_len, sp_size, world, gpus_per_node, lora=None, gpu=H100_SXM,
  efficiency=EFFICIENCY) -> StepTime`: seconds by part, the total, tokens/s per GPU.
- `GPU`, `H100_SXM`: the hardware figures used (datasheet values); `Efficiency`, `EFFICIENCY`: the share of those
  figures the kernels and collectives reach, in one place, to be calibrated on a GPU.
- `zero3_copy_bytes(trainable, world)`: the host-link bytes of the peer's ZeRO-3 host optimizer.
- `PAPER_ULYSSES_TOKENS_PER_S`, `PAPER_UPIPE_TOKENS_PER_S`: the UPipe paper's Llama3-8B throughputs on 8 x H100,
  that `benchmarks/step_time_model.py` compares the model's ratios with.

What is counted, per rank and decoder layer (s = S/P local tokens, bf16; every layer checkpointed, as the planner's
step is):
- GEMMs: the q/k/v/o projections and the MLP (gated: 3 matrices; a MoE layer its active experts), each run in the
  forward, again in the checkpoint's recompute, and twice in the backward (d input, d weight; the frozen base of a
  LoRA run skips its d weight). The fused block's backward re-runs each stage's q/k/v projections (recompute
  mode) or its q projection only (save mode keeps k/v); the tiled MLP re-runs the MLP forward in its backward.
- Attention: the causal kernel over the full sequence for H/P heads, 2 S^2 (H/P) D FLOPs forward; the backward
  2.5x that (five GEMM-sized products against two); the checkpoint's recompute runs the forward again, and the
  fused block's recompute mode a third time.
- All-to-alls (NVLink inside a node, the network when an SP group spans nodes), in units of s*D elements, of
  which (P-1)/P leave the GPU: forward q, k, v and the output (2H + 2Hk, k/v replicated up to P heads), again in
  the recompute; backward dout, dq, dk, dv for DeepSpeed; our registered path also re-sends q and the output; the
  fused block re-sends q and the output, and either re-sends k, v and sends dk/dv once per stage (recompute mode)
  or keeps k, v and sends dk/dv once per k/v chunk (save mode). The fused forward (and its recompute) sends each
  stage's inputs and output while the neighbouring stage's kernel runs, and with `overlap` its backward does too:
  only the first stage's share and what exceeds the kernels' time stay exposed. Each call also
  costs a fixed latency (`GPU.all_to_all_latency`), which is what smaller head chunks pay.
- Ring attention (`ring_size` R > 1; the all-to-alls above then run over U = P/R ranks): each stage's k/v block
  [S/R, kc, D] passes R-1 ranks per forward run (the forward, the checkpoint's recompute, the recompute mode's
  third), and in the backward R-1 times with its fp32 dk/dv accumulator passing R times; over the network when the
  SP group spans nodes. It runs during the ring's kernels: what exceeds (R-1)/R of the attention time is exposed;
  the accumulators pass in `hf_upipe.ops.ring.PASS_PIECES` pieces, each beyond the first a latency more.
- Overlapped with the layer's compute (the larger of the two counts): FSDP2's all-gathers (bf16 weights, forward
  and backward) and reduce-scatters (fp32 gradients); the offloaded input's copy to the host over PCIe. Its copy
  back in the backward is waited for (`offload_restore`: one layer input on the device at a time, no prefetch).
- With `offload='disk'`: the pack's copy to the host is synchronous (`disk_offload_copy`, exposed), the file write
  (`DISK_BYTES_PER_S` per GPU) overlaps the layer's compute, and the backward waits for the file's read and the
  copy back (`offload_restore`).
- Per step: the lm_head and loss (three GEMMs, two for a frozen head), AdamW over the local shard (HBM-bound).
- With `model_offload='cpu'` (FSDP2's host offload), instead of the GPU's AdamW: AdamW on the host over the local
  shard (`HOST_ADAMW_SECONDS_PER_PARAM`, exposed: it runs after the backward), and the copies over the host link
  (`HOST_LINK_BYTES_PER_S` per GPU): each layer's parameter shard to the GPU twice (forward and backward
  all-gathers; fp32, a LoRA base in the compute dtype) and its fp32 gradient shard back, overlapped with the
  layer's compute like the checkpoint offload's copies; the root's (embeddings, lm_head) exposed. DeepSpeed's
  Ulysses with it (the peer's ZeRO-3 with the optimizer on the host, ALST's recipe): CPU Adam at the same
  seconds per parameter, and the copies of `zero3_copy_bytes`: the gradient partitions'
  round trip behind each layer's backward, the step boundary's and the weights' copy up exposed.
- The tiled attention backward (`hf_upipe.ops.tiled_backward`, calls longer than `UPIPE_BACKWARD_BLOCK` tokens):
  its accumulators' reads and writes in HBM and a fixed latency per extra kernel call (`TILE_LATENCY`); the
  arithmetic is the untiled call's.
Not modelled: kernel launch latency (beyond the tiles'), small-message all-to-all latency, the optimizer's
all-reduce of the loss, memory-allocator stalls. Calibrate `EFFICIENCY` on a GPU before trusting absolute
seconds; the ratios between settings depend mostly on the counts.
"""

from __future__ import annotations

import dataclasses

from hf_upipe.models.architectures import model_geometry
from hf_upipe.ops.head_layout import HeadLayout

__all__ = [
    "DISK_BYTES_PER_S",
    "EFFICIENCY",
    "GPU",
    "H100_SXM",
    "PAPER_ULYSSES_TOKENS_PER_S",
    "PAPER_UPIPE_TOKENS_PER_S",
    "Efficiency",
    "StepTime",
    "step_time",
    "zero3_copy_bytes",
]


@dataclasses.dataclass(frozen=True)
class GPU:
    """Hardware figures of one GPU (bytes/s are per direction)."""

    name: str
    flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    hbm: float  # memory bandwidth
    nvlink: float  # to the other GPUs of its node
    network: float  # to other nodes (its share of the node's NICs)
    pcie: float  # to host memory
    all_to_all_latency: (
        float  # seconds one all-to-all costs beyond its bytes (small messages, launch)
    )


# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 each way);
# one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s); PCIe Gen5 x16 (64 GB/s each way); 20 us per all-to-all call
# (a typical small-message NCCL latency inside an NVLink node; not measured here)
H100_SXM = GPU(
    "H100 SXM",
    flops=989.4e12,
    hbm=3.35e12,
    nvlink=450e9,
    network=50e9,
    pcie=64e9,
    all_to_all_latency=20e-6,
)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the `GPU` figures reached. The attention kernel's two were fitted together (backward = 0.79 x
    forward, FlashAttention-3's published forward/backward ratio on H100) to one published point: the UPipe paper's
    Ulysses baseline, Llama3-8B at 1M tokens on 8 x H100, 475.33 tokens/s per GPU. The others are typical values for
    large GEMMs and bandwidth-bound transfers on H100s, not fitted. None was measured by this project."""

    gemm: float = 0.70
    attention_forward: float = 0.72
    attention_backward: float = 0.57
    all_to_all: float = 0.70
    gather: float = 0.70  # FSDP2's all-gather / reduce-scatter
    pcie: float = 0.80
    hbm: float = 0.80


EFFICIENCY = Efficiency()

# Host AdamW (model_offload='cpu'), seconds per parameter of a GPU's shard, all 8 GPUs of a node stepping at once.
# The step is bound by host memory bandwidth: torch's AdamW reads the parameter, gradient, m and v and writes three
# of them (28 bytes per parameter), about twice that with its foreach temporaries; at 28 GB/s per GPU (230 GB/s per
# node, 37% of a DGX H100's two sockets of 8-channel DDR5-4800, 614 GB/s) that is 2 ns per parameter. The same
# order as one core here: torch 2.13's CPU AdamW (fp32, foreach) took 4.65 ns per parameter on one core of this
# project's build machine (benchmarks/host_adamw.py), and a DGX H100 gives each GPU 14 of its 112 cores. Assumed,
# not measured on such a host; DeepSpeed's CPU Adam (AVX-512) is faster than torch's.
HOST_ADAMW_SECONDS_PER_PARAM = 2.0e-9
# Host <-> GPU copies of the model offload, bytes/s per GPU per direction: PCIe Gen5 x16 is 64 GB/s, but the 8 GPUs
# of a node share the host's PCIe switches and memory bandwidth (and the checkpoint offload's copies); 25 GB/s
# effective per GPU is assumed, not measured.
HOST_LINK_BYTES_PER_S = 25e9

# Checkpoint offload to disk (offload="disk"), bytes/s per GPU for the file write and for the read back: a DGX H100
# has 8 x 3.84 TB NVMe U.2 data drives, about one per GPU, rated about 7 GB/s sequential read and 4 GB/s write each
# (the drives' spec sheets); 3 GB/s each way is a conservative figure for torch.save / torch.load of one layer input
# through the page cache, assumed, not measured.
DISK_BYTES_PER_S = 3e9

# tokens/s per GPU, Llama3-8B on 8 x H100 (the paper's project page; ../shared/reference/upipe-method.md section 3)
PAPER_ULYSSES_TOKENS_PER_S = {
    2**17: 2320.47,
    2**18: 1503.80,
    2**19: 878.63,
    2**20: 475.33,
    2**21: 246.05,
    3 * 2**20: 162.41,
}
PAPER_UPIPE_TOKENS_PER_S = {
    2**17: 2281.05,
    2**18: 1487.29,
    2**19: 867.17,
    2**20: 472.53,
    2**21: 246.07,
    3 * 2**20: 166.32,
}


@dataclasses.dataclass
class StepTime:
    """Predicted seconds of one step by part (`parts`), their total and tokens/s per GPU."""

    parts: dict
    seq_len: int
    sp_size: int

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """One sequence of seq_len tokens per SP group per step, over its sp_size GPUs."""
        return self.seq_len / self.seconds / self.sp_size


def _dims(config) -> dict:
    """Widths the model needs beyond `model_geometry`: head dim, the MLP's active and total width."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    g = model_geometry(config)
    head_dim = get("head_dim") or g["hidden"] // g["heads"]
    experts, active = get("num_local_experts") or get("num_experts"), get("num_experts_per_tok")
    expert_width = get("moe_intermediate_size") or get("intermediate_size") or 4 * g["hidden"]
    if (
        experts and active
    ):  # a MoE layer: the tokens run through `active` experts; FSDP gathers all of them
        shared = get("shared_expert_intermediate_size") or 0
        mlp_active, mlp_total = active * expert_width + shared, experts * expert_width + shared
    else:
        mlp_active = mlp_total = get("intermediate_size") or 4 * g["hidden"]
    return {**g, "head_dim": head_dim, "mlp_active": mlp_active, "mlp_total": mlp_total}


def _forward_units(H: int, Hkv: int) -> int:
    """Elements one forward sends per rank and layer, in units of s*D: q, out, k, v."""
    return 2 * H + 2 * Hkv


def _exposed(t: float, stages: int, budget: float) -> float:
    """Seconds of all-to-all `t`, sent one stage ahead over `stages`, left exposed beside `budget` seconds of
    kernels: the first stage's share, and whatever exceeds the kernels."""
    return t / stages + max(0.0, t * (1 - 1 / stages) - budget)


def _all_to_all_units(
    impl: str, fused_backward: str, H: int, Hkv: int, P: int, stages: int, kc: int
) -> float:
    """Elements sent per rank and layer in a step, in units of s*D (see the module docstring)."""
    forward = _forward_units(H, Hkv)
    if impl == "deepspeed":
        backward = 2 * H + 2 * Hkv  # dout, dq, dk, dv
    elif impl in ("ulysses", "upipe"):
        backward = 4 * H + 2 * Hkv  # + q and the output again
    elif fused_backward == "save":
        backward = 4 * H + 2 * Hkv  # q, out again; dout, dq; dk, dv once per k/v chunk (k, v kept)
    else:
        backward = 4 * H + 2 * Hkv + 2 * stages * kc * P  # dk, dv partials from every stage
    return 2 * forward + backward  # the checkpoint's recompute repeats the forward's


def _ring_bytes(
    S: int, R: int, D: int, stages: int, kc: int, kv_bytes: int = 2, acc_bytes: int = 4
):
    """Bytes one rank sends around a ring of R per layer: (one forward run: each stage's k/v block over a ring
    shard, R-1 hops; the backward: the k/v blocks again and their dk/dv accumulators, R hops)."""
    block = 2 * (S // R) * kc * D  # elements of one stage's k and v over a ring shard
    return stages * block * (R - 1) * kv_bytes, stages * block * (
        (R - 1) * kv_bytes + R * acc_bytes
    )


def _all_to_all_calls(impl: str, fused_backward: str, stages: int, groups: int) -> int:
    """All-to-all calls per rank and layer in a step: per stage q and the output (k, v per k/v group) forward,
    twice with the recompute; the backward as `_all_to_all_units` counts its tensors."""
    if impl == "deepspeed":
        return 2 * 4 + 4
    forward = 2 * stages + 2 * groups
    backward = (
        4 * stages + 2 * groups
    )  # q, out, dout, dq per stage; per group dk, dv (fused recompute: k, v)
    if impl == "fused" and fused_backward == "recompute":
        backward += (
            2 * stages
        )  # dk, dv per stage (save mode: per group, as counted, and k, v are kept)
    return 2 * forward + backward


def _gemm_seconds(d: dict, settings, s: int, frozen: bool, gpu: GPU, eff: Efficiency) -> float:
    """Seconds of one layer's GEMM FLOPs: forward, recompute, backward (d input, and d weight unless frozen)."""
    H, Hk, D, Dm = d["heads"], d["kv_heads"], d["head_dim"], d["hidden"]
    fused = settings.impl == "fused"
    proj_qkv, proj_o, mlp = (
        2 * s * Dm * (H + 2 * Hk) * D,
        2 * s * H * D * Dm,
        6 * s * Dm * d["mlp_active"],
    )
    runs = 2 + (1 if frozen else 2)
    rerun = (
        (proj_qkv if settings.fused_backward == "recompute" else 2 * s * Dm * H * D) if fused else 0
    )
    gemm = (proj_qkv + proj_o + mlp) * runs + rerun + (mlp if settings.tiled_mlp else 0)
    return gemm / (gpu.flops * eff.gemm)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What one layer's communication times depend on: the head layout over the `U` ranks UPipe's all-to-alls span,
    the model's widths `d` (`_dims`), the sequence (S tokens, s per rank, P ranks, a ring of R), the GPUs per node,
    the attention kernels' seconds the communication hides behind (`attention_fwd` FLOPs of one forward,
    `t_attention` seconds in all), the hardware figures and the share of them reached."""

    layout: HeadLayout
    d: dict
    S: int
    s: int
    P: int
    R: int
    U: int
    gpus_per_node: int
    attention_fwd: float
    t_attention: float
    gpu: GPU
    eff: Efficiency


def _all_to_all_seconds(settings, layer: _Layer) -> float:
    """Exposed seconds of one layer's all-to-alls over `U` ranks, with every call's fixed latency."""
    layout, d, s, U, gpus_per_node = layer.layout, layer.d, layer.s, layer.U, layer.gpus_per_node
    attention_fwd, t_attention, gpu, eff = (
        layer.attention_fwd,
        layer.t_attention,
        layer.gpu,
        layer.eff,
    )
    H, D = d["heads"], d["head_dim"]
    impl, fused = settings.impl, settings.impl == "fused"
    stages, kc = layout.num_stages, layout.kv_per_stage
    Hkv = layout.kv_per_rank * U  # k/v heads after replication up to one per rank
    sp_bandwidth = gpu.nvlink if U <= gpus_per_node else gpu.network
    seconds_per_unit = s * D * 2 * (U - 1) / U / (sp_bandwidth * eff.all_to_all)
    units = _all_to_all_units(impl, settings.fused_backward, H, Hkv, U, stages, kc)
    t_fwd = (
        2 * _forward_units(H, Hkv) * seconds_per_unit
    )  # the forward's and the checkpoint recompute's
    t_bwd = (units - 2 * _forward_units(H, Hkv)) * seconds_per_unit
    if (
        fused and stages > 1
    ):  # the fused forward always sends one stage ahead; its backward does with `overlap`
        t_fwd = _exposed(t_fwd, stages, 2 * attention_fwd / (gpu.flops * eff.attention_forward))
        if settings.overlap:
            t_bwd = _exposed(
                t_bwd, stages, t_attention - 2 * attention_fwd / (gpu.flops * eff.attention_forward)
            )
    t_a2a = t_fwd + t_bwd
    groups = layout.kv_per_rank // layout.kv_per_stage
    t_a2a += (
        _all_to_all_calls(impl, settings.fused_backward, stages, groups) * gpu.all_to_all_latency
    )
    return t_a2a


def _ring_seconds(layer: _Layer, recompute: bool) -> float:
    """Exposed seconds of one layer's ring passes (0 without a ring): each stage's k/v block around the ring
    (the network when the SP group spans nodes), behind the kernels."""
    layout, S, R, D, P = layer.layout, layer.S, layer.R, layer.d["head_dim"], layer.P
    gpus_per_node, t_attention, gpu, eff = (
        layer.gpus_per_node,
        layer.t_attention,
        layer.gpu,
        layer.eff,
    )
    if R <= 1:
        return 0.0
    from hf_upipe.ops.ring import PASS_PIECES

    forward_run, backward = _ring_bytes(S, R, D, layout.num_stages, layout.kv_per_stage)
    ring_bytes = forward_run * (3 if recompute else 2) + backward  # forward, recompute(s), backward
    t_ring = ring_bytes / ((gpu.network if P > gpus_per_node else gpu.nvlink) * eff.all_to_all)
    # the dk/dv accumulators pass in pieces, one after another: each piece's latency beyond the first is exposed
    pieces = layout.num_stages * R * 2 * (PASS_PIECES - 1) * gpu.all_to_all_latency
    return max(0.0, t_ring - t_attention * (R - 1) / R) + pieces


def _host_copy_bytes(params: int, world: int, frozen: bool) -> float:
    """Bytes a GPU copies over the host link per step for `params` parameters under FSDP2's host offload: its shard
    in for the forward's and the backward's all-gathers (fp32; a frozen LoRA base in bf16), the fp32 gradient
    shard out (none for a frozen base)."""
    shard = params / world
    return 2 * shard * (2 if frozen else 4) + (0 if frozen else shard * 4)


def zero3_copy_bytes(trainable: float, world: int) -> tuple[float, float]:
    """(overlapped, exposed): bytes a GPU moves over the host link per step for `trainable` parameters under
    DeepSpeed ZeRO-3 with `offload_optimizer: cpu` (`hf_upipe.planning.zero3_offload`), per parameter of its
    partition: during the backward each reduced bf16 partition goes to the host buffer and back (`partition_grads`:
    2 + 2, behind the backward's compute); at the step's boundary each partition comes to the GPU again, is cast to
    fp32 there and goes to the host (`_finalize_offload_gradient_accumulation`: 2 + 4), and after the CPU Adam step
    the updated weights come up in bf16 (`_reassign_or_swap_out_partitioned_parameters`: a CPU-to-GPU `copy_`
    converts on the CPU, 2): 8 bytes exposed."""
    partition = trainable / world
    return (2 + 2) * partition, (2 + 4 + 2) * partition


# seconds each extra kernel call of the tiled attention backward costs beyond its bytes (its launches and the
# accumulators' adds; a typical CUDA launch latency, not measured here)
TILE_LATENCY = 20e-6


def _tile_seconds(
    layout: HeadLayout, *, S: int, R: int, D: int, gpu: GPU, eff: Efficiency
) -> float:
    """Seconds one layer's tiled attention backward (`hf_upipe.ops.tiled_backward`) adds: per stage and ring
    step, each of its tiles (n (n + 1) / 2 of a causal call of n tiles; n^2 / 2 for each other step of a ring) reads
    its bf16 dq, dk, dv and adds them into float32 accumulators (read and written), each key tile's dk/dv is written
    back and dq cast once, and every tile call beyond the first pays `TILE_LATENCY`. 0 when the calls are not
    tiled (one tile or fewer, or `UPIPE_BACKWARD_BLOCK=0`)."""
    from hf_upipe.ops.tiled_backward import backward_block

    block, tokens = backward_block(), S // R
    if block <= 0 or tokens <= block:
        return 0.0
    n = -(-tokens // block)
    h, hk = layout.chunk, layout.kv_per_stage
    # per stage: the ring's causal step, and its R - 1 others of half the rows (or keys) each
    tiles = n * (n + 1) // 2 + (R - 1) * (n * n + 1) // 2
    per_tile = block * D * (h + 2 * hk) * (2 + 4 + 4)  # bf16 read, fp32 read and write
    final = tokens * D * (h + 2 * hk) * (4 + 2) * R  # dq cast, dk/dv written out, per ring step
    stage = (tiles * per_tile + final) / (gpu.hbm * eff.hbm) + (tiles - R) * TILE_LATENCY
    return layout.num_stages * stage


def step_time(
    config,
    settings,
    *,
    seq_len: int,
    sp_size: int,
    world: int,
    gpus_per_node: int,
    lora=None,
    gpu: GPU = H100_SXM,
    efficiency: Efficiency = EFFICIENCY,
) -> StepTime:
    """The predicted time of one training step with `settings`
    (`hf_upipe.planning.train_step.StepSettings`); see the module docstring for what is counted. `lora`: None
    (full fine-tune) or (rank, targets): the frozen base computes no weight gradients and reduces none."""
    d = _dims(config)
    H, Hk, D, Dm, L, V = (
        d["heads"],
        d["kv_heads"],
        d["head_dim"],
        d["hidden"],
        d["layers"],
        d["vocab"],
    )
    P, S, eff = sp_size, seq_len, efficiency
    s = S // P
    R = getattr(settings, "ring_size", 1)
    U = P // R  # the ranks UPipe's all-to-alls run over (all P without a ring)
    fused, impl = settings.impl == "fused", settings.impl
    layout = HeadLayout(H, Hk, U, settings.heads_per_chunk if impl in ("fused", "upipe") else None)
    frozen = lora is not None

    t_gemm = _gemm_seconds(d, settings, s, frozen, gpu, eff)
    attention_fwd = 2 * S * S * (H // P) * D  # causal: half of 4 S^2 h D
    recompute = fused and settings.fused_backward == "recompute"
    t_attention = attention_fwd * (3 if recompute else 2) / (
        gpu.flops * eff.attention_forward
    ) + 2.5 * attention_fwd / (gpu.flops * eff.attention_backward)
    layer = _Layer(layout, d, S, s, P, R, U, gpus_per_node, attention_fwd, t_attention, gpu, eff)
    t_a2a = _all_to_all_seconds(settings, layer)
    t_ring = _ring_seconds(layer, recompute)

    # overlapped with the layer's compute: FSDP2's gathers and reduce-scatters, the offloaded input over PCIe
    layer_params = Dm * (H + 2 * Hk) * D + H * D * Dm + 3 * Dm * d["mlp_total"]
    share = (world - 1) / world
    gathered = 2 * layer_params * 2 * share + (0 if frozen else layer_params * 4 * share)
    t_fsdp = gathered / ((gpu.nvlink if world <= gpus_per_node else gpu.network) * eff.gather)
    # the forward's copy to the host hides behind the layer; the backward's copy back is waited for (no prefetch:
    # one layer input on the device at a time, hf_upipe.training.offload), for every layer but the kept last one
    t_checkpoint = (
        s * Dm * 2 / (gpu.pcie * eff.pcie) if settings.offload in ("cpu", "disk") else 0.0
    )
    # offload="disk": the pack's copy to the host is synchronous (exposed); the file write runs in a background
    # thread behind the layer's compute; in the backward the file is read, then copied back (both waited for)
    t_disk = s * Dm * 2 / DISK_BYTES_PER_S if settings.offload == "disk" else 0.0
    t_offload = t_disk if settings.offload == "disk" else t_checkpoint
    model_offload = getattr(settings, "model_offload", "none") == "cpu"
    # the peer (DeepSpeed's Ulysses) with it: ZeRO-3's host optimizer (zero3_offload)
    zero3 = model_offload and impl == "deepspeed"
    layer_trained = layer_params if not frozen else 2 * lora[0] * Dm * 4  # rough LoRA size
    if zero3:
        # its reduced gradient partitions to the host buffer and back; the parameters stay on the GPU
        t_offload += zero3_copy_bytes(layer_trained, world)[0] / HOST_LINK_BYTES_PER_S
    elif model_offload:
        # the layer's shard in twice (fp32; a LoRA base in bf16), its gradient shard out once
        t_offload += _host_copy_bytes(layer_params, world, frozen) / HOST_LINK_BYTES_PER_S
    t_tiles = _tile_seconds(layout, S=S, R=R, D=D, gpu=gpu, eff=eff) if impl != "deepspeed" else 0.0
    compute = t_gemm + t_attention + t_tiles + t_a2a + t_ring
    hidden_behind = max(compute, t_fsdp, t_offload) - compute

    head = 2 * s * Dm * V * (2 if frozen else 3)
    trained = (2 * Dm * V if not frozen else 0) + L * layer_trained
    t_optimizer = (
        trained / world * 16 * 2 / (gpu.hbm * eff.hbm)
    )  # fp32 master, grad, m, v read and written
    if model_offload:
        # the step on the host; the root's copies (embeddings, lm_head) are not hidden
        t_optimizer = trained / world * HOST_ADAMW_SECONDS_PER_PARAM
        if zero3:  # the boundary's gradient copies and the weights' copy up (and the root's backward copies)
            root = 0 if frozen else 2 * Dm * V
            copies = zero3_copy_bytes(trained, world)[1] + zero3_copy_bytes(root, world)[0]
        else:
            copies = _host_copy_bytes(2 * Dm * V, world, frozen)
        t_optimizer += copies / HOST_LINK_BYTES_PER_S
    parts = {
        "gemm": L * t_gemm,
        "attention": L * t_attention,
        "attention_tiles": L * t_tiles,
        "all_to_all": L * t_a2a,
        "ring": L * t_ring,
        "fsdp_offload_exposed": L * hidden_behind,
        "offload_restore": (L - 1) * (t_checkpoint + t_disk),
        "loss": head / (gpu.flops * eff.gemm),
        "optimizer": t_optimizer,
    }
    if settings.offload == "disk":
        parts["disk_offload_copy"] = (
            L - 1
        ) * t_checkpoint  # the forward's synchronous copy to the host
    return StepTime(parts=parts, seq_len=S, sp_size=P)
