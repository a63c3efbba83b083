"""Long-context LoRA (or full) fine-tuning with UPipe in a custom loop under `accelerate launch`: the main example.

Run on any laptop (2 CPU processes, one sequence-parallel group, no downloads, a couple of minutes):
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/finetune_long_context.py
On one 8-GPU node with FSDP2 and a real model:
    UPIPE_TILED_MLP=1 UPIPE_OFFLOAD=cpu accelerate launch --config_file accelerate_configs/fsdp2_1node_8gpu.yaml \
        examples/finetune_long_context.py --model /path/to/llama --data corpus.jsonl --seq-len 1000000 --checkpointing

Default task: passkey retrieval over bytes (a byte-level tokenizer, nothing to download). A digit is stated near the
start of a 1K-byte row of random text and asked for in the second half; only the answers are targets, so the loss
can only fall below ln 10 = 2.30 (guessing the digit) once attention reaches across the whole sequence, i.e. over
every rank's shard. The default model is a one-layer Llama built from a config, trained with LoRA (rank 32 on every
projection; the embeddings and lm_head, random at the start, are trained fully), AdamW with a warmup and cosine decay
and gradient clipping (a recipe that learns the task on every seed tried, whatever the process count). At the end
it measures greedy answers on held-out rows: the first answer of each row can only be read from the passkey, 500 or
more tokens back in the first rank's shard (chance: 10%). `--data` takes local text files.

The loop is the `UPipePlugin` flow (hf_upipe/training/plugin.py): `plugin.prepare` sets up the SP groups,
the fused attention block, accelerate's FSDP2/DDP and a loader of per-rank shards, and returns the run's
`UPipeRuntime`: `upipe.loss(model, shard, n)` is the exact token mean over all ranks. Checkpoints (`--save-every`,
and the last step) hold the model as plain transformers/PEFT files (`model/`, loadable without hf_upipe) and
accelerate's state for `--resume`; each is written to a staging folder, given a manifest (size and SHA-256 of
every file) and renamed when complete, and `--resume` verifies the manifest before loading anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flags import check_flags, finished, latest_checkpoint, preflight  # noqa: E402

if (
    __name__ == "__main__"
):  # a bad flag, an earlier run or nothing to resume: one line, before torch is imported
    preflight(sys.argv[1:], "long_context")

import torch  # noqa: E402
from _common import (  # noqa: E402
    ByteTokenizer,
    add_common_flags,
    build_model,
    clear_run_dir,
    learning_rate,
    passkey_accuracy,
    passkey_dataset,
    plot_losses,
    point_adapter_to_base,
    run,
    run_dir,
    save_base,
    text_dataset,
    upipe_settings,
)
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from hf_upipe import UPipePlugin  # noqa: E402
from hf_upipe.training.checkpoint import verify_checkpoint, write_manifest  # noqa: E402
from hf_upipe.training.checkpoint_layout import (  # noqa: E402
    TrainingLayout,
    check_resume_layout,
    model_fingerprint,
    rng_file,
    write_layout,
)
from hf_upipe.training.save_errors import explained_save_errors  # noqa: E402


def save_checkpoint(
    accelerator, model, path: str, step: int, base: str | None = None, layout=None, losses=None
) -> None:
    """Model files (plain transformers/PEFT; a LoRA adapter names its `base` folder) + accelerate state + the
    run's layout (`upipe_layout.json`) + the losses of every step so far (`losses.json`: a resumed run's plot and
    summary cover the whole run), into a staging folder renamed at the end."""
    staging = os.path.join(os.path.dirname(path), f".staging-{os.path.basename(path)}")
    if accelerator.is_main_process and os.path.exists(staging):
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # full state dict (a collective under FSDP2)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(
            os.path.join(staging, "model"), state_dict=state_dict
        )
        point_adapter_to_base(os.path.join(staging, "model"), base)
    accelerator.save_state(os.path.join(staging, "accelerate_state"))
    if accelerator.is_main_process:
        with open(os.path.join(staging, "step.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(staging, "losses.json"), "w") as f:
            json.dump({str(k): v for k, v in sorted((losses or {}).items())}, f)
        if layout is not None:
            write_layout(staging, layout)
    accelerator.wait_for_everyone()  # every rank has written its part (its RNG state) before the manifest
    write_manifest(
        staging
    )  # size and SHA-256 of every file; returns on every rank once it is written
    if accelerator.is_main_process:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(staging, path)
    accelerator.wait_for_everyone()


def load_missing_random_states(folder: str, rank: int) -> None:
    """accelerate's `load_state` loads `random_states_<rank>.pkl`, and skips it silently when a checkpoint saved by
    fewer processes has none for this rank: load rank 0's then (every rank's generators are alike between steps)."""
    source = rng_file(folder, "random_states_{}.pkl", rank)
    if source is None or source == os.path.join(folder, f"random_states_{rank}.pkl"):
        return
    import random

    import numpy as np

    states = torch.load(source, weights_only=False)
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def resume_from(accelerator, resume: str, layout, steps_per_epoch: int, grad_accum: int):
    """Loads a checkpoint verified first (another global batch or model refused, with no collective: every rank
    raises); (step, epoch, batches to skip, the losses of the steps before it)."""
    check_resume_layout(resume, layout)
    verify_checkpoint(resume)  # every file as written (manifest), before anything is loaded
    accelerator.load_state(os.path.join(resume, "accelerate_state"))
    load_missing_random_states(os.path.join(resume, "accelerate_state"), accelerator.process_index)
    with open(os.path.join(resume, "step.json")) as f:
        step = json.load(f)["step"]
    losses = {}
    if os.path.isfile(os.path.join(resume, "losses.json")):  # (absent from older checkpoints)
        with open(os.path.join(resume, "losses.json")) as f:
            losses = {int(k): v for k, v in json.load(f).items() if int(k) <= step}
    epoch, skip = divmod(step * grad_accum, steps_per_epoch)
    accelerator.print(f"resumed from {resume} at step {step}")
    return step, epoch, skip, losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_flags(ap)
    args = ap.parse_args(argv)
    check_flags(
        args, "long_context"
    )  # impossible values (also checked before the imports, as __main__)
    settings = upipe_settings(args)  # flag combinations first: an error costs no process group
    tokenizer = ByteTokenizer()
    if args.data:
        data = text_dataset(args.data, tokenizer, args.seq_len)
    else:
        data = passkey_dataset(args.rows, args.seq_len, tokenizer, seed=args.seed)
    output_dir = run_dir(
        args, "long_context"
    )  # an earlier run: refused without --overwrite / --resume
    done = finished(args, output_dir, "long_context")
    if done is not None:  # resumed at --steps already: nothing trained, nothing written
        if os.environ.get("RANK", "0") == "0":
            print(done)
        return 0
    # CPU: MULTI_CPU over gloo; a seedable sampler gives the same order whatever the number of processes
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    clear_run_dir(output_dir, args, accelerator.is_main_process, accelerator.wait_for_everyone)
    plugin = UPipePlugin.from_flags(
        **settings
    )  # validated here, on every rank; errors name the flags

    model = build_model(
        args.model,
        tokenizer.vocab_size,
        lora=not args.full,
        lora_rank=args.lora_rank,
        seed=args.seed,
    )
    # a LoRA run's base, saved once in the run's folder (first rank); every adapter names it
    base = (
        save_base(args, tokenizer.vocab_size, output_dir) if accelerator.is_main_process else None
    )
    if args.checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    model.train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    loader = DataLoader(
        data, batch_size=1, shuffle=True, collate_fn=default_data_collator, drop_last=True
    )
    model, optimizer, loader, upipe = plugin.prepare(
        accelerator,
        model,
        optimizer,
        loader,
        pad_token_id=tokenizer.pad_token_id,
        output_dir=output_dir,
        checkpointing_fix="add --checkpointing",
    )

    step, epoch, skip, losses = 0, 0, 0, {}
    state = upipe.state
    layout = TrainingLayout(  # recorded in every checkpoint; another global batch or model is refused on resume
        sp_size=state.sp_size,
        ring_size=state.ring_size,
        dp_size=state.dp_size,
        world_size=accelerator.num_processes,
        micro_batch=1,
        grad_accum=args.grad_accum,
        model=model_fingerprint(model),
    )
    resume = (
        latest_checkpoint(output_dir, "long_context") if args.resume == "latest" else args.resume
    )
    if resume:
        step, epoch, skip, losses = resume_from(
            accelerator, resume, layout, len(loader), args.grad_accum
        )
    plain_loader = loader.dataloader
    accelerator.print(
        f"{accelerator.num_processes} processes: SP {state.sp_size} x DP {state.dp_size}, "
        f"heads_per_chunk={upipe.config.heads_per_chunk}, {'full' if args.full else 'LoRA'} fine-tune, "
        f"{args.seq_len} tokens per row"
    )

    bar = tqdm(
        total=args.steps, initial=step, disable=not accelerator.is_main_process, desc="train"
    )
    tokens, t0 = 0, time.perf_counter()
    while step < args.steps:
        loader.dataloader = (
            accelerator.skip_first_batches(plain_loader, skip) if skip else plain_loader
        )
        loader.set_epoch(epoch)
        for window in upipe.windows(loader, args.grad_accum):
            n = upipe.count(window)
            total = 0.0
            for i, shard in enumerate(window):
                sync = (
                    contextlib.nullcontext() if i == len(window) - 1 else accelerator.no_sync(model)
                )
                with sync, upipe.step(model):
                    loss = upipe.loss(model, shard, n)
                    accelerator.backward(loss)
                total += loss.item() / accelerator.num_processes
                tokens += shard["input_ids"].numel()
            for group in (
                optimizer.param_groups
            ):  # set here, not by a scheduler: resuming at any step is exact
                group["lr"] = learning_rate(args, step)
            if args.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            summed = accelerator.reduce(
                torch.tensor(total, device=accelerator.device), "sum"
            ).item()
            losses[step] = summed
            elapsed = time.perf_counter() - t0
            peak = (
                torch.cuda.max_memory_allocated() / 2**30
                if torch.cuda.is_available()
                else __import__("resource").getrusage(__import__("resource").RUSAGE_SELF).ru_maxrss
                / 2**20
            )
            bar.set_postfix(
                loss=f"{summed:.3f}",
                tok_s=f"{tokens * accelerator.num_processes / elapsed:.0f}",
                peak_gib=f"{peak:.2f}",
            )
            bar.update(1)
            if args.save_every and step % args.save_every == 0 and step < args.steps:
                with explained_save_errors(output_dir, should_save=accelerator.is_main_process):
                    save_checkpoint(
                        accelerator,
                        model,
                        os.path.join(output_dir, f"step-{step}"),
                        step,
                        base,
                        layout,
                        losses,
                    )
            if step >= args.steps:
                break
        epoch, skip = epoch + 1, 0
    bar.close()
    with explained_save_errors(output_dir, should_save=accelerator.is_main_process):  # a full disk
        save_checkpoint(
            accelerator, model, os.path.join(output_dir, f"step-{step}"), step, base, layout, losses
        )
    accuracy = None
    if not args.data and args.eval_rows:
        held_out = passkey_dataset(args.eval_rows, args.seq_len, tokenizer, seed=10_000 + args.seed)
        accuracy = passkey_accuracy(model, held_out, upipe)
    if accelerator.is_main_process:
        first = [losses[s] for s in sorted(losses)[:10]]
        last = [losses[s] for s in sorted(losses)[-10:]]
        guess = "" if args.data else " (guessing the digit: ln 10 = 2.303)"
        plot = plot_losses(
            losses, os.path.join(output_dir, "loss.png"), None if args.data else 2.303
        )
        print(
            f"loss: first {len(first)} steps {sum(first) / len(first):.3f}, last {len(last)} steps "
            f"{sum(last) / len(last):.3f}{guess}; saved {output_dir}/step-{step}/model (plain "
            f"{'transformers' if args.full else 'PEFT'} files)"
            + (f", curve {plot}" if plot else " (pip install matplotlib: a loss curve)")
        )
        if accuracy is not None:
            print(
                f"passkey retrieval on {args.eval_rows} held-out rows: first answer {accuracy['first_answer']:.0%} "
                f"(read from the first rank's shard; chance 10%), all answers {accuracy['all_answers']:.0%}"
            )
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump(
                    {
                        "losses": losses,
                        "sp_size": state.sp_size,
                        "dp_size": state.dp_size,
                        "accuracy": accuracy,
                    },
                    f,
                )
    accelerator.wait_for_everyone()  # rank 0 may still be writing: tear the group down together
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    run(main)
