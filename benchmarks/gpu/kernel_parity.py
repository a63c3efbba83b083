"""GPU parity: the CUDA attention kernels, UPipe and the fused block against the fp32 CPU reference; offload for real.

    python benchmarks/gpu/kernel_parity.py [--out benchmarks/results/gpu] [--quick] [--cpu-dry-run]

Sections (each writes into <out>/kernels.json as soon as it is done; a failure is recorded and the next runs):
1. fake_pg: what the fake process group does with real tensors on this torch (copies, or leaves outputs empty).
2. kernel_parity: every kernel "auto" can choose on this GPU (`hf_upipe.ops.kernels.available_kernels`), forward
   (out, lse) and backward (dq, dk, dv), against `SdpaCpuKernel` in fp32 on the CPU, on random inputs: fp32 / fp16
   / bf16, GQA, odd lengths, head dims that need padding, non-causal.
3. upipe_op: `upipe_attention` on CUDA against the same op on the CPU in fp32, at sp=1 and as rank 0 of a fake
   8-rank group (both devices under the same fake group, so both compute the same function), Ulysses mode and
   heads_per_chunk=1, with k/v replication.
4. model_parity: a 2-layer Llama (loss and every gradient), CUDA bf16 against CPU fp32: transformers' "sdpa" as the
   control (the bf16 error a plain model has), our registered "upipe" (c=1, Ulysses mode) and the fused block in
   both backward modes, at sp=1 and under the fake 8-rank group. Passes when each error is within 3x the control's.
5. offload: a 4-layer Llama at 32K tokens with checkpointing, offload "none" vs "cpu" (pinned host buffers, side
   stream, prefetch): gradients compared bit for bit (with deterministic algorithms; two "none" runs first show
   whether the GPU's kernels are deterministic), every checkpointed input but the last offloaded ((L - 1) * s *
   hidden * 2 bytes), and the allocator's peak saving against the saving tensor accounting predicts (the tracked
   peaks of the two runs: the backward copies inputs back, one layer ahead, so less than all of them is saved).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PeakMemory, Results, fake_rank, parse, parser, rel_error, sync  # noqa: E402

import hf_upipe  # noqa: E402,F401  (registers "upipe")
from hf_upipe.ops.kernels import SdpaCpuKernel, available_kernels, get_kernel  # noqa: E402

TOL = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # ||err|| / ||ref||


def fake_pg(res: Results, device) -> None:
    import torch.distributed as dist

    with fake_rank(4, device):
        x = torch.arange(8.0)
        out = torch.full((8,), -1.0)
        dist.all_to_all_single(out, x)
        gathered = torch.full((32,), -1.0)
        dist.all_gather_into_tensor(gathered, x)
        sync(device)
        res.put(
            "fake_pg",
            {
                "all_to_all_copies_input": bool(torch.equal(out, x)),
                "all_gather_copies_input": bool(torch.equal(gathered, x.repeat(4))),
            },
        )


def kernel_cases(quick: bool, dry: bool):
    S = 256 if dry else 4096
    cases = [  # (dtype, B, S, h, hk, D, causal)
        (torch.bfloat16, 1, S, 8, 2, 128, True),
        (torch.bfloat16, 2, S // 2 + 37, 4, 4, 64, True),  # odd length
        (torch.float16, 1, S, 8, 8, 64, True),
        (torch.bfloat16, 1, S // 4, 4, 1, 100, True),  # head dim padded to 104
        (torch.bfloat16, 1, S // 4, 4, 2, 256, True),
        (torch.float32, 1, S // 2 + 5, 8, 2, 128, True),  # efficient kernel, lse padded to 32
        (torch.bfloat16, 1, S // 4, 4, 2, 64, False),
    ]
    return cases[:3] if quick else cases


def kernel_parity(res: Results, device, quick: bool, dry: bool) -> None:
    ref_kernel, rows = SdpaCpuKernel(), []
    for dtype, B, S, h, hk, D, causal in kernel_cases(quick, dry):
        g = torch.Generator().manual_seed(S + h + D)
        q, k, v = (torch.randn(B, S, n, D, generator=g) for n in (h, hk, hk))
        dout = torch.randn(B, S, h, D, generator=g)
        scale = D**-0.5
        # reference: fp32 on the CPU, from the same (rounded to dtype) inputs
        q32, k32, v32, do32 = (t.to(dtype).float() for t in (q, k, v, dout))
        out_r, lse_r = ref_kernel.forward(q32, k32, v32, scale=scale, causal=causal)
        grads_r = ref_kernel.backward(do32, q32, k32, v32, out_r, lse_r, scale=scale, causal=causal)
        for name in available_kernels(device, dtype):
            row = dict(
                kernel=name,
                dtype=str(dtype).replace("torch.", ""),
                B=B,
                S=S,
                h=h,
                hk=hk,
                D=D,
                causal=causal,
            )
            try:
                kern = get_kernel(name, device, dtype)
                qd, kd, vd, dod = (t.to(device, dtype) for t in (q, k, v, dout))
                out, lse = kern.forward(qd, kd, vd, scale=scale, causal=causal)
                dq, dk, dv = kern.backward(dod, qd, kd, vd, out, lse, scale=scale, causal=causal)
                sync(device)
                row.update(
                    out=rel_error(out, out_r),
                    lse_max_abs=float((lse.float().cpu() - lse_r).abs().max()),
                    dq=rel_error(dq, grads_r[0]),
                    dk=rel_error(dk, grads_r[1]),
                    dv=rel_error(dv, grads_r[2]),
                    shapes_ok=tuple(out.shape) == (B, S, h, D)
                    and tuple(lse.shape) == (B, h, S)
                    and tuple(dk.shape) == (B, S, hk, D),
                )
                worst = max(row[key] for key in ("out", "dq", "dk", "dv"))
                row["passed"] = bool(
                    row["shapes_ok"] and worst <= TOL[dtype] and row["lse_max_abs"] <= 2e-2
                )
            except Exception as err:  # noqa: BLE001
                row.update(res.error(f"kernel_parity {row}", err), passed=False)
            rows.append(row)
            print("kernel", row, flush=True)
    res.put("kernel_parity", rows)


def upipe_op(res: Results, device, dry: bool) -> None:
    from hf_upipe.ops.upipe_attention import upipe_attention

    rows = []
    for world, s, h, hk in ((1, 2048, 16, 4), (8, 512, 16, 4), (8, 512, 32, 8)):
        if dry:
            s //= 8
        g = torch.Generator().manual_seed(world * 100 + hk)
        q, k, v = (torch.randn(1, s, n, 64, generator=g) for n in (h, hk, hk))
        dout = torch.randn(1, s, h, 64, generator=g)
        for c in (1, None):
            row = dict(world=world, s=s, h=h, hk=hk, D=64, heads_per_chunk=c)
            try:
                outs = {}
                for dev, dtype in ((torch.device("cpu"), torch.float32), (device, torch.bfloat16)):
                    ctx = fake_rank(world, dev) if world > 1 else torch.device(dev)
                    with ctx as group:
                        grp = group if world > 1 else None
                        leaves = [t.to(dev, dtype).detach().requires_grad_() for t in (q, k, v)]
                        out = upipe_attention(*leaves, group=grp, heads_per_chunk=c)
                        out.backward(dout.to(dev, dtype))
                        sync(dev)
                        outs[dev.type] = [out.detach().cpu()] + [t.grad.cpu() for t in leaves]
                ref, got = outs["cpu"], outs[device.type]
                errors = [rel_error(a, b) for a, b in zip(got, ref)]
                row.update(
                    out=errors[0],
                    dq=errors[1],
                    dk=errors[2],
                    dv=errors[3],
                    passed=bool(max(errors) <= TOL[torch.bfloat16]),
                )
            except Exception as err:  # noqa: BLE001
                row.update(res.error(f"upipe_op {row}", err), passed=False)
            rows.append(row)
            print("upipe", row, flush=True)
    res.put("upipe_op", rows)


def _tiny_llama(dry: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256 if dry else 512,
        intermediate_size=512 if dry else 1408,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32 if dry else 64,
        num_hidden_layers=2,
        vocab_size=1000,
        max_position_embeddings=65536,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
    )


MODEL_VARIANTS = (  # (label, attn_implementation, heads_per_chunk, fused, fused_backward)
    ("sdpa (control)", "sdpa", None, False, None),
    ("upipe c=1", "upipe", 1, False, None),
    ("upipe Ulysses mode", "upipe", None, False, None),
    ("fused recompute c=1", "upipe", 1, True, "recompute"),
    ("fused save c=1", "upipe", 1, True, "save"),
)


def _model_run(config, state, attn, c, fused, mode, world, s, dev, dtype, ids, labels):
    """(loss, {name: grad}) of one step on `dev` in `dtype` (rank 0 of a fake world when world > 1)."""
    from transformers import LlamaForCausalLM

    from hf_upipe import distributed as sp
    from hf_upipe.config import UPipeConfig
    from hf_upipe.prepare import prepare_model
    from hf_upipe.training.loss import shard_loss_sum

    ctx = fake_rank(world, dev) if world > 1 else torch.device(dev)
    with ctx as group:
        cfg = copy.deepcopy(config)
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(state)
        model.to(dev, dtype)
        if world > 1:
            sp.init_sequence_parallel(group=group, heads_per_chunk=c)
        try:
            if attn == "upipe":
                prepare_model(
                    model,
                    UPipeConfig(
                        fused_attention=fused,
                        fused_backward=mode or "recompute",
                        tiled_mlp=False,
                        auto=False,
                    ),
                )
            elif world > 1:
                raise ValueError("the sdpa control runs without SP")
            model.train()
            inputs = {
                "input_ids": ids.to(dev),
                "position_ids": torch.arange(s, device=dev).unsqueeze(0),
                "attention_mask": torch.ones(1, s, dtype=torch.long, device=dev),
            }
            if attn == "upipe":
                loss, _ = shard_loss_sum(model, inputs, labels.to(dev))
            else:
                loss = torch.nn.functional.cross_entropy(
                    model(**inputs).logits.float().flatten(0, 1),
                    labels.to(dev).flatten(),
                    reduction="sum",
                )
            loss.backward()
            sync(dev)
            return float(loss), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
        finally:
            if world > 1:
                sp.reset_sequence_parallel()


def model_parity(res: Results, device, dry: bool) -> None:
    from transformers import LlamaForCausalLM

    config = _tiny_llama(dry)
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    rows, control = [], {}
    for world in (1, 8):
        s = 256 if dry else 2048  # tokens of this rank
        g = torch.Generator().manual_seed(world)
        ids = torch.randint(0, config.vocab_size, (1, s), generator=g)
        labels = torch.randint(0, config.vocab_size, (1, s), generator=g)
        for label, attn, c, fused, mode in MODEL_VARIANTS:
            if attn == "sdpa" and world > 1:
                continue
            row = dict(world=world, s=s, variant=label)
            try:
                ref = _model_run(
                    config,
                    state,
                    attn,
                    c,
                    fused,
                    mode,
                    world,
                    s,
                    torch.device("cpu"),
                    torch.float32,
                    ids,
                    labels,
                )
                got = _model_run(
                    config,
                    state,
                    attn,
                    c,
                    fused,
                    mode,
                    world,
                    s,
                    device,
                    torch.bfloat16,
                    ids,
                    labels,
                )
                grad_errors = {n: rel_error(got[1][n], ref[1][n]) for n in ref[1]}
                row.update(
                    loss_rel=abs(got[0] - ref[0]) / abs(ref[0]),
                    grad_max=max(grad_errors.values()),
                    grad_worst=max(grad_errors, key=grad_errors.get),
                    grads_compared=len(grad_errors),
                )
                if attn == "sdpa":
                    control = row
                base = control or row
                row["passed"] = bool(
                    row["loss_rel"] <= max(3 * base["loss_rel"], 1e-3)
                    and row["grad_max"] <= max(3 * base["grad_max"], 1e-3)
                )
            except Exception as err:  # noqa: BLE001
                row.update(res.error(f"model_parity {row}", err), passed=False)
            rows.append(row)
            print("model", row, flush=True)
    res.put("model_parity", rows)


def _offload_step(model, target, ids, labels):
    from hf_upipe.planning.tracker import MemoryTracker
    from hf_upipe.training.loss import shard_loss_sum
    from hf_upipe.training.offload import offload_checkpoints

    model.zero_grad(set_to_none=True)
    s = ids.shape[1]
    inputs = {"input_ids": ids, "position_ids": torch.arange(s, device=ids.device).unsqueeze(0)}
    with (
        PeakMemory(ids.device) as peak,
        MemoryTracker() as tracker,
        offload_checkpoints(model, target, min_bytes=0) as store,
    ):
        loss, _ = shard_loss_sum(model, inputs, labels)
        loss.backward()
        del loss
    offloaded = store.bytes_offloaded if store is not None else 0
    peak.tracked = (
        tracker.peak_bytes
    )  # the tensor peak the planner counts (offloaded copies as freed)
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}, peak, offloaded


def offload(res: Results, device, dry: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, s, hidden = 4, (1024 if dry else 32768), (256 if dry else 1024)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=32000,
        max_position_embeddings=s,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "upipe"  # sp=1: the "auto" kernel of this device
    previous = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        model.train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 32000, (1, s), generator=g).to(device)
        labels = torch.randint(0, 32000, (1, s), generator=g).to(device)
        _offload_step(model, "none", ids, labels)  # warm-up: kernels, cuBLAS handles, host pool
        _offload_step(model, "cpu", ids, labels)
        none_a, peak_a, _ = _offload_step(model, "none", ids, labels)
        none_b, _, _ = _offload_step(model, "none", ids, labels)
        cpu_g, peak_c, offloaded = _offload_step(model, "cpu", ids, labels)
        expected = (
            peak_a.tracked - peak_c.tracked
        )  # what tensor accounting says offloading saves at the peak
        row = dict(
            layers=layers,
            s=s,
            hidden=hidden,
            deterministic_baseline=all(torch.equal(none_a[n], none_b[n]) for n in none_a),
            offload_bit_identical=all(torch.equal(none_a[n], cpu_g[n]) for n in none_a),
            offload_max_rel=max(rel_error(cpu_g[n], none_a[n]) for n in none_a),
            bytes_offloaded=offloaded,
            offloadable_bytes=(layers - 1) * s * hidden * 2,
            tracked_peak_none=peak_a.tracked,
            tracked_peak_cpu=peak_c.tracked,
            expected_saving_bytes=expected,
            peak_none=peak_a.to_dict(),
            peak_cpu=peak_c.to_dict(),
            measured_saving_bytes=peak_a.allocated - peak_c.allocated,
        )
        # (on the CPU "cpu" offload is a no-op: tensors already in host memory stay)
        row["passed"] = bool(
            row["offload_bit_identical"]
            and (
                device.type != "cuda"
                or (
                    offloaded == row["offloadable_bytes"]
                    and row["measured_saving_bytes"] >= 0.9 * expected
                )
            )
        )
    except Exception as err:  # noqa: BLE001
        row = dict(res.error("offload", err), passed=False)
    finally:
        torch.use_deterministic_algorithms(previous)
    print("offload", row, flush=True)
    res.put("offload", row)


def main(argv=None) -> int:
    args, device = parse(parser(__doc__), argv)
    res = Results(os.path.join(args.out, "kernels.json"), device)
    for name, fn in (
        ("fake_pg", lambda: fake_pg(res, device)),
        ("kernel_parity", lambda: kernel_parity(res, device, args.quick, args.cpu_dry_run)),
        ("upipe_op", lambda: upipe_op(res, device, args.cpu_dry_run)),
        ("model_parity", lambda: model_parity(res, device, args.cpu_dry_run)),
        ("offload", lambda: offload(res, device, args.cpu_dry_run)),
    ):
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            res.put(name, res.error(name, err))
    sections = res.doc["sections"]
    failed = [
        (name, row)
        for name, rows in sections.items()
        if isinstance(rows, list)
        for row in rows
        if not row.get("passed", True)
    ]
    if isinstance(sections.get("offload"), dict) and not sections["offload"].get("passed", False):
        failed.append(("offload", sections["offload"]))
    print(
        f"\nkernels: {len(failed)} failed case(s); errors: {len(res.doc['errors'])}; wrote {res.path}"
    )
    for name, row in failed:
        print("FAILED", name, row)
    return 1 if failed or res.doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
