"""Worker body for tests/training/test_launch_once.py: how often one launch resolves its sizes and agrees.

`launch_counts(rank, world, out_dir)` sets up one `UPipeTrainer` (construction + one training step, with
accelerate's `ParallelismConfig(sp_size=2)`; again with `model_init`), one `UPipePlugin.prepare`, one
`UPipeSFTTrainer` (construction + one step, with `ParallelismConfig(sp_size=2)`) and one `UPipeGRPOTrainer`
(construction, with `UPipeConfig(sp_size=2)`), and one `UPipeRuntime.setup`, and returns per entry point how many
times each ran: the agreement collectives (`all_gather_object` calls, the collective every agreement of the ranks
runs), the resolutions of accelerate's `ParallelismConfig` (`find_parallelism`, `with_parallelism_sp`) and of the
SP degree (`UPipeConfig.resolve_sp_size`), and the calls of `base_model` (PEFT unwrapped).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

_COUNTED = ("find_parallelism", "with_parallelism_sp")


def _count(counts: Counter) -> None:
    """Wrap the counted functions wherever hf_upipe's modules hold them, and `all_gather_object`."""
    import torch.distributed as dist

    from hf_upipe.config import UPipeConfig
    from hf_upipe.training import parallelism

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        counted.original = fn
        return counted

    from hf_upipe.models import peft

    for home, name in [*((parallelism, n) for n in _COUNTED), (peft, "base_model")]:
        fn = getattr(home, name)
        fn = getattr(fn, "original", fn)
        counted = wrap(name, fn)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("hf_upipe") and (
                getattr(getattr(module, name, None), "original", getattr(module, name, None)) is fn
            ):
                setattr(module, name, counted)
    resolve = UPipeConfig.resolve_sp_size
    UPipeConfig.resolve_sp_size = wrap("resolve_sp_size", getattr(resolve, "original", resolve))
    gather = dist.all_gather_object
    dist.all_gather_object = wrap("agreement", getattr(gather, "original", gather))


def _trainer(out_dir: str, model_init: bool = False) -> None:
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments, default_data_collator

    from hf_upipe import UPipeConfig, UPipeTrainer
    from tests.training._runs import _dataset, _model

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        parallelism_config=ParallelismConfig(sp_size=2),
    )
    trainer = UPipeTrainer(
        model=None if model_init else _model(False, 1),
        model_init=(lambda: _model(False, 1)) if model_init else None,
        args=args,
        train_dataset=_dataset(4, 13, 96, seed=1),
        data_collator=default_data_collator,
        upipe_config=UPipeConfig(loss_chunk_tokens=7),
    )
    trainer.train()
    launch = trainer.upipe.launch
    assert trainer.upipe.state.sp_size == 2 == launch.sp and launch.dp == 1 and launch.ring == 1
    assert launch.sp_source == "ParallelismConfig(sp_size=2)" and launch.agreed


def _plugin() -> None:
    from accelerate import Accelerator

    from hf_upipe import UPipePlugin
    from tests.training._runs import _model

    *_, upipe = UPipePlugin(sp_size=2).prepare(Accelerator(cpu=True), _model(False, 1))
    assert upipe.state.sp_size == 2


def _sft(out_dir: str) -> None:
    """`UPipeSFTTrainer` (construction + one training step) with `SFTConfig(parallelism_config=...)`: the TRL
    trainers enter through `UPipeTrainer`, which resolves the launch."""
    from accelerate.parallelism_config import ParallelismConfig
    from trl import SFTConfig

    from hf_upipe import UPipeConfig
    from hf_upipe.trl import UPipeSFTTrainer
    from tests.training._runs import RUN_ARGS
    from tests.training._trl_runs import _model, dataset, tokenizer

    args = SFTConfig(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=1,
        **RUN_ARGS,
        save_strategy="no",
        max_length=40,
        bf16=False,
        dataset_num_proc=None,
        parallelism_config=ParallelismConfig(sp_size=2),
    )
    trainer = UPipeSFTTrainer(
        model=_model(seed=11),
        args=args,
        train_dataset=dataset(8, seed=1),
        processing_class=tokenizer(),
        upipe_config=UPipeConfig(heads_per_chunk=1, loss_chunk_tokens=7),
    )
    trainer.train()
    launch = trainer.upipe.launch
    assert trainer.upipe.state.sp_size == 2 == launch.sp and launch.agreed, launch


def _grpo(out_dir: str) -> None:
    """`UPipeGRPOTrainer` (construction: its generation batch counted over the launch's `dp`, read from the one
    launch) with `UPipeConfig(sp_size=2)` (TRL's `GRPOConfig` refuses a `ParallelismConfig` with an SP degree)."""
    from trl import GRPOConfig

    from hf_upipe import UPipeConfig
    from hf_upipe.trl import UPipeGRPOTrainer
    from tests.training._grpo_runs import length, prompts
    from tests.training._runs import RUN_ARGS
    from tests.training._trl_runs import _model, tokenizer

    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        max_steps=1,
        **RUN_ARGS,
        save_strategy="no",
        bf16=False,
        num_generations=4,
        max_completion_length=6,
    )
    trainer = UPipeGRPOTrainer(
        _model(seed=11),
        reward_funcs=[length],
        args=args,
        train_dataset=prompts(8, seed=1),
        processing_class=tokenizer(),
        upipe_config=UPipeConfig(sp_size=2, heads_per_chunk=1),
    )
    launch = trainer.upipe.launch
    assert trainer.upipe.state.sp_size == 2 == launch.sp and launch.dp == 1, launch
    assert trainer.args.generation_batch_size == 4 * launch.dp * args.steps_per_generation


def _runtime() -> None:
    from hf_upipe import UPipeConfig
    from hf_upipe.training.parallelism import resolve_launch
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.training._runs import _model

    upipe = UPipeRuntime.setup(
        resolve_launch(UPipeConfig(sp_size=2), None, 2),
        _model(False, 1),
        device="cpu",
        checkpointing=False,
        checkpointing_fix="-",
    )
    assert upipe.state.sp_size == 2 == upipe.launch.sp
    assert upipe.launch.sp_source == "UPipeConfig(sp_size=2)", upipe.launch.sp_source


def _refused(rank: int, case: str) -> str:
    """`UPipeRuntime.setup` where the ranks differ in what a later step used to compare on its own: the
    UPIPE_* environment and the settings `init_sequence_parallel` is asked for, or the model `prepare_model`
    prepares. Returns the error."""
    from hf_upipe import UPipeConfig
    from hf_upipe.training.parallelism import resolve_launch
    from hf_upipe.training.runtime import UPipeRuntime
    from tests.training._runs import _model

    model, env = _model(False, 1), {}
    if (
        case == "environment"
    ):  # overridden by the config, so the settings agree but the environment does not
        env = {"UPIPE_HEADS_PER_CHUNK": str(1 + rank)}
    elif case == "init":  # sp_size from the node size: 1 on rank 0, 2 on rank 1
        env = {"LOCAL_WORLD_SIZE": str(1 + rank)}
    elif rank == 1:  # "model": one more trainable tensor frozen on rank 1
        model.lm_head.weight.requires_grad_(False)
    os.environ.update(env)
    try:
        UPipeRuntime.setup(
            resolve_launch(
                UPipeConfig(sp_size=None if case == "init" else 2, heads_per_chunk=1), None, 2
            ),
            model,
            device="cpu",
            checkpointing=False,
            checkpointing_fix="-",
        )
        return "no error"
    except ValueError as err:
        return str(err)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        os.environ.pop("UPIPE_HEADS_PER_CHUNK", None)


def launch_counts(rank: int, world: int, out_dir: str) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # sp_size 2 only from what each entry point is given
    import hf_upipe
    import hf_upipe.training.plugin
    import hf_upipe.training.trainer
    import hf_upipe.trl  # noqa: F401  (imported before the counters wrap their names)

    torch.manual_seed(0)
    seen = {}
    for name, run in (
        ("trainer", lambda: _trainer(out_dir)),
        ("model_init", lambda: _trainer(out_dir, model_init=True)),
        ("plugin", _plugin),
        ("sft", lambda: _sft(out_dir)),
        ("grpo", lambda: _grpo(out_dir)),
        ("runtime", _runtime),
    ):
        hf_upipe.reset_sequence_parallel()
        counts = Counter()
        _count(counts)
        run()
        seen[name] = dict(counts)
    for case in ("environment", "init", "model"):
        hf_upipe.reset_sequence_parallel()
        counts = Counter()
        _count(counts)
        seen[case] = (_refused(rank, case), dict(counts))
    return seen
