"""Worker bodies for the TRL tests: one SFT run per call, in a spawned gloo process group.

`sft_runs(rank, world, specs)` trains a tiny random Llama (fp32) on a fixed dataset of random words (prompt-
completion, plain text, or conversations rendered by a chat template with `{% generation %}` markers; a word-level
tokenizer built in memory: no download) with `trl.SFTTrainer` ("trl", the one-process reference) or
`hf_upipe.trl.UPipeSFTTrainer` ("upipe"), and returns the logged losses, grad norms, TRL's metrics and the final
trainable parameters.
"""

from __future__ import annotations

import logging
import os

import torch

from tests.training._runs import RUN_ARGS

VOCAB = 96


EVAL_METRICS = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens")


def lora_config():
    """The adapters of the TRL runs: r=4 on the projections, initialised non-zero (so they change the logits)."""
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
    )


def tokenizer():
    """A word-level tokenizer over "w0".."w91" plus 4 special tokens (96 ids: the tiny Llama's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        t: i
        for i, t in enumerate(
            ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
        )
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


# user turns "w0 ... w1", assistant turns "... </s>" inside {% generation %} (the assistant mask), space-separated
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}w0 {{ m['content'] }} w1 "
    "{% else %}{% generation %}{{ m['content'] }} </s>{% endgeneration %} {% endif %}"
    "{% endfor %}"
)


def dataset(n_rows: int, seed: int, kind: str = "prompt_completion"):
    """Rows of random words: prompts of 3-11 words and completions of 2-13 (prompt-completion), or their
    concatenation as plain text ("text")."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)

    def words(lo, hi):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (n,), generator=gen))

    if kind == "conversational":  # one or two user/assistant turns
        chats = []
        for _ in range(n_rows):
            turns = int(torch.randint(1, 3, (1,), generator=gen))
            chat = []
            for _ in range(turns):
                chat += [
                    {"role": "user", "content": words(2, 8)},
                    {"role": "assistant", "content": words(2, 9)},
                ]
            chats.append(chat)
        return Dataset.from_dict({"messages": chats})
    rows = [(words(3, 11), words(2, 13)) for _ in range(n_rows)]
    if kind == "text":
        return Dataset.from_dict({"text": [f"{p} {c}" for p, c in rows]})
    return Dataset.from_dict(
        {"prompt": [p for p, _ in rows], "completion": [f" {c}" for _, c in rows]}
    )


def _model(seed: int):
    from transformers import AutoModelForCausalLM

    from tests.integrations._models import tiny_config

    torch.manual_seed(seed)
    config = tiny_config("llama")
    assert config.vocab_size == VOCAB, config.vocab_size
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def sft_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from trl import SFTConfig, SFTTrainer

    import hf_upipe

    args = SFTConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec.get("batch", 2)
        * (spec.get("dp", 1) if spec["trainer"] == "trl" else 1),
        per_device_eval_batch_size=3 * (spec.get("dp", 1) if spec["trainer"] == "trl" else 1),
        gradient_accumulation_steps=spec.get("ga", 2),
        max_steps=spec.get("steps", 4),
        learning_rate=2e-3,
        **RUN_ARGS,
        save_strategy="no",
        max_length=spec.get("max_length", 40),
        packing=spec.get("packing", True),
        padding_free=spec.get("padding_free", False),
        completion_only_loss=spec.get("completion_only_loss", True),
        assistant_only_loss=spec.get("assistant_only_loss", False),
        gradient_checkpointing=spec.get("checkpointing", False),
        bf16=False,
        model_init_kwargs=None,
        dataset_num_proc=None,
        parallelism_config=_parallelism(spec),
    )
    peft_config = lora_config() if spec.get("lora") else None
    kwargs = dict(
        model=_model(seed=11),
        args=args,
        train_dataset=dataset(
            spec.get("rows", 40), seed=1, kind=spec.get("kind", "prompt_completion")
        ),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    if spec.get("eval_rows"):  # evaluated once, after training
        kind = spec.get("kind", "prompt_completion")
        kwargs["eval_dataset"] = dataset(spec["eval_rows"], seed=2, kind=kind)
    if spec["trainer"] == "upipe":
        cfg = hf_upipe.UPipeConfig(
            sp_size=None if spec.get("parallelism_config") else spec["sp"],
            heads_per_chunk=1,
            loss_chunk_tokens=7,
            tiled_mlp=spec.get("tiled_mlp", False),
            mlp_chunk_tokens=5 if spec.get("tiled_mlp") else None,
        )
        hf_upipe.reset_sequence_parallel()  # one job runs several specs
        from hf_upipe.trl import UPipeSFTTrainer

        records, log = _Records(), logging.getLogger("hf_upipe.trl.sft")
        level = log.level
        log.addHandler(records)
        log.setLevel(logging.INFO)
        try:
            trainer = UPipeSFTTrainer(**kwargs, upipe_config=cfg)
        finally:
            log.removeHandler(records)
            log.setLevel(level)
    else:
        trainer = SFTTrainer(**kwargs)
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    evaluation = trainer.evaluate() if spec.get("eval_rows") else {}
    return {
        "eval": {k: v for k, v in evaluation.items() if k in EVAL_METRICS},
        "losses": {h["step"]: h["loss"] for h in history},
        "grad_norms": {h["step"]: h["grad_norm"] for h in history},
        "num_tokens": {h["step"]: h.get("num_tokens") for h in history},
        "entropy": {h["step"]: h.get("entropy") for h in history},
        "mean_token_accuracy": {h["step"]: h.get("mean_token_accuracy") for h in history},
        "n_label_tokens": _label_tokens(trainer),
        "keys": sorted({k for h in history for k in h}),
        "log": "\n".join(records.lines) if spec["trainer"] == "upipe" else "",
        "epoch": history[-1]["epoch"],
        "sp_size": trainer.upipe.state.sp_size if spec["trainer"] == "upipe" else 1,
        "tiled_mlp": bool(spec["trainer"] == "upipe" and trainer.upipe.config.tiled_mlp),
        "checkpointing": _checkpointing(trainer.model),
        "params": (
            {
                n: p.detach().numpy().copy()
                for n, p in trainer.model.named_parameters()
                if p.requires_grad
            }
            if rank == 0
            else None
        ),
    }


class _Records(logging.Handler):
    """Keeps the messages of the log lines it is given (INFO and up)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _checkpointing(model) -> bool:
    from hf_upipe.training.runtime import activation_checkpointing

    return activation_checkpointing(model)


def _parallelism(spec: dict):
    """`SFTConfig(parallelism_config=ParallelismConfig(sp_size=...))` for an hf_upipe run that asks for it (the SP
    degree then comes from there only)."""
    if spec["trainer"] != "upipe" or not spec.get("parallelism_config"):
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(sp_size=spec["sp"], dp_replicate_size=spec.get("dp", 1))


def _label_tokens(trainer) -> tuple[int, int]:
    """(label tokens, tokens) of the prepared training set: the test checks what the masks leave out."""
    rows = trainer.train_dataset["labels"]
    return sum(sum(t != -100 for t in row) for row in rows), sum(len(row) for row in rows)


def sft_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [sft_run(rank, world, spec) for spec in specs]
