"""Shared pieces of the examples: a byte-level tokenizer, the passkey task, data loading, the model, the flags.

Entry points:
- `ByteTokenizer`: bytes -> ids (no download): id = byte + 3; 0 pad, 1 bos, 2 eos; vocab 259.
- `passkey_dataset(n, seq_len, tokenizer, seed)`: the built-in long-context task as a `datasets.Dataset`.
- `text_dataset(path, tokenizer, seq_len)`: local json/jsonl/txt files with a "text" field, cut into rows.
- `build_model(path, vocab_size, lora, lora_rank)`: a tiny Llama from a config (default), a config.json, or a
  local model directory; LoRA through PEFT when asked.
- `add_common_flags(parser)` / `upipe_settings(args)`: the flags both examples share.
"""

from __future__ import annotations

import os
import random

import torch
from datasets import Dataset, load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from hf_upipe import UPipeConfig

HAYSTACK = b"abcdefghijklmnopqrstuvwxyz "
DIGITS = b"0123456789"


class ByteTokenizer:
    """A byte-level tokenizer that needs nothing downloaded: id = byte + 3 (0 pad, 1 bos, 2 eos)."""

    pad_token_id, bos_token_id, eos_token_id, vocab_size = 0, 1, 2, 259

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [b + 3 for b in data]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")


def passkey_dataset(n: int, seq_len: int, tokenizer: ByteTokenizer, seed: int) -> Dataset:
    """Rows of bytes: random lowercase text with "#<digit>;" near the start and, in the second half, questions
    "?<digit>" every few bytes; only the digit after each "?" is a target (labels: HF convention, unshifted).

    Each answer must be read from the start of the row: across every rank's shard under sequence parallelism.
    """
    rng = random.Random(seed)
    rows = {"input_ids": [], "labels": []}
    for _ in range(n):
        text = bytearray(rng.choice(HAYSTACK) for _ in range(seq_len))
        key = rng.choice(DIGITS)
        at = rng.randrange(1, max(2, seq_len // 8))
        text[at:at + 3] = b"#" + bytes([key]) + b";"
        answers = list(range(seq_len // 2, seq_len - 1, 6))
        for a in answers:
            text[a:a + 2] = b"?" + bytes([key])
        ids = tokenizer.encode(bytes(text))
        labels = [-100] * seq_len
        for a in answers:
            labels[a + 1] = ids[a + 1]  # the digit after "?"
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
    return Dataset.from_dict(rows)


def text_dataset(path: str, tokenizer, seq_len: int) -> Dataset:
    """Local .json/.jsonl/.txt files ("text" field) tokenized, concatenated and cut into rows of seq_len."""
    kind = "text" if path.endswith(".txt") else "json"
    raw = load_dataset(kind, data_files=path, split="train")
    ids: list[int] = []
    for text in raw["text"]:
        ids.extend(tokenizer.encode(text) + [tokenizer.eos_token_id])
    rows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not rows:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one row of --seq-len {seq_len}")
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def build_model(path: str | None, vocab_size: int, lora: bool, lora_rank: int, seed: int, layers: int = 1):
    """The model to fine-tune, in fp32 (bf16 on CUDA), with attn_implementation="upipe"; LoRA if asked."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if path is None:
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20,
                             rope_theta=1e6, use_cache=False, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="upipe", dtype=dtype)
    elif os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="upipe", dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="upipe",
                                                 dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            modules_to_save=["embed_tokens", "lm_head"] if path is None else None))  # random ones must learn the bytes
    return model


def add_common_flags(ap) -> None:
    ap.add_argument("--model", default=None, help="config.json or local model dir (default: a tiny 1-layer Llama)")
    ap.add_argument("--data", default=None, help="local .json/.jsonl/.txt with a 'text' field (default: passkey)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=512, help="rows of the built-in passkey task")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--full", action="store_true", help="full fine-tune (default: LoRA through PEFT)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (non-reentrant)")
    ap.add_argument("--output-dir", default="runs/long_context")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    ap.add_argument("--resume", default=None, help="a checkpoint folder, or 'latest'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-json", default=None, help="write the per-step losses here (rank 0)")
    for name in ("sp_size", "heads_per_chunk", "kernel", "tiled_mlp", "offload", "offload_path"):
        ap.add_argument("--" + name.replace("_", "-"), default=None, help=UPipeConfig.__dataclass_fields__[name]
                        .metadata["help"] + " (default: UPIPE_" + name.upper() + " or the built-in default)")


def upipe_settings(args) -> dict:
    """The UPipe flags that were given (others fall back to UPIPE_* variables, then defaults)."""
    out = {}
    for name in ("sp_size", "heads_per_chunk", "kernel", "tiled_mlp", "offload", "offload_path"):
        value = getattr(args, name)
        if value is not None:
            out[name] = int(value) if name == "sp_size" else value
    return out
