"""One rank of a fault test: `python -m tests.training._fault_runs MODE FAULT_RANK OUT` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set by the test, which hosts the store as a launcher's agent does.

A tiny random Llama trains with `UPipeRuntime` (SP over all ranks) on random rows; a finished checkpoint
`OUT/checkpoint-1` exists (a manifest, as hf_upipe writes it). At step 2, rank FAULT_RANK:
- MODE "a2a": kills itself (SIGKILL) as its first attention layer starts, the others entering its all-to-all;
- MODE "rs": kills itself after its backward, the others in a reduce-scatter of their gradients (FSDP's);
- MODE "oom": raises `torch.OutOfMemoryError` in its forward;
- MODE "oom_fits": the same, in steps of 2,048 tokens planned for a 4 GiB GPU, where the planner finds a longer
  length and settings that fit.
It writes `OUT/fault_at` (time.time()) first. Every rank prints `step N` after each step.
MODE "enospc" (`_save_fault`): a `UPipeTrainer` (SP over all ranks) saves `OUT/checkpoint-1` itself, and rank
FAULT_RANK's write of the weights of `checkpoint-2` fails with ENOSPC (after writing `OUT/fault_at`); the error
ends that rank through Python. MODE "enospc_exit": the same, but that rank prints the error and exits at once, so
the others meet a broken barrier of the save rather than the posted failure.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def _fault(mode: str, out: str):
    with open(os.path.join(out, "fault_at"), "w") as f:
        f.write(repr(time.time()))
    if mode.startswith("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    os.kill(os.getpid(), signal.SIGKILL)


def _save_fault(fault_rank: int, out: str, exit_at_once: bool) -> None:
    import errno

    import transformers.modeling_utils as modeling_utils
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

    import hf_upipe
    from tests.integrations._models import tiny_config

    dist.init_process_group("gloo")
    real = modeling_utils.safe_save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if ".staging-checkpoint-2" in str(filename):
            with open(os.path.join(out, "fault_at"), "w") as f:
                f.write(repr(time.time()))
            raise OSError(errno.ENOSPC, "No space left on device", str(filename))
        return real(tensors, filename, *args, **kwargs)

    if dist.get_rank() == fault_rank:
        modeling_utils.safe_save_file = full_disk
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    ids = torch.randint(1, 96, (8, 16), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="steps",
        save_steps=1,
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
    try:
        trainer.train()
    except OSError as err:
        if not exit_at_once:
            raise
        print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(1)


def main(mode: str, fault_rank: int, out: str) -> None:
    if mode.startswith("enospc"):
        return _save_fault(fault_rank, out, exit_at_once=mode == "enospc_exit")
    import hf_upipe
    from hf_upipe.training.checkpoint import write_manifest
    from hf_upipe.training.parallelism import resolve_launch
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.integrations._models import tiny_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(os.path.join(out, "checkpoint-1"), exist_ok=True)
        with open(os.path.join(out, "checkpoint-1", "step.json"), "w") as f:
            f.write('{"step": 1}')
    dist.barrier()
    write_manifest(os.path.join(out, "checkpoint-1"))  # every rank
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    fits = mode == "oom_fits"
    tokens = 2048 if fits else 64
    config = hf_upipe.UPipeConfig(sp_size=2, gpu_memory="4GiB" if fits else "1GiB")
    upipe = UPipeRuntime.setup(
        resolve_launch(config, None, world),
        model,
        device="cpu",
        checkpointing=False,
        checkpointing_fix="",
        output_dir=out,
    )
    faulty = rank == fault_rank
    for step in range(1, 6):
        if step == 2 and faulty and mode in ("a2a", "oom", "oom_fits"):
            model.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: _fault(mode, out))
        ids = torch.randint(1, 96, (1, tokens), generator=torch.Generator().manual_seed(step))
        shard = upipe.shard({"input_ids": ids, "labels": ids})
        n = upipe.count([shard])
        with upipe.step(model):
            upipe.loss(model, shard, n).backward()
            if step == 2 and faulty and mode == "rs":
                _fault(mode, out)
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            flat = flat[: flat.numel() // world * world]
            part = torch.empty(flat.numel() // world)
            dist.reduce_scatter_tensor(part, flat)
        model.zero_grad()
        print(f"step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
