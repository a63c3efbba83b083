"""Worker body for the load-anywhere test: `artifact_runs(rank, world, root)` trains, in one 2-rank gloo job (SP 2),
a `UPipeTrainer` full fine-tune (with the word tokenizer as its processing class, a checkpoint at step 2), a
`UPipeSFTTrainer` LoRA run on a base saved in `root/base` and a `UPipeDPOTrainer` LoRA run on that base (8
preference pairs, 2 steps), saves each with `save_model`, and returns, per artifact, the trained model's logits on
fixed tokens, computed on rank 0 after `unprepare_model` (the plain attention, one process's forward).
"""

from __future__ import annotations

import os

import torch

from tests.training._runs import RUN_ARGS

TOKENS = [[5, 17, 33, 2, 71, 8, 40, 9, 90, 12, 3, 64]]


def _logits(trainer) -> list:
    import hf_upipe

    model = hf_upipe.unprepare_model(trainer.model)
    hf_upipe.reset_sequence_parallel()
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy().tolist()


def _full(rank: int, root: str):
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator

    import hf_upipe
    from tests.training._runs import _model
    from tests.training._trl_runs import tokenizer

    ids = torch.randint(1, 96, (8, 20), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=os.path.join(root, "full"),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=2e-3,
        **{**RUN_ARGS, "warmup_steps": 0},
        save_strategy="steps",
        save_steps=2,
    )
    hf_upipe.reset_sequence_parallel()
    trainer = hf_upipe.UPipeTrainer(
        model=_model(False, seed=11),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
        data_collator=default_data_collator,
        processing_class=tokenizer(),
        upipe_config=hf_upipe.UPipeConfig(sp_size=2),
    )
    trainer.train()
    trainer.save_model(os.path.join(root, "full_final"))
    return _logits(trainer) if rank == 0 else None


def _sft_lora(rank: int, root: str):
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig

    from hf_upipe.trl import UPipeSFTTrainer
    from tests.training._trl_runs import _model, dataset

    base = os.path.join(root, "base")
    if rank == 0:
        _model(seed=11).save_pretrained(base)
    torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
    args = SFTConfig(output_dir=os.path.join(root, "sft"), max_length=40, **_LORA_ARGS)
    return _train_lora(rank, UPipeSFTTrainer, model, args, dataset(16, seed=1), root, "sft_final")


def _dpo_lora(rank: int, root: str):
    """UPipeDPOTrainer with a LoRA adapter on the base `_sft_lora` saved: 8 preference pairs, 2 steps."""
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig

    from hf_upipe.trl import UPipeDPOTrainer
    from tests.training._dpo_runs import preference_dataset

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(root, "base"), attn_implementation="sdpa"
    )
    args = DPOConfig(
        output_dir=os.path.join(root, "dpo"),
        max_length=24,
        beta=0.5,
        dataset_num_proc=None,
        **_LORA_ARGS,
    )
    data = preference_dataset(8, seed=1)
    return _train_lora(rank, UPipeDPOTrainer, model, args, data, root, "dpo_final")


# the TRL configs' shared settings of the LoRA runs: 2 steps of 2 rows, no checkpoints, fp32
_LORA_ARGS = dict(
    per_device_train_batch_size=2,
    max_steps=2,
    learning_rate=2e-3,
    **{**RUN_ARGS, "warmup_steps": 0},
    save_strategy="no",
    bf16=False,
)


def _train_lora(rank: int, trainer_cls, model, args, data, root: str, name: str):
    """`trainer_cls` (a TRL trainer of hf_upipe.trl) with a LoRA adapter at SP 2: trains, saves `root/name`; rank
    0 returns the trained model's logits."""
    import hf_upipe
    from tests.training._trl_runs import lora_config, tokenizer

    hf_upipe.reset_sequence_parallel()
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer(),
        peft_config=lora_config(),
        upipe_config=hf_upipe.UPipeConfig(sp_size=2),
    )
    trainer.train()
    trainer.save_model(os.path.join(root, name))
    return _logits(trainer) if rank == 0 else None


def artifact_runs(rank: int, world: int, root: str) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    return {
        "full": _full(rank, root),
        "sft_lora": _sft_lora(rank, root),
        "dpo_lora": _dpo_lora(rank, root),
    }
