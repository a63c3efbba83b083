"""Worker bodies for the Trainer tests: one training run per call, in a spawned gloo process group.

`train_runs(rank, world, specs)` runs several specs one after the other in the same processes (spawning is the
slow part). `train_run(rank, world, spec)` trains a tiny random Llama (fp32) on a fixed random dataset with either
`transformers.Trainer` ("hf", the single-process reference) or `UPipeTrainer` ("upipe"), and returns plain values:
the logged training losses per step, the eval losses, the extra log keys, and the final trainable parameters.
"""

from __future__ import annotations

import os

import torch


def _dataset(n_rows: int, seq_len: int, vocab: int, seed: int, unlabeled: int = 0):
    """Rows of random tokens with right padding of varying length; labels -100 on the padding (and on every token
    of the first `unlabeled` rows)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n_rows, seq_len), generator=gen)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n_rows,), generator=gen)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()  # [n, S] ones then zeros
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    if unlabeled:
        labels[:unlabeled] = -100
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
    )


def _packed(rows):
    """The same rows without their padding, for DataCollatorWithFlattening (several documents per row)."""
    from datasets import Dataset

    ids = [
        [t for t, m in zip(r, mask) if m]
        for r, mask in zip(rows["input_ids"], rows["attention_mask"])
    ]
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _model(lora: bool, seed: int, arch: str | None = None):
    """A tiny Llama, or a hybrid of `tests.integrations._models.LAYERS` (`arch`)."""
    from transformers import AutoModelForCausalLM

    from tests.integrations._models import hybrid_config, lora_exclusions, tiny_config

    torch.manual_seed(seed)
    config = tiny_config("llama") if arch is None else hybrid_config(arch)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = (
            ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"] if arch is None else "all-linear"
        )
        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                init_lora_weights=False,
                target_modules=targets,
                exclude_modules=lora_exclusions(arch),
            ),
        )
    return model


def _rng_recorder(out: list):
    """A Trainer callback that appends a digest of torch's CPU generator state at every step's beginning."""
    import hashlib

    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            out.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])

    return Recorder()


def _corrupt(
    rank: int,
    src: str,
    dst: str,
    flip: str | None = None,
    delete: str | None = None,
    remanifest: bool = False,
) -> None:
    """Rank 0 copies checkpoint `src` to `dst`, then flips one bit in the middle of file `flip` or deletes file
    `delete`; every rank waits for it. `remanifest`: the manifest is then rewritten (a consistent checkpoint that
    lacks the file, as plain transformers would resume from)."""
    import shutil

    if rank == 0:
        shutil.copytree(src, dst)
        if flip:
            path = os.path.join(dst, flip)
            middle = os.path.getsize(path) // 2
            with open(path, "r+b") as f:
                f.seek(middle)
                byte = f.read(1)[0]
                f.seek(middle)
                f.write(bytes([byte ^ 0x10]))
        if delete:
            os.remove(os.path.join(dst, delete))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if remanifest:
        from hf_upipe.training.checkpoint import write_manifest

        write_manifest(dst)


# The settings every training run of the tests shares (schedule, clipping, logging, seeds, CPU), beside its own.
RUN_ARGS = dict(
    lr_scheduler_type="linear",
    warmup_steps=1,
    weight_decay=0.01,
    max_grad_norm=1.0,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    seed=3,
    data_seed=5,
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def _parallelism(sizes: dict | None):
    """accelerate's ParallelismConfig with these sizes (`{"sp": 2}` -> sp_size=2), or None."""
    if sizes is None:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(**{f"{d}_size": v for d, v in sizes.items()})


def train_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from transformers import Trainer, TrainingArguments, default_data_collator

    import hf_upipe

    model = _model(spec["lora"], seed=11, arch=spec.get("arch"))
    args = TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec["batch"],
        gradient_accumulation_steps=spec.get("ga", 2),
        max_steps=spec.get("steps", 4),
        learning_rate=2e-3,
        **RUN_ARGS,
        eval_strategy="steps" if spec.get("eval_steps") else "no",
        eval_steps=spec.get("eval_steps"),
        save_strategy="steps" if spec.get("save_steps") else "no",
        save_steps=spec.get("save_steps"),
        activation_checkpointing=spec.get("checkpointing", False),
        train_sampling_strategy="sequential" if spec.get("unlabeled") else "random",
        accelerator_config={"dispatch_batches": False} if spec.get("iterable_eval") else None,
        parallelism_config=_parallelism(spec.get("parallelism")),
        ignore_data_skip=spec.get("ignore_data_skip", False),
        **spec.get("args", {}),  # e.g. fsdp and fsdp_config (tests.training._layout_runs)
    )
    train = _dataset(32, spec.get("seq_len", 29), 96, seed=1, unlabeled=spec.get("unlabeled") or 0)
    evals = _dataset(spec.get("eval_rows", 9), spec.get("seq_len", 29), 96, seed=2)
    collator = default_data_collator
    if spec.get(
        "packed"
    ):  # one row per batch holding every sample as a document, position_ids restarting
        from transformers import DataCollatorWithFlattening

        train, evals, collator = _packed(train), _packed(evals), DataCollatorWithFlattening()
    if spec.get("iterable_eval"):  # a streamed eval set (accelerate's IterableDatasetShard path)
        evals = evals.to_iterable_dataset()
    kwargs = dict(
        model=model, args=args, train_dataset=train, eval_dataset=evals, data_collator=collator
    )
    if spec["trainer"] == "upipe":
        cfg = hf_upipe.UPipeConfig(
            sp_size=spec["sp"],
            ring_size=spec.get("ring", 1),
            heads_per_chunk=spec.get("heads_per_chunk", 1),
            fused_attention=spec.get("fused", True),
            tiled_loss=spec.get("tiled", True),
            loss_chunk_tokens=7,
            tiled_mlp=spec.get("tiled_mlp", False),
            mlp_chunk_tokens=5,
            offload=spec.get("offload", "none"),
            offload_path=spec.get("offload_path"),
            offload_min_bytes=0,
            mixer_state_passing=spec.get("passing", "parallel"),
        )
        hf_upipe.reset_sequence_parallel()  # one job runs several specs with other SP settings
        trainer = hf_upipe.UPipeTrainer(**kwargs, upipe_config=cfg)
    else:
        trainer = Trainer(**kwargs)
    if spec.get("corrupt"):
        _corrupt(rank, **spec["corrupt"])
    rng = []
    # a digest of torch's CPU generator before every step (resumed runs: after loading)
    if spec.get("record_rng"):
        trainer.add_callback(_rng_recorder(rng))
    try:
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    except ValueError as err:
        if spec.get("expect_error"):
            return {"error": f"{type(err).__name__}: {err}"}
        raise
    history = list(trainer.state.log_history)
    again = [trainer.evaluate()["eval_loss"] for _ in range(spec.get("evaluate_again", 0))]
    losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    evals_ = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
    extra = sorted({k for h in history if "loss" in h for k in h})
    params = {n: _whole(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    if spec.get("save_to") and trainer.args.should_save:
        trainer.save_model(spec["save_to"])
    grad_norms = {h["step"]: h["grad_norm"] for h in history if "grad_norm" in h}
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return {
        "losses": losses,
        "evals": evals_,
        "again": again,
        "grad_norms": grad_norms,
        "keys": extra,
        "sp_size": trainer.upipe.state.sp_size if spec["trainer"] == "upipe" else None,
        "accelerate_sp": None if pc is None else (pc.sp_size, pc.total_size),
        "params": params if rank == 0 else None,
        "rng": rng,
        "stats": [
            (h.get("tokens_per_second"), h.get("peak_memory_gib")) for h in history if "loss" in h
        ],
    }


def _whole(p):
    """A parameter's values; an FSDP2 parameter (this rank's shard of a DTensor) gathered whole: a collective."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()


def train_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    return [train_run(rank, world, spec) for spec in specs]


def error_runs(rank: int, world: int, out_dir: str) -> dict:
    """Bad settings and an interrupted checkpoint save, on every rank; returns the messages seen."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator
    from transformers.trainer_utils import get_last_checkpoint

    from hf_upipe import UPipeConfig, UPipeTrainer

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
    )
    data = _dataset(8, 13, 96, seed=1)
    seen = {}

    def attempt(key, make):
        try:
            make()
        except (ValueError, NotImplementedError, RuntimeError) as err:
            seen[key] = f"{type(err).__name__}: {err}"

    attempt(
        "sp3",
        lambda: UPipeTrainer(
            model=_model(False, 1),
            args=args,
            train_dataset=data,
            upipe_config=UPipeConfig(sp_size=3),
        ),
    )
    attempt(
        "metrics",
        lambda: UPipeTrainer(
            model=_model(False, 1),
            args=TrainingArguments(**{**args.to_dict(), "batch_eval_metrics": True}),
            train_dataset=data,
            compute_metrics=lambda p, compute_result=False: {},
            upipe_config=UPipeConfig(sp_size=2),
        ),
    )
    no_labels = Dataset.from_dict({"input_ids": data["input_ids"]})
    attempt(
        "labels",
        lambda: UPipeTrainer(
            model=_model(False, 1),
            args=args,
            train_dataset=no_labels,
            data_collator=default_data_collator,
            upipe_config=UPipeConfig(sp_size=2),
        ).train(),
    )

    # construction-time errors: each raised by UPipeTrainer(...) itself, before any training
    def build(config=None, model=None, trainer_args=args):
        UPipeTrainer(
            model=model if model is not None else _model(False, 1),
            args=trainer_args,
            train_dataset=data,
            data_collator=default_data_collator,
            upipe_config=config,
        )

    attempt("heads", lambda: build(UPipeConfig(sp_size=2, heads_per_chunk=3)))
    os.environ["UPIPE_HEADS_PER_CHUNK"] = "3"
    attempt("heads_env", lambda: build(UPipeConfig(sp_size=2)))
    del os.environ["UPIPE_HEADS_PER_CHUNK"]
    attempt("kernel", lambda: build(UPipeConfig(sp_size=2, kernel="flash_attn")))
    attempt("offload", lambda: build(UPipeConfig(sp_size=2, offload="disk")))
    from transformers import AutoModelForCausalLM

    from tests.integrations._models import tiny_config

    odd = AutoModelForCausalLM.from_config(
        tiny_config("llama", heads=6, kv_heads=3), attn_implementation="sdpa"
    )
    attempt("kv_heads", lambda: build(UPipeConfig(sp_size=2), model=odd))
    blocker = os.path.join(out_dir, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    torch.distributed.barrier()
    unwritable = TrainingArguments(**{**args.to_dict(), "output_dir": os.path.join(blocker, "run")})
    attempt("outdir", lambda: build(UPipeConfig(sp_size=2), trainer_args=unwritable))
    # only rank 1 cannot write (an existing folder of a read-only file system): every rank raises, naming rank 1
    mine = (
        TrainingArguments(**{**args.to_dict(), "output_dir": "/proc/self"}) if rank == 1 else args
    )
    attempt("outdir_rank1", lambda: build(UPipeConfig(sp_size=2), trainer_args=mine))
    os.remove(blocker) if rank == 0 else None
    torch.distributed.barrier()

    class FailingSave(UPipeTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            if self.state.global_step == 2:
                raise RuntimeError("an error inside the save (imitated)")
            super()._save_optimizer_and_scheduler(output_dir)

    attempt(
        "save",
        lambda: FailingSave(
            model=_model(False, 1),
            args=args,
            train_dataset=data,
            data_collator=default_data_collator,
            upipe_config=UPipeConfig(sp_size=2),
        ).train(),
    )
    seen["entries"] = sorted(os.listdir(out_dir))
    seen["last"] = os.path.basename(get_last_checkpoint(out_dir) or "")
    return seen
