"""One rank of the full-disk test (`tests/training/test_full_disk.py`), started by `torchrun` (2 gloo ranks):
`python -m tests.training._disk_runs OUT STEPS [RESUME]`.

A tiny random Llama trains `STEPS` steps with `UPipeTrainer` (sp_size 2), saving a checkpoint after every step into
`OUT` (`RESUME`: a checkpoint folder to resume from, and no saves). Rank 0 then writes `OUT/result.json`: the
training loss of each step and a SHA-256 of the final weights, for comparison with an uninterrupted run.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist


def main(out: str, steps: int, resume: str | None) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

    import hf_upipe
    from tests.integrations._models import tiny_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    ids = torch.randint(1, 96, (16, 16), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="no" if resume else "steps",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = hf_upipe.UPipeTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
        data_collator=default_data_collator,
        upipe_config=hf_upipe.UPipeConfig(sp_size=dist.get_world_size()),
    )
    trainer.train(resume_from_checkpoint=resume)
    if dist.get_rank() == 0:
        losses = {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
        digest = hashlib.sha256()
        for name, p in sorted(trainer.model.state_dict().items()):
            digest.update(name.encode() + p.detach().float().numpy().tobytes())
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"losses": losses, "weights": digest.hexdigest()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
