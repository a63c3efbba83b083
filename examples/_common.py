"""Shared pieces of the examples: a byte-level tokenizer, the passkey task, data loading, the model, the flags.

Entry points:
- `ByteTokenizer`: bytes -> ids (no download): id = byte + 3; 0 pad, 1 bos, 2 eos; vocab 259. `.to_hf()`: the
  same ids as a transformers tokenizer (TRL's `processing_class`: its pad and eos ids; GRPO's prompts).
- `passkey_dataset(n, seq_len, tokenizer, seed)`: the built-in long-context task as a `datasets.Dataset`.
- `text_dataset(path, tokenizer, seq_len)`: local json/jsonl/txt files with a "text" field, cut into rows.
- `build_model(path, vocab_size, lora, lora_rank)`: a tiny Llama from a config (default), a config.json, or a
  local model directory; LoRA through PEFT when asked.
- `add_common_flags(parser)` / `upipe_settings(args)`: the flags both examples share (`--flag` / `--no-flag` for
  every switch; `--help` lists the choices; defined, and checked before the heavy imports, in `_flags`);
  `learning_rate(args, step)`: the warmup + cosine schedule.
- `run_dir(args, example)` (from `_flags`) / `clear_run_dir(...)`: the run's folder (runs/<example>-<lora|full>
  by default; an earlier run there is refused without --overwrite or --resume); `save_base` /
  `point_adapter_to_base`: a LoRA run's base saved in the run's folder and named by its adapters, so they load
  without hf_upipe; `plot_losses(...)`: the loss curve as a PNG.
- `passkey_accuracy(model, rows, upipe)`: the share of held-out answers the model gets right, over every rank's
  shard (the first answer of a row can only be read from the passkey, in the first rank's shard).
- `run(main)`: runs a script's main; an input error (a bad flag, a bad data file, settings that cannot work) is
  one line on stderr from the first rank (the same error is raised on every rank) and exit status 2 on every rank
  (`hf_upipe.exits`).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import _flags
import torch
from _flags import run_dir  # noqa: F401  (the run's folder, checked before the heavy imports)
from datasets import Dataset, load_dataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, default_data_collator

from hf_upipe import UPipeConfig
from hf_upipe.exits import exit_with_error, is_setting_error
from hf_upipe.ops.kernels import available_kernels

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

    def to_hf(self):
        """A `PreTrainedTokenizerFast` built in memory that gives ASCII text the ids `encode` gives it, one per
        character (TRL reads its pad and eos ids; GRPO tokenizes prompts and decodes completions with it)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        names = ["<pad>", "<s>", "</s>"] + [chr(b) for b in range(256)]
        vocab = {name: i for i, name in enumerate(names)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()  # characters joined without spaces
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            pad_token="<pad>",
            bos_token="<s>",
            eos_token="</s>",
        )


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
        text[at : at + 3] = b"#" + bytes([key]) + b";"
        answers = list(range(seq_len // 2, seq_len - 1, 6))
        for a in answers:
            text[a : a + 2] = b"?" + bytes([key])
        ids = tokenizer.encode(bytes(text))
        labels = [-100] * seq_len
        for a in answers:
            labels[a + 1] = ids[a + 1]  # the digit after "?"
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
    return Dataset.from_dict(rows)


def text_dataset(path: str, tokenizer, seq_len: int) -> Dataset:
    """Local .json/.jsonl/.txt files ("text" field) tokenized, concatenated and cut into rows of seq_len.

    Raises:
        ValueError: a missing file, or a .json/.jsonl file whose records have no "text" field.
    """
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file")
    kind = "text" if path.endswith(".txt") else "json"
    raw = load_dataset(kind, data_files=path, split="train")
    if "text" not in raw.column_names:
        raise ValueError(
            f"--data {path}: the records have no 'text' field (they have {raw.column_names}); each line "
            'of a .jsonl file must be like {"text": "..."} (see examples/sample.jsonl), or pass a .txt '
            "file"
        )
    ids: list[int] = []
    for text in raw["text"]:
        ids.extend(tokenizer.encode(text) + [tokenizer.eos_token_id])
    rows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not rows:
        raise ValueError(
            f"--data {path}: {len(ids)} tokens, fewer than one row of --seq-len {seq_len}"
        )
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def build_model(
    path: str | None, vocab_size: int, lora: bool, lora_rank: int, seed: int, layers: int = 1
):
    """The model to fine-tune, in fp32 (bf16 on CUDA), with attn_implementation="upipe"; LoRA if asked."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if path is None:
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=1 << 20,
            rope_theta=1e6,
            use_cache=False,
            tie_word_embeddings=False,
        )
        model = AutoModelForCausalLM.from_config(config, attn_implementation="upipe", dtype=dtype)
    elif os.path.isdir(path) and any(
        f.endswith((".safetensors", ".bin")) for f in os.listdir(path)
    ):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="upipe", dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), attn_implementation="upipe", dtype=dtype
        )
    if lora:
        from peft import LoraConfig

        from hf_upipe.models.peft import get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
                target_modules=[
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                ],
                modules_to_save=["embed_tokens", "lm_head"] if path is None else None,
            ),
        )  # random ones must learn the bytes
    return model


def add_common_flags(ap) -> None:
    """`_flags.add_common_flags` with the UPipe settings' help and the kernels' names."""
    _flags.add_common_flags(ap, _help, available_kernels())


def _help(name: str) -> str:
    return UPipeConfig.__dataclass_fields__[name].metadata["help"]


def upipe_settings(args) -> dict:
    """The UPipe flags that were given (others fall back to UPIPE_* variables, then defaults).

    Raises:
        ValueError: --offload cpu/disk without --checkpointing (it offloads what checkpointing keeps).
    """
    if args.offload not in (None, "none") and not args.checkpointing:
        raise ValueError(
            f"--offload {args.offload} offloads what activation checkpointing keeps: add --checkpointing "
            "(or --offload none)"
        )
    names = ("sp_size", "heads_per_chunk", "kernel", "tiled_mlp", "offload", "offload_path")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def clear_run_dir(path: str, args, is_main: bool, wait_for_everyone) -> None:
    """With --overwrite, the first rank deletes the earlier run; every rank waits for it (a collective)."""
    if args.overwrite:
        if is_main and os.path.isdir(path):
            shutil.rmtree(path)
        wait_for_everyone()


def save_base(args, vocab_size: int, output_dir: str) -> str | None:
    """A LoRA run's base model, as training starts from it, in `<output_dir>/base` (config and weights), when it
    exists nowhere else (`needs_saved_base`); its absolute path, or None. First rank only. The default base is
    seed-built, so it is built again (the RNG state is kept), not read off the PEFT model."""
    if not needs_saved_base(args):
        return None
    folder = os.path.abspath(os.path.join(output_dir, "base"))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        with torch.random.fork_rng(devices=[]):
            base = build_model(args.model, vocab_size, lora=False, lora_rank=0, seed=args.seed)
        base.config._attn_implementation = "sdpa"  # "upipe" needs hf_upipe: the saved base must not
        base.save_pretrained(folder)
    return folder


def point_adapter_to_base(model_dir: str, base_dir: str | None) -> None:
    """Set the `base_model_name_or_path` of the adapter saved in `model_dir` to `base_dir` (left as PEFT wrote it
    when None), so that `AutoPeftModelForCausalLM.from_pretrained(model_dir)` loads without hf_upipe or the Hub."""
    if base_dir is None:
        return
    path = os.path.join(model_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base_dir
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def needs_saved_base(args) -> bool:
    """A LoRA run on a base that exists nowhere else: built from a config (the default, or --model config.json)."""
    if args.full:
        return False
    path = args.model
    return path is None or not (
        os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))
    )


def plot_losses(losses: dict[int, float], path: str, guess: float | None) -> str | None:
    """The loss curve as a PNG at `path` (None, and nothing drawn, without matplotlib: pip install matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [losses[s] for s in steps], lw=1, label="training loss")
    if guess is not None:
        ax.axhline(
            guess, ls="--", c="gray", lw=1, label=f"guessing the digit (ln 10 = {guess:.3f})"
        )
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token mean, all ranks)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def learning_rate(args, step: int) -> float:
    """Linear warmup over --warmup steps, then cosine decay to 10% of --lr at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def passkey_accuracy(model, rows, upipe) -> dict:
    """Greedy answers on held-out rows: the share right of the first answer of each row (readable only from the
    passkey, in the first rank's shard: retrieval across shards) and of every answer. The same on every rank."""
    training = model.training
    model.eval()
    first = every = total = 0
    with torch.no_grad():
        for row in rows:
            batch = {k: v.to(upipe.device) for k, v in default_data_collator([row]).items()}
            shard = upipe.shard(batch)
            logits = model(
                **{k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
            ).logits
            labels = shard["shift_labels"][0]  # [s]: the next token of every local position
            hits = logits[0].argmax(-1) == labels
            answers = torch.nonzero(labels != -100).flatten()
            every += int(hits[answers].sum())
            total += len(answers)
            start = (
                upipe.state.sp_rank * labels.shape[0]
            )  # the first answer of the row, on whichever rank holds it
            first_at = min(i for i, v in enumerate(row["labels"][1:]) if v != -100) - start
            if 0 <= first_at < labels.shape[0]:
                first += int(hits[first_at])
    first, every, total = upipe.world_sum(first, every, total)
    model.train(training)
    replicas = upipe.state.dp_size  # every data-parallel replica evaluated every row
    return {"first_answer": first / (len(rows) * replicas), "all_answers": every / total}


def run(main) -> None:
    """`raise SystemExit(main())`, with input errors as one line from the first rank and exit status 2 on every rank
    (`hf_upipe.exits.exit_with_error`). The process groups are destroyed before exiting (a gloo group left to the
    interpreter's exit can abort the process)."""
    try:
        code = main()
    except (ValueError, NotImplementedError, TypeError) as err:
        if isinstance(err, TypeError) and not is_setting_error(err):
            raise  # a TypeError of the script's own code is a bug, not a setting
        exit_with_error(err)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    raise SystemExit(code)
