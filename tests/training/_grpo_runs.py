"""Worker bodies for the GRPO tests: one GRPO run per spec, in a spawned gloo process group.

`grpo_runs(rank, world, specs)` trains a tiny random Llama (fp32) on prompts of random words (the in-memory
word-level tokenizer of `_trl_runs`: no download) with two verifiable rewards, with `trl.GRPOTrainer` ("trl", the
one-process reference, with the global batch) or `hf_upipe.trl.UPipeGRPOTrainer` ("upipe"), and returns every
logged value per step and the trainable parameters before and after.

Completions: `gen="sample"` samples them (TRL: `model.generate` in one process; hf_upipe: `hf_upipe.generate`,
the draws on SP rank 0; the same seed draws the same tokens); `gen="replay"` gives both the same completions
through TRL's `rollout_func`: each is a function of its prompt, its occurrence among the call's rows and the
generation round (what a recorded run replays), so data-parallel replicas, which sample from other seeds than one
process, get one process's completions.
"""

from __future__ import annotations

import os
import zlib

import torch

from tests.training._runs import RUN_ARGS
from tests.training._trl_runs import VOCAB, _model, lora_config, tokenizer

SKIPPED = ("step_time", "tokens_per_second", "peak_memory_gib")  # timings: not compared


def prompts(n_rows: int, seed: int):
    """Prompts of 3-9 random words ("w0".."w91")."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        n = int(torch.randint(3, 10, (1,), generator=gen))
        rows.append(
            " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (n,), generator=gen))
        )
    return Dataset.from_dict({"prompt": rows})


def low_words(completions, **kwargs) -> list[float]:
    """The fraction of a completion's words among w0..w29 (a verifiable reward)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w.startswith("w") and int(w[1:]) < 30 for w in words) / max(len(words), 1))
    return out


def length(completions, **kwargs) -> list[float]:
    """A completion's words over 4 (a second reward, weighted in)."""
    return [len(text.split()) / 4 for text in completions]


class Replay:
    """A `rollout_func`: the same completions for the same (prompt, occurrence among the call's rows, round) on
    every process (module docstring). Ids 4.. are words, 3 is the eos."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.round = max_tokens, 0

    def __call__(self, prompts_text, trainer):
        tok = trainer.processing_class
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for text in prompts_text:
            k = seen[text] = seen.get(text, -1) + 1
            gen = torch.Generator().manual_seed(zlib.crc32(f"{text}|{k}|{self.round}".encode()))
            n = int(torch.randint(1, self.max_tokens + 1, (1,), generator=gen))
            ids = [4 + int(i) for i in torch.randint(0, VOCAB - 4, (n,), generator=gen)]
            if n < self.max_tokens and bool(torch.rand(1, generator=gen) < 0.7):
                ids[-1] = 3  # ends with the eos
            prompt_ids.append(tok(text)["input_ids"])
            completion_ids.append(ids)
        self.round += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def grpo_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from trl import GRPOConfig, GRPOTrainer

    import hf_upipe

    upipe = spec["trainer"] == "upipe"
    dp = spec.get("dp", 1)
    run_args = {
        **RUN_ARGS,
        **spec.get("run", {}),
    }  # e.g. no warmup: the first step already moves the policy
    args = GRPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec.get("batch", 4) * (1 if upipe else dp),
        gradient_accumulation_steps=spec.get("ga", 2),
        max_steps=spec.get("steps", 3),
        learning_rate=spec.get("lr", 2e-3),
        optim=spec.get("optim", "adamw_torch"),
        **run_args,
        save_strategy="steps" if spec.get("save") else "no",
        save_steps=3,
        bf16=False,
        num_generations=4,
        max_completion_length=6,
        beta=spec.get("beta", 0.0),
        loss_type=spec.get("loss_type", "dapo"),
        num_iterations=spec.get("num_iterations", 1),
        gradient_checkpointing=spec.get("checkpointing", False),
        **spec.get("grpo", {}),
    )
    model = _model(seed=11)
    if spec.get(
        "from_path"
    ):  # a full fine-tune with beta > 0: TRL loads the reference from the policy's path
        path = os.path.join(spec["output_dir"], "..", "initial")
        if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
            model.save_pretrained(path)
        if world > 1:
            torch.distributed.barrier()
        model = path
        args.model_init_kwargs = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    kwargs = dict(
        model=model,
        reward_funcs=[low_words, length],
        args=args,
        train_dataset=prompts(16, seed=1),
        processing_class=tokenizer(),
        peft_config=lora_config() if spec.get("lora") else None,
    )
    if spec.get("gen") == "replay":
        kwargs["rollout_func"] = Replay(6)
    if upipe:
        cfg = hf_upipe.UPipeConfig(
            sp_size=spec["sp"],
            heads_per_chunk=1,
            tiled_mlp=spec.get("tiled_mlp", False),
            mlp_chunk_tokens=5 if spec.get("tiled_mlp") else None,
        )
        hf_upipe.reset_sequence_parallel()  # one job runs several specs
        from hf_upipe.trl import UPipeGRPOTrainer

        trainer = UPipeGRPOTrainer(**kwargs, upipe_config=cfg)
    else:
        trainer = GRPOTrainer(**kwargs)
    initial = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    keys = sorted({k for h in history for k in h if k not in SKIPPED})
    from hf_upipe.adapters.tiled_mlp import _is_tiled
    from hf_upipe.training.runtime import activation_checkpointing

    return {
        "logs": {k: {h["step"]: h.get(k) for h in history} for k in keys},
        "attn": trainer.model.config._attn_implementation if upipe else None,
        "ref_attn": (
            trainer.ref_model.config._attn_implementation if trainer.ref_model is not None else None
        ),
        "checkpointing": activation_checkpointing(trainer.model),
        "tiled": sum(_is_tiled(m) for m in trainer.model.modules()),
        "generation_batch_size": trainer.args.generation_batch_size,
        "saved": sorted(os.listdir(spec["output_dir"])) if spec.get("save") and rank == 0 else None,
        "initial": initial if rank == 0 else None,
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


def grpo_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [grpo_run(rank, world, spec) for spec in specs]
