"""Long-context fine-tuning with attn_implementation="upipe": the main example (CPU by default, no downloads).

Run (2 CPU processes, one sequence-parallel group; a few minutes):
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/finetune_long_context.py
or  torchrun --nproc_per_node 2 examples/finetune_long_context.py

The task is passkey retrieval: a random passkey is stated near the start of a long random "haystack" and asked
for at the end; the loss is on the answer tokens only, so it can only fall if attention reaches across the whole
sequence, over the shards of every rank. Each rank feeds its contiguous shard with global position_ids; the loss is
the sum over the shard's answer tokens divided by the global count, and gradients are summed over the
sequence-parallel group (every rank holds a full replica of this small model).

Defaults: a one-layer Llama built from a config (8 query / 2 key-value heads), 2K-token sequences, 300 steps
(about two minutes on two CPU cores; the loss drops from ~4 to well below 1 once retrieval is learned). `--model` takes a
config.json or a local model directory (weights are loaded if present). The UPipeTrainer and the accelerate
plugin of later releases do the sharding and the loss for you; this script shows the mechanics.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import hf_upipe

VOCAB = 64
KEY, ASK, SEP = 1, 2, 3  # markers
PASSKEY = range(4, 12)  # passkey symbols never occur in the haystack (tokens 12..63)


def passkey_dataset(n: int, seq_len: int, seed: int, every: int = 4) -> Dataset:
    """Rows of input_ids [seq_len] and labels (pre-shifted: labels[t] is the target predicted at t).

    A passkey symbol follows the KEY marker near the start; in the last half, every `every` tokens an ASK marker
    asks for it (label = the passkey). The passkey occurs nowhere else in the input, so each answer must attend
    back to the start of the sequence: across the shards of every rank.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "labels": []}
    for _ in range(n):
        ids = torch.randint(PASSKEY.stop, VOCAB, (seq_len,), generator=gen)
        key = int(torch.randint(PASSKEY.start, PASSKEY.stop, (1,), generator=gen))
        at = int(torch.randint(1, seq_len // 8, (1,), generator=gen))
        ids[at:at + 3] = torch.tensor([KEY, key, SEP])
        labels = torch.full((seq_len,), -100)
        asks = torch.arange(seq_len // 2, seq_len - 1, every)
        ids[asks] = ASK
        labels[asks] = key
        rows["input_ids"].append(ids.tolist())
        rows["labels"].append(labels.tolist())
    return Dataset.from_dict(rows)


def build_model(path: str | None, layers: int) -> torch.nn.Module:
    if path is None:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20,
                             rope_theta=1e6, use_cache=False, tie_word_embeddings=True)
        return AutoModelForCausalLM.from_config(config, attn_implementation="upipe")
    if os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="upipe")
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="upipe")


def peak_memory_gib(device) -> float:
    """Peak allocated CUDA memory, or on CPU the process's peak resident set (coarse: includes the runtime)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="config.json or local model dir; default: a tiny Llama")
    p.add_argument("--layers", type=int, default=1, help="layers of the default tiny Llama")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--heads-per-chunk", default="1", help="query heads per rank per stage, or 'none' (Ulysses)")
    p.add_argument("--output-dir", default="outputs/finetune_long_context")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    chunk = None if args.heads_per_chunk.lower() == "none" else int(args.heads_per_chunk)
    sp = hf_upipe.init_sequence_parallel(heads_per_chunk=chunk)  # all ranks share each sequence
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.layers).to(device).train()
    model = hf_upipe.prepare_model(model)  # the fused UPipe block on Llama/Mistral/Qwen2/Qwen3 attention
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = passkey_dataset(args.steps, args.seq_len, seed=args.seed).with_format("torch")
    if args.seq_len % sp.sp_size:
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of the {sp.sp_size} ranks")
    s = args.seq_len // sp.sp_size
    shard = slice(sp.sp_rank * s, (sp.sp_rank + 1) * s)
    position_ids = torch.arange(args.seq_len, device=device)[shard].unsqueeze(0)  # global positions
    if rank == 0:
        print(f"{sp.sp_size} ranks x {s} tokens = {args.seq_len}-token sequences, heads_per_chunk={chunk}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    losses, start = [], time.perf_counter()
    for step, row in enumerate(data):
        ids, labels = row["input_ids"][None].to(device), row["labels"][None].to(device)
        n_tokens = (labels != -100).sum()
        logits = model(ids[:, shard], position_ids=position_ids).logits  # [1, s, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels[:, shard].flatten(), ignore_index=-100,
                               reduction="sum") / n_tokens
        loss.backward()
        for param in model.parameters():  # the SP ranks hold partial gradients of one sample: sum them
            dist.all_reduce(param.grad, group=sp.sp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=sp.sp_group)
        losses.append(total.item())
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            tok_s = (step + 1) * args.seq_len / (time.perf_counter() - start)
            recent = losses[-20:]
            print(f"step {step:4d}  passkey loss (mean of last {len(recent)}) {sum(recent) / len(recent):.3f}  "
                  f"{tok_s:,.0f} tokens/s  peak memory {peak_memory_gib(device):.2f} GiB", flush=True)
    if rank == 0:
        n = min(10, len(losses))
        first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(f"passkey loss: first {n} steps {first:.3f} -> last {n} steps {last:.3f}")
        model.save_pretrained(args.output_dir)  # plain transformers format; load it without hf_upipe
        print(f"saved to {args.output_dir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
