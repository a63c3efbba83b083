"""Soak: a tiny model trained for --steps CPU steps while random ranks are killed (SIGKILL) at random moments; every
restart resumes from the last checkpoint, often at another (SP, ring, DP) layout; the final weights are compared
with the same schedule run without kills and with an uninterrupted run at one layout.

    PYTHONPATH=$PWD python benchmarks/soak.py            # about 30 minutes on a shared 2-core machine
    PYTHONPATH=$PWD python benchmarks/soak.py --steps 200 --kills 3 --out /tmp/soak.json   # a quick look

What it runs: `--steps` optimizer steps of a one-layer Llama (hidden 32, 4 heads, 2 key-value heads, fp32, no
dropout) on 4 rows of 32 random tokens per step (the global batch; a function of the step, so the data position is
the step), AdamW with a warmup schedule, under hf_upipe's sequence parallelism (`init_sequence_parallel`,
`prepare_model`, `shard_batch`, `UPipeRuntime.loss`; gradients averaged over all ranks as DDP does). Layouts: SP 2
on 2 processes, SP 2 with a ring of 2 on 2, SP 2 x DP 2 on 4, SP 4 (ring 2) on 4. A checkpoint every
--save-every steps (model, optimizer, scheduler, random state; written to a staging folder, given hf_upipe's
manifest and layout record, renamed). The supervisor:
1. starts the workers at a layout and, once they step, after a random delay of 0 to --max-wait seconds SIGKILLs one
   random rank (then the rest, which would wait in a collective); this repeats --kills times, so the kills land at
   random moments of steps and saves;
2. restarts from the last complete checkpoint (`verify_checkpoint`, `check_resume_layout`), at another layout
   with probability 1/2, and finally lets the run finish;
3. runs the references (--references): "replay", the layout schedule the soak ended with (the same layouts from
   the same steps) without kills; "sp2" and "sp2_dp2", the whole training without interruption at one layout.
Reported (JSON, --out; the soak phase's record is kept in <work>/soak_phase.json, and --report-only writes the
report from <work> again): the kills survived, the steps lost (trained after the last checkpoint, then lost), the
largest absolute weight difference (and relative to the tensor's largest value) against each reference (replay,
if every resume is exact: 0), the difference between the two uninterrupted runs when both ran (the rounding of
another layout, amplified by the training), the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

LAYOUTS = {  # name -> (processes, sp_size, ring_size)
    "sp2": (2, 2, 1),
    "sp2_ring2": (2, 2, 2),
    "sp2_dp2": (4, 2, 1),
    "sp4_ring2": (4, 4, 2),
}
GLOBAL_BATCH, SEQ, VOCAB = 4, 32, 64


# ---- worker --------------------------------------------------------------------------------------------------------
def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


def _batch(step: int) -> dict:
    """The global batch of `step` (a function of the step alone): [4, 32] tokens, labels the tokens."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _save(folder: str, step: int, model, opt, sched, layout, rank: int) -> None:
    """Checkpoint `step` into `<folder>/.staging-step-N`, manifest and layout record, renamed to `step-N`."""
    import torch
    import torch.distributed as dist

    from hf_upipe.training.checkpoint import write_manifest
    from hf_upipe.training.checkpoint_layout import write_layout

    final = os.path.join(folder, f"step-{step}")
    staging = os.path.join(folder, f".staging-step-{step}")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }
        torch.save(state, os.path.join(staging, "state.pt"))
        write_layout(staging, layout)
    dist.barrier()
    write_manifest(staging)
    if rank == 0:
        os.replace(staging, final)
        for name in os.listdir(folder):  # keep the newest two
            if name.startswith("step-") and int(name[5:]) < step - 1:
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    dist.barrier()


def _latest(folder: str) -> str | None:
    steps = [int(n[5:]) for n in os.listdir(folder) if n.startswith("step-")]
    return os.path.join(folder, f"step-{max(steps)}") if steps else None


def worker(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from hf_upipe import UPipeConfig, init_sequence_parallel, prepare_model, shard_batch
    from hf_upipe.training.checkpoint import verify_checkpoint
    from hf_upipe.training.checkpoint_layout import (
        TrainingLayout,
        check_resume_layout,
        model_fingerprint,
    )
    from hf_upipe.training.runtime import UPipeRuntime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    _, sp, ring = LAYOUTS[args.layout]
    model = _model()
    cfg = UPipeConfig(sp_size=sp, ring_size=ring, heads_per_chunk=1)
    state = init_sequence_parallel(sp, ring_size=ring)
    prepare_model(model, cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    upipe = UPipeRuntime(cfg, state, world_size=world, device="cpu")
    rows = GLOBAL_BATCH // state.dp_size
    layout = TrainingLayout(sp, ring, state.dp_size, world, rows, 1, model_fingerprint(model))
    step, last = 0, _latest(args.run)
    if last:
        verify_checkpoint(last)
        check_resume_layout(last, layout)
        saved = torch.load(os.path.join(last, "state.pt"), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        step = saved["step"]
    params = [p for p in model.parameters()]
    stop = min(args.steps, args.until or args.steps)
    while step < stop:
        full = _batch(step)
        mine = {k: v[state.dp_rank * rows : (state.dp_rank + 1) * rows] for k, v in full.items()}
        shard = shard_batch(mine, state.sp_rank, state.sp_size)
        loss = upipe.loss(model, shard, upipe.count([shard]))
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # [all parameters] as DDP's bucket
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if rank == 0:
            with open(os.path.join(args.run, "progress"), "w") as f:
                f.write(str(step))
        if step % args.save_every == 0 or step == stop:
            _save(args.run, step, model, opt, sched, layout, rank)
    dist.barrier()
    dist.destroy_process_group()


# ---- supervisor ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run: str, layout: str, args, until: int = 0) -> list[subprocess.Popen]:
    world = LAYOUTS[layout][0]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--run", run, "--layout", layout]
    cmd += ["--steps", str(args.steps), "--save-every", str(args.save_every), "--until", str(until)]
    log = open(os.path.join(run, "workers.log"), "a")
    return [
        subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log, stderr=log)
        for r in range(world)
    ]


def _wait(procs: list[subprocess.Popen], what: str) -> None:
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{what}: workers exited with {codes}; see workers.log")


def _progress(run: str) -> int:
    try:
        with open(os.path.join(run, "progress")) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _clear_progress(run: str) -> None:
    if os.path.exists(os.path.join(run, "progress")):
        os.remove(os.path.join(run, "progress"))


def _ckpt_step(run: str) -> int:
    last = _latest(run)
    return int(os.path.basename(last)[5:]) if last else 0


def soak(run: str, args, rng: random.Random) -> dict:
    """Kill random ranks at random moments, resume (often at another layout); returns the schedule and counts."""
    layout, schedule, kills, lost = "sp2", [], [], 0
    for _ in range(args.kills):
        schedule.append((_ckpt_step(run), layout))
        _clear_progress(run)
        procs = _launch(run, layout, args)
        # wait for the first step: the kill lands in a step or a save, not in the imports
        while _progress(run) == 0 and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        deadline = time.monotonic() + rng.uniform(0.0, args.max_wait)
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.02)
        if any(p.poll() is not None for p in procs):  # finished (or failed) before the kill
            _wait(procs, "soak")
            break
        victim = rng.randrange(len(procs))
        reached = _progress(run)
        procs[victim].send_signal(signal.SIGKILL)
        time.sleep(0.5)
        for p in procs:  # the survivors would wait in a collective: end them too
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        saved = _ckpt_step(run)
        lost += max(0, reached - saved)
        kills.append({"layout": layout, "rank": victim, "step": reached, "checkpoint": saved})
        print(
            f"killed rank {victim} of {layout} at step {reached}; resuming from step {saved}",
            flush=True,
        )
        if rng.random() < 0.5:
            layout = rng.choice([k for k in LAYOUTS if k != layout])
    if _ckpt_step(run) < args.steps:
        schedule.append((_ckpt_step(run), layout))
        _wait(_launch(run, layout, args), "soak, last leg")
    return {"schedule": _merged(schedule), "kills": kills, "steps_lost": lost}


def _merged(schedule: list) -> list:
    """The (first step, layout) legs, consecutive legs at the same layout merged."""
    out = []
    for start, layout in schedule:
        if out and out[-1][1] == layout:
            continue
        if out and out[-1][0] == start:  # the earlier leg made no checkpoint
            out.pop()
            if out and out[-1][1] == layout:
                continue
        out.append((start, layout))
    return out


def replay(run: str, schedule: list, args) -> None:
    """The soak's layouts from the same steps, without kills."""
    ends = [start for start, _ in schedule[1:]] + [args.steps]
    for (start, layout), end in zip(schedule, ends):
        _wait(_launch(run, layout, args, until=end), f"replay leg {layout} {start}-{end}")


def _final(run: str) -> dict:
    import torch

    return torch.load(os.path.join(run, f"step-{_ckpt_step(run)}", "state.pt"), weights_only=False)


def _difference(a: dict, b: dict) -> dict:
    worst_abs = worst_rel = 0.0
    for name, x in a["model"].items():
        y = b["model"][name]
        d = (x - y).abs().max().item()
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / max(y.abs().max().item(), 1e-12))
    return {"max_abs": worst_abs, "max_rel_to_tensor_max": worst_rel}


REFERENCES = {
    "sp2": [(0, "sp2")],
    "sp2_dp2": [(0, "sp2_dp2")],
}  # uninterrupted runs, beside "replay"


def _report(args, phase: dict, references: list[str]) -> dict:
    """The report from the soak phase's record and the final checkpoints of the soak and the reference runs."""
    final = _final(os.path.join(args.work, "soak"))
    assert final["step"] == args.steps, final["step"]
    report = {
        **phase,
        "steps": args.steps,
        "save_every": args.save_every,
        "kills_survived": len(phase["kills"]),
        "layouts_used": sorted({layout for _, layout in phase["schedule"]}),
    }
    finals = {}
    for name in references:
        finals[name] = _final(os.path.join(args.work, name))
        assert finals[name]["step"] == args.steps, (name, finals[name]["step"])
        report[f"against_{name}"] = _difference(final, finals[name])
    if (
        "sp2" in finals and "sp2_dp2" in finals
    ):  # the rounding of another layout, amplified by training
        report["sp2_against_sp2_dp2"] = _difference(finals["sp2"], finals["sp2_dp2"])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="sp2", help=argparse.SUPPRESS)
    ap.add_argument("--until", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument(
        "--max-wait", type=float, default=25.0, help="seconds of training before a kill, at most"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--references",
        default="replay,sp2,sp2_dp2",
        help="the runs to compare with: replay (the soak's layouts from the same steps, no kills), sp2 and "
        "sp2_dp2 (uninterrupted at one layout)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="write the report from --work (its soak_phase.json and the references' final checkpoints)",
    )
    ap.add_argument("--work", default="/tmp/hf_upipe_soak")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "soak.json")
    )
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    references = [r for r in args.references.split(",") if r]
    phase_file = os.path.join(args.work, "soak_phase.json")
    if not args.report_only:
        t0 = time.time()
        shutil.rmtree(args.work, ignore_errors=True)
        for name in ("soak", *references):
            os.makedirs(os.path.join(args.work, name))
        phase = soak(os.path.join(args.work, "soak"), args, random.Random(args.seed))
        phase["soak_seconds"] = round(time.time() - t0, 1)
        with open(phase_file, "w") as f:
            json.dump(phase, f, indent=1)
        for name in references:
            schedule = phase["schedule"] if name == "replay" else REFERENCES[name]
            replay(os.path.join(args.work, name), schedule, args)
        phase["total_seconds"] = round(time.time() - t0, 1)
    else:
        with open(phase_file) as f:
            phase = json.load(f)
    report = _report(args, phase, references)
    report["command"] = " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "kills"}, indent=1))


if __name__ == "__main__":
    main()
