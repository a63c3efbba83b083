"""Worker bodies for the DPO tests: one DPO run per spec, in a spawned gloo process group.

`dpo_runs(rank, world, specs)` trains a tiny random Llama (fp32) on a fixed preference dataset (prompts, chosen and
rejected completions of random words over the in-memory word-level tokenizer of `_trl_runs`: no download) with
`trl.DPOTrainer` ("trl", the one-process reference) or `hf_upipe.trl.UPipeDPOTrainer` ("upipe"), and returns every
logged value per step and the final trainable parameters.
"""

from __future__ import annotations

import functools
import os

import torch

from tests.training._runs import RUN_ARGS
from tests.training._trl_runs import VOCAB, _model, lora_config, tokenizer

METRICS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """The model's n most likely next words (ids 4.., no special token) after `prompt`, one at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1, 4:]  # [VOCAB - 4] the words
            ids.append(4 + int(logits.argmax()))
    return ids[len(prompt) :]


def preference_dataset(n_rows: int, seed: int):
    """Rows of random words: prompts of 3-11 words, chosen and rejected completions of 2-13 words each; on every
    other row the chosen completion is the initial model's greedy continuation (so `mean_token_accuracy` is not 0).
    """
    from datasets import Dataset

    rows = _preference_rows(n_rows, seed)
    return Dataset.from_dict(
        {
            "prompt": [p for p, _, _ in rows],
            "chosen": [f" {c}" for _, c, _ in rows],
            "rejected": [f" {r}" for _, _, r in rows],
        }
    )


@functools.lru_cache
def _preference_rows(n_rows: int, seed: int) -> tuple:
    import hf_upipe

    gen = torch.Generator().manual_seed(seed)
    model = _model(seed=11)

    def ids(lo, hi):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return [4 + int(i) for i in torch.randint(0, VOCAB - 4, (n,), generator=gen)]

    def text(words):
        return " ".join(f"w{i - 4}" for i in words)

    rows = []
    with (
        hf_upipe.without_sequence_parallel()
    ):  # a job's earlier run may have left its SP state installed
        for row in range(n_rows):
            prompt, chosen, rejected = ids(3, 11), ids(2, 13), ids(2, 13)
            if row % 2 == 0:
                chosen = _greedy(model, prompt, len(chosen))
            rows.append((text(prompt), text(chosen), text(rejected)))
    return tuple(rows)


def dpo_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from trl import DPOConfig, DPOTrainer

    import hf_upipe

    args = DPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec.get("batch", 2),
        gradient_accumulation_steps=spec.get("ga", 2),
        max_steps=spec.get("steps", 3),
        learning_rate=spec.get("lr", 2e-3),
        optim=spec.get("optim", "adamw_torch"),
        **RUN_ARGS,
        save_strategy="steps" if spec.get("save") else "no",
        save_steps=3,
        max_length=spec.get("max_length", 24),
        beta=0.5,
        gradient_checkpointing=spec.get("checkpointing", False),
        bf16=False,
        dataset_num_proc=None,
        parallelism_config=_parallelism(spec, world),
        **spec.get("dpo", {}),  # loss types, label smoothing, f-divergence
    )
    peft_config = lora_config() if spec.get("lora") else None
    kwargs = dict(
        model=_model(seed=11),
        args=args,
        train_dataset=preference_dataset(24, seed=1),
        processing_class=tokenizer(),
        peft_config=peft_config,
    )
    if not spec.get("lora"):  # a full fine-tune needs its reference: the same initial weights
        kwargs["ref_model"] = _model(seed=11)
    if spec["trainer"] == "upipe":
        cfg = hf_upipe.UPipeConfig(
            sp_size=None if spec.get("parallelism_config") else spec["sp"],
            heads_per_chunk=1,
            tiled_mlp=spec.get("tiled_mlp", False),
        )
        hf_upipe.reset_sequence_parallel()  # one job runs several specs
        from hf_upipe.trl import UPipeDPOTrainer

        trainer = UPipeDPOTrainer(**kwargs, upipe_config=cfg)
    else:
        trainer = DPOTrainer(**kwargs)
    initial = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.train()
    refused = None
    if spec["trainer"] == "upipe":
        try:
            trainer.evaluate()
        except NotImplementedError as err:
            refused = str(err)
    history = [h for h in trainer.state.log_history if "loss" in h]
    from hf_upipe.adapters.tiled_mlp import _is_tiled

    models = {"policy": trainer.model, "reference": trainer.ref_model}
    return {
        # what ran: the attention implementation and how many modules compute tiled, per model
        "prepared": {
            name: (
                m.config._attn_implementation if hasattr(m, "config") else None,
                sum(_is_tiled(x) for x in m.modules()),
            )
            for name, m in models.items()
            if m is not None
        },
        "logs": {name: {h["step"]: h.get(name) for h in history} for name in METRICS},
        "evaluate_refused": refused,
        "precomputed": "ref_chosen_logps" in trainer.train_dataset.column_names,
        "saved": sorted(os.listdir(spec["output_dir"])) if spec.get("save") and rank == 0 else None,
        "keys": sorted({k for h in history for k in h}),
        "initial": initial if rank == 0 else None,  # trainable or not, before the first step
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


def _parallelism(spec: dict, world: int):
    """`DPOConfig(parallelism_config=ParallelismConfig(sp_size=...))` for an hf_upipe run that asks for it."""
    if spec["trainer"] != "upipe" or not spec.get("parallelism_config"):
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(sp_size=spec["sp"], dp_replicate_size=world // spec["sp"])


def dpo_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [dpo_run(rank, world, spec) for spec in specs]
