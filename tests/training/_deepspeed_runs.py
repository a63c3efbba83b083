"""Worker bodies for the DeepSpeed tests: `UPipeTrainer` with `TrainingArguments(deepspeed=...)` in spawned gloo
process groups, on DeepSpeed's CPU accelerator.

`ds_runs(rank, world, specs)` runs several specs one after the other in the same processes. A spec is that of
`tests.training._runs.train_run` (a tiny random Llama in fp32, 32 random right-padded rows of 29 tokens), plus
`stage` (ZeRO stage 1/2/3; None: no DeepSpeed, the one-process reference), `pretrained` (a folder from
`save_tiny_model`: the model is loaded after the `TrainingArguments`, so under ZeRO-3 `from_pretrained` builds it
under `deepspeed.zero.Init`), `offload` ("cpu": optimizer states
offloaded), `expect_error`. Every parameter is partitioned under ZeRO-3 (`stage3_param_persistence_threshold: 0`).
Returns plain values: logged losses and grad norms per step, the final trainable parameters (gathered whole).
"""

from __future__ import annotations

import os

import torch

from tests.training._runs import RUN_ARGS, _dataset, _model


def ds_config(stage: int, offload: str | None = None, ds_adam: bool = False) -> dict:
    """A DeepSpeed config in fp32 with the Trainer's own optimizer (`ds_adam`: DeepSpeed's AdamW, its CPU Adam
    when offloaded) and schedule ("auto" values from the args)."""
    zero = {"stage": stage}
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=0,  # every parameter partitioned, none kept whole
            stage3_prefetch_bucket_size=0,
            stage3_max_live_parameters=0,
            stage3_max_reuse_distance=0,
        )
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    optimizer = {
        "type": "AdamW",
        "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")},
    }
    return {
        **({"optimizer": optimizer} if ds_adam else {}),
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


def skip_shm_build() -> None:
    """deepspeed.comm on the test's gloo group without JIT-compiling DeepSpeed's shared-memory all-reduce (about a
    minute per fresh cache; ZeRO's collectives go through torch.distributed)."""
    import datetime
    import importlib

    import torch.distributed as dist

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module(
        "deepspeed.comm.torch"
    )  # `from ... import torch`: the torch package

    if ds_comm.cdb is not None and ds_comm.cdb.is_initialized():
        return
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        ds_comm.cdb = ds_torch.TorchBackend(dist.get_backend(), datetime.timedelta(minutes=5), None)
    finally:
        ds_torch.build_shm_op = build


def _args(spec: dict):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec.get("batch", 2),
        gradient_accumulation_steps=spec.get("ga", 2),
        max_steps=spec.get("steps", 3),
        learning_rate=2e-3,
        **RUN_ARGS,
        save_strategy="no",
        activation_checkpointing=spec.get("checkpointing", False),
        deepspeed=None
        if spec.get("stage") is None
        else ds_config(spec["stage"], spec.get("offload"), spec.get("ds_adam", False)),
    )


def _full_params(trainer) -> dict:
    """name -> the trainable parameter, whole (gathered under ZeRO-3)."""
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    if hasattr(named[0][1], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone().numpy() for n, p in named}
    return {n: p.detach().clone().numpy() for n, p in named}


def save_tiny_model(path: str) -> None:
    """The tiny Llama of `_model`, saved for `from_pretrained` (the runs with `pretrained`)."""
    _model(False, seed=11).save_pretrained(path)


def _pretrained(path: str, lora: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    )
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(12)  # the same adapters in every run
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
        model = get_peft_model(model, config)
    return model


def ds_run(rank: int, world: int, spec: dict) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    from transformers import Trainer, default_data_collator
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import hf_upipe
    from hf_upipe.attention.fused import count_fused

    unset_hf_deepspeed_config()  # the previous spec's ZeRO-3 config would build this model under zero.Init
    if spec.get("stage") is not None:
        skip_shm_build()
    model = None if spec.get("pretrained") else _model(spec["lora"], seed=11)
    args = _args(spec)
    if (
        model is None
    ):  # after the args: from_pretrained builds it under deepspeed.zero.Init (ZeRO-3)
        model = _pretrained(spec["pretrained"], spec["lora"])
    loaded_partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    kwargs = dict(
        model=model,
        args=args,
        train_dataset=_dataset(32, spec.get("seq_len", 29), 96, seed=1),
        data_collator=default_data_collator,
    )
    try:
        if spec["trainer"] == "upipe":
            hf_upipe.reset_sequence_parallel()
            cfg = hf_upipe.UPipeConfig(
                sp_size=spec["sp"],
                heads_per_chunk=1,
                fused_attention=spec.get("fused", True),
                tiled_loss=spec.get("tiled", True),
                loss_chunk_tokens=7,
                tiled_mlp=spec.get("tiled_mlp", False),
                mlp_chunk_tokens=5,
            )
            trainer = hf_upipe.UPipeTrainer(**kwargs, upipe_config=cfg)
        else:
            trainer = Trainer(**kwargs)
        trainer.train()
    except (ValueError, NotImplementedError) as err:
        if spec.get("expect_error"):
            return {"error": f"{type(err).__name__}: {err}"}
        raise
    history = list(trainer.state.log_history)
    return {
        "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
        "grad_norms": {h["step"]: h["grad_norm"] for h in history if "grad_norm" in h},
        "params": _full_params(trainer),
        "loaded_partitioned": loaded_partitioned,  # built under deepspeed.zero.Init
        "fused": count_fused(model) if spec["trainer"] == "upipe" else 0,
    }


def ds_runs(rank: int, world: int, specs: list[dict]) -> list[dict]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    return [ds_run(rank, world, spec) for spec in specs]


def plugin_steps(rank: int, world: int, stage: int | None, lora: bool, ga: int = 1) -> dict:
    """3 optimizer steps of the plugin's loop (`UPipePlugin.prepare`, `upipe.windows`, `accelerator.backward`) under
    accelerate's DeepSpeedPlugin at ZeRO `stage` (every parameter partitioned at 3), SP over all ranks, windows of
    `ga` batches of 2 rows. `stage` None: the one-process reference (the plain model, transformers' loss on each
    window's rows in one batch, torch AdamW). Returns each step's token-mean loss, grad norm and the final weights
    (or the error raised)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from torch.utils.data import DataLoader
    from transformers import default_data_collator
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # (a previous case's ZeRO-3 plugin would build the model under zero.Init)
    data = _dataset(6 * ga, 29, 96, seed=4)
    model = _model(lora, seed=11)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    if stage is None:
        out = {"losses": [], "grad_norms": []}
        for window in DataLoader(data, batch_size=2 * ga, collate_fn=default_data_collator):
            loss = model(**window).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
            out["grad_norms"].append(norm.item())
        out["params"] = {n: p.detach().clone().numpy() for n, p in model.named_parameters()}
        return out
    return _plugin_run(model, opt, data, world, stage, ga)


def _plugin_run(model, opt, data, world: int, stage: int, ga: int) -> dict:
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from hf_upipe import UPipePlugin, reset_sequence_parallel

    skip_shm_build()
    # what `accelerate launch` sets with a DeepSpeed config
    os.environ.update(
        ACCELERATE_USE_DEEPSPEED="true", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.update(RANK=str(torch.distributed.get_rank()))
    config = {**ds_config(stage), "gradient_clipping": 0.0, "gradient_accumulation_steps": ga}
    # accelerate sets up DeepSpeed on CPU only over a CPU process group made first (as TrainingArguments does);
    # each case starts from a fresh accelerate state (one DeepSpeedPlugin per Accelerator state)
    AcceleratorState._reset_state(True)
    PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    loader = DataLoader(data, batch_size=2, collate_fn=default_data_collator)
    reset_sequence_parallel()
    plugin = UPipePlugin(sp_size=world, loss_chunk_tokens=7, tiled_mlp=True, mlp_chunk_tokens=5)
    try:
        model, opt, loader, upipe = plugin.prepare(accelerator, model, opt, loader)
        out = {"losses": [], "grad_norms": []}
        for shards in upipe.windows(loader, ga):
            n = upipe.count(shards)
            total = 0.0
            for shard in shards:
                loss = upipe.loss(model, shard, n)
                accelerator.backward(loss)
                total += loss.item() / world
            opt.step()
            opt.zero_grad()
            summed = torch.tensor(total)
            torch.distributed.all_reduce(summed)
            out["losses"].append(summed.item())
            out["grad_norms"].append(float(model.get_global_grad_norm()))
    except (ValueError, NotImplementedError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    named = [(n, p) for n, p in model.module.named_parameters()]
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        out["params"] = {n: p.detach().clone().numpy() for n, p in named}
    return out
