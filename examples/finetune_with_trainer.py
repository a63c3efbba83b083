"""Long-context LoRA (or full) fine-tuning through `hf_upipe.UPipeTrainer` (transformers' Trainer) under
`accelerate launch` or `torchrun`: the same task, model and flags as `finetune_long_context.py`.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/finetune_with_trainer.py
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/finetune_with_trainer.py --trl

`--trl` trains with TRL's `SFTTrainer` through `hf_upipe.trl.UPipeSFTTrainer` and an `SFTConfig` (the same
settings; TRL also logs `entropy`, `mean_token_accuracy` and `num_tokens`, reduced over the ranks).

The Trainer does the rest: progress bar, logging (loss, tokens_per_second, peak_memory_gib), the lr schedule (the
same warmup and cosine decay as the custom loop), gradient clipping and accumulation, activation checkpointing,
checkpoints every `--save-every` steps and at the last step (`checkpoint-N`: plain transformers/PEFT files plus
optimizer state, written atomically with a manifest) and `--resume` (a checkpoint folder or 'latest', verified before
loading; a run already at `--steps` is left as it is, and continues when `--steps` is raised). The final
model is saved to `<output-dir>/final` (plain files, loadable without hf_upipe; a LoRA adapter names its base,
saved in `<output-dir>/base`), and the passkey answers of held-out rows are measured as in the custom loop. The
run's folder is `runs/trainer-lora` (`runs/trl-lora` with `--trl`; `-full` with `--full`) unless `--output-dir`
says otherwise; an earlier run there is refused without `--overwrite` or `--resume`. `--report-to tensorboard`
(or wandb, all) passes through to the Trainer's trackers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _flags import (  # noqa: E402
    check_flags,
    finished,
    latest_checkpoint,
    preflight,
    trainer_flags,
)

if (
    __name__ == "__main__"
):  # a bad flag, an earlier run or nothing to resume: one line, before torch is imported
    preflight(sys.argv[1:], "trainer")

import torch  # noqa: E402
from _common import (  # noqa: E402
    ByteTokenizer,
    add_common_flags,
    build_model,
    clear_run_dir,
    passkey_accuracy,
    passkey_dataset,
    point_adapter_to_base,
    run,
    run_dir,
    save_base,
    text_dataset,
    upipe_settings,
)
from transformers import TrainingArguments, default_data_collator  # noqa: E402

from hf_upipe import UPipeConfig, UPipeTrainer  # noqa: E402


def _clear_run_dir(output_dir: str, args, training_args) -> None:
    """`clear_run_dir` once the training arguments have set up the process group (`.device`)."""
    training_args.device  # noqa: B018  (under accelerate launch, the process group is up after this)
    barrier = torch.distributed.barrier if torch.distributed.is_initialized() else lambda: None
    clear_run_dir(output_dir, args, training_args.process_index == 0, barrier)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_flags(ap)
    trainer_flags(ap)
    args = ap.parse_args(argv)
    example = "trl" if args.trl else "trainer"
    check_flags(args, example)  # impossible values (also checked before the imports, as __main__)
    config = UPipeConfig.from_flags(**upipe_settings(args))  # errors name the flags
    tokenizer = ByteTokenizer()
    data = (
        text_dataset(args.data, tokenizer, args.seq_len)
        if args.data
        else passkey_dataset(args.rows, args.seq_len, tokenizer, seed=args.seed)
    )
    # an earlier run is refused without --overwrite / --resume: the Trainer and TRL runs have folders of their own
    output_dir = run_dir(args, example)
    done = finished(args, output_dir, example)
    if done is not None:  # resumed at --steps already: nothing trained, nothing written
        if os.environ.get("RANK", "0") == "0":
            print(done)
        return 0
    model = build_model(
        args.model,
        tokenizer.vocab_size,
        lora=not args.full,
        lora_rank=args.lora_rank,
        seed=args.seed,
    )
    settings = dict(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        max_grad_norm=args.max_grad_norm,
        weight_decay=0.0,
        logging_steps=1 if args.log_json else 10,
        save_strategy="steps",  # every --save-every steps and the last: --resume latest continues any run
        save_steps=args.save_every or args.steps,
        seed=args.seed,
        report_to=args.report_to,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        activation_checkpointing=args.checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every parameter is used in every step
    )
    if (
        args.trl
    ):  # the rows are tokenized, with their labels: TRL keeps them (no packing, no truncation)
        from trl import SFTConfig

        from hf_upipe.trl import UPipeSFTTrainer

        sft = SFTConfig(**settings, max_length=None, packing=False, gradient_checkpointing=False)
        _clear_run_dir(output_dir, args, sft)
        trainer = UPipeSFTTrainer(
            model=model,
            args=sft,
            train_dataset=data,
            processing_class=tokenizer.to_hf(),
            upipe_config=config,
        )
    else:
        training_args = TrainingArguments(**settings)
        _clear_run_dir(output_dir, args, training_args)
        trainer = UPipeTrainer(
            model=model,
            args=training_args,
            train_dataset=data,
            data_collator=default_data_collator,
            upipe_config=config,
        )
    # 'latest': the newest checkpoint, or none (a first launch of a job that always passes --resume latest)
    resume = latest_checkpoint(output_dir, example) if args.resume == "latest" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(output_dir, "final"))
    if trainer.is_world_process_zero():  # a LoRA run's base beside it, named by the adapter
        base = save_base(args, tokenizer.vocab_size, output_dir)
        point_adapter_to_base(os.path.join(output_dir, "final"), base)
    accuracy = None
    if not args.data and args.eval_rows:
        held_out = passkey_dataset(args.eval_rows, args.seq_len, tokenizer, seed=10_000 + args.seed)
        accuracy = passkey_accuracy(trainer.model, held_out, trainer.upipe)
    history = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        print(
            f"loss: first log {history[0]['loss']:.3f}, last log {history[-1]['loss']:.3f}; saved "
            f"{output_dir}/final ({'transformers' if args.full else 'PEFT'} files)"
        )
        if accuracy is not None:
            print(
                f"passkey retrieval on {args.eval_rows} held-out rows: first answer {accuracy['first_answer']:.0%} "
                f"(chance 10%), all answers {accuracy['all_answers']:.0%}"
            )
        if args.log_json:
            with open(args.log_json, "w") as f:
                trl_metrics = ("entropy", "mean_token_accuracy", "num_tokens")
                json.dump(
                    {
                        "losses": {h["step"]: h["loss"] for h in history},
                        "accuracy": accuracy,
                        **{k: {h["step"]: h[k] for h in history if k in h} for k in trl_metrics},
                    },
                    f,
                )
    trainer.accelerator.wait_for_everyone()  # rank 0 may still be writing: tear the group down together
    trainer.accelerator.end_training()
    return 0


if __name__ == "__main__":
    run(main)
