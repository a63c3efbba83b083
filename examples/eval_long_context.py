"""Passkey retrieval of the main example's adapter at a length you choose: teacher-forced scoring and generation.

Run after the main example (2 CPU processes, one sequence-parallel group; or `python` for one process):
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/eval_long_context.py \
        --adapter runs/long_context-lora/step-300/model --length 1024 --rows 16

It loads the base model the adapter names (the main example saves it in its run's folder; else it rebuilds the
tiny Llama from its config and `--seed`) and the PEFT adapter the main example saved, and scores held-out passkey
rows of `--length` bytes (the main example's held-out seed, 10000 + `--seed`) two ways:
- teacher-forced: one sharded forward pass per row ("upipe" attention across the SP group); the log-probability
  of each answer digit (the digit after "?"), the perplexity over the answer tokens, and accuracy = the argmax is
  the digit, of the first answer of each row (readable only from the passkey near the start) and of all answers;
- generated: the row up to its first "?" as the prompt, `--new-tokens` greedy tokens by `hf_upipe.generate`
  (each rank prefills its shard of the prompt and keeps that shard's KV cache); accuracy = the first generated
  token is the passkey. In one process `model.generate` does it (hf_upipe.generate needs SP).
Every process count gives the same numbers (the same tokens, log-probabilities equal to fp32 rounding). The
results (and tokens/s of each way) are printed once, from the first rank, and written to `--output` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import default_data_collator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ByteTokenizer, build_model, passkey_dataset, run  # noqa: E402

import hf_upipe  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--adapter",
        default="runs/long_context-lora/step-300/model",
        help="the PEFT adapter folder the main example saved (default: its 300-step run)",
    )
    ap.add_argument(
        "--length", type=int, default=1024, help="bytes (tokens) per row (default 1024: as trained)"
    )
    ap.add_argument("--rows", type=int, default=16, help="held-out passkey rows (default 16)")
    ap.add_argument(
        "--new-tokens", type=int, default=2, help="greedy tokens generated per row (default 2)"
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the main example's --seed (base model and held-out rows)",
    )
    ap.add_argument("--output", default=None, help="write the results here as JSON (first rank)")
    args = ap.parse_args(argv)
    for name in ("length", "rows", "new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1"
            )
    if args.length < 16:
        raise ValueError(f"--length {args.length}: a passkey row needs at least 16 bytes")
    if not os.path.isfile(os.path.join(args.adapter, "adapter_config.json")):
        raise ValueError(
            f"--adapter {args.adapter}: no adapter_config.json there; train first (the main example saves "
            "runs/long_context-lora/step-300/model) or pass the folder of a saved PEFT adapter"
        )
    return args


def load_model(args, vocab_size: int):
    """The adapter's base (the folder its `base_model_name_or_path` names, which the main example saves in its
    run's folder; else the main example's base rebuilt from its config and seed), with the adapter, in eval mode."""
    from peft import PeftModel

    with open(os.path.join(args.adapter, "adapter_config.json")) as f:
        saved = json.load(f).get("base_model_name_or_path")
    path = saved if saved and os.path.isfile(os.path.join(saved, "config.json")) else None
    base = build_model(path, vocab_size, lora=False, lora_rank=0, seed=args.seed)
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        model = PeftModel.from_pretrained(base, args.adapter)
    hf_upipe.prepare_model(model)
    return model.eval()


def score_row(model, row: dict, state, length: int, device) -> dict[str, torch.Tensor]:
    """Teacher-forced: log-probability [n] of each answer digit and whether the argmax is it [n], in row order;
    the same on every rank of the SP group (each rank scores its shard, the answers are summed over the group)."""
    batch = default_data_collator([row])
    if state is not None:
        batch = hf_upipe.shard_batch(batch, state.sp_rank, state.sp_size)
    else:
        labels = batch.pop("labels")  # [1, L]: the next token of position t is labels[t + 1]
        batch["shift_labels"] = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
        batch["position_ids"] = torch.arange(length)[None]
    batch = {k: v.to(device) for k, v in batch.items()}
    targets = batch["shift_labels"][0]  # [s]: the next token of every local position, -100 if none
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    logits = model(**inputs).logits[0].float()  # [s, V]
    logprobs = torch.log_softmax(logits, -1)
    mine = torch.nonzero(targets != -100).flatten()  # local answer positions
    at = batch["position_ids"][0][mine]  # their global positions
    pad = 2 * state.sp_size if state is not None else 0  # room for the tail padded for SP
    stacked = torch.zeros(
        3, length + pad, dtype=torch.float64, device=device
    )  # log-prob, hit, present
    stacked[0, at] = logprobs[mine, targets[mine]].double()
    stacked[1, at] = (logits[mine].argmax(-1) == targets[mine]).double()
    stacked[2, at] = 1.0
    if state is not None and state.sp_size > 1:
        dist.all_reduce(stacked, group=state.sp_group)  # each answer is on exactly one rank
    keep = stacked[2] > 0
    return {"logprobs": stacked[0][keep].cpu(), "hits": stacked[1][keep].cpu()}


def generate_row(model, row: dict, state, new_tokens: int, device) -> list[int]:
    """The row up to and including its first "?" as the prompt; the greedy tokens generated after it."""
    first = min(i for i, v in enumerate(row["labels"]) if v != -100)  # the first answer digit
    prompt = torch.tensor([row["input_ids"][:first]], device=device)  # [1, first]: ends with "?"
    if state is not None and state.sp_size > 1:
        out = hf_upipe.generate(model, prompt, max_new_tokens=new_tokens, eos_token_id=[])
    else:
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
        )
    return out[0, prompt.shape[1] :].tolist()


def main(argv=None) -> int:
    args = parse_args(argv)  # flag errors first: an error costs no process group
    tokenizer = ByteTokenizer()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    state = None
    if accelerator.num_processes > 1:
        state = hf_upipe.init_sequence_parallel(accelerator.num_processes)  # SP over every process
    model = load_model(args, tokenizer.vocab_size).to(accelerator.device)
    rows = passkey_dataset(args.rows, args.length, tokenizer, seed=10_000 + args.seed)
    sp = state.sp_size if state is not None else 1
    accelerator.print(
        f"{accelerator.num_processes} processes: SP {sp}; {args.rows} held-out rows of {args.length} "
        f"tokens; adapter {args.adapter}"
    )

    bar = tqdm(total=2 * args.rows, disable=not accelerator.is_main_process, desc="eval")
    scored, t0 = [], time.perf_counter()
    with torch.no_grad():
        for row in rows:
            scored.append(score_row(model, row, state, args.length, accelerator.device))
            bar.update(1)
    score_s = time.perf_counter() - t0
    generated, prompt_tokens, t0 = [], 0, time.perf_counter()
    with torch.no_grad():
        for row in rows:
            generated.append(generate_row(model, row, state, args.new_tokens, accelerator.device))
            prompt_tokens += min(i for i, v in enumerate(row["labels"]) if v != -100)
            bar.update(1)
    generate_s = time.perf_counter() - t0
    bar.close()

    logprobs = torch.cat([s["logprobs"] for s in scored])
    passkeys = [
        row["input_ids"][min(i for i, v in enumerate(row["labels"]) if v != -100)] for row in rows
    ]
    results = {
        "processes": accelerator.num_processes,
        "sp_size": sp,
        "length": args.length,
        "rows": args.rows,
        "teacher_forced": {
            "first_answer_accuracy": sum(float(s["hits"][0]) for s in scored) / args.rows,
            "all_answers_accuracy": float(torch.cat([s["hits"] for s in scored]).mean()),
            "answer_perplexity": math.exp(-float(logprobs.mean())),
            "answer_logprobs": [s["logprobs"].tolist() for s in scored],
            "tokens_per_s": args.rows * args.length / score_s,
        },
        "generated": {
            "accuracy": sum(g[0] == k for g, k in zip(generated, passkeys)) / args.rows,
            "tokens": generated,
            "tokens_per_s": (prompt_tokens + args.rows * args.new_tokens) / generate_s,
        },
    }
    if accelerator.is_main_process:
        tf, gen = results["teacher_forced"], results["generated"]
        print(
            f"teacher-forced: first answer {tf['first_answer_accuracy']:.0%} (chance 10%), all answers "
            f"{tf['all_answers_accuracy']:.0%}, answer perplexity {tf['answer_perplexity']:.3f}, "
            f"{tf['tokens_per_s']:.0f} tokens/s\n"
            f"generated: passkey after the first '?' {gen['accuracy']:.0%}, {gen['tokens_per_s']:.0f} "
            "tokens/s (prompt and new tokens)"
        )
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f)
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    run(main)
