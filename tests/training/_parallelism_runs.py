"""Worker body for tests/training/test_parallelism_config.py: UPipeTrainer with accelerate's ParallelismConfig."""

from __future__ import annotations

import os


def parallelism_runs(rank: int, world: int, out_dir: str) -> dict:
    """Two training runs (SP 2 from ParallelismConfig, SP 2 from UPipeConfig) and the refusals, on every rank.
    LOCAL_WORLD_SIZE=1 (one process per node) makes hf_upipe's default sp_size 1, so only an honoured
    parallelism config gives SP 2."""
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    from hf_upipe import UPipeConfig, UPipeTrainer, reset_sequence_parallel
    from tests.training._runs import _dataset, _model, train_run

    base = {"trainer": "upipe", "sp": None, "lora": False, "batch": 2, "ga": 2, "steps": 3}
    seen = {
        "pc": train_run(
            rank,
            world,
            {**base, "output_dir": os.path.join(out_dir, "pc"), "parallelism": {"sp": 2}},
        ),
        "upipe": train_run(
            rank, world, {**base, "sp": 2, "output_dir": os.path.join(out_dir, "upipe")}
        ),
        "default": train_run(rank, world, {**base, "output_dir": os.path.join(out_dir, "default")}),
    }
    data = _dataset(8, 13, 96, seed=1)

    def attempt(key, parallelism, config=None, env=None):
        reset_sequence_parallel()
        args = TrainingArguments(
            output_dir=os.path.join(out_dir, key),
            per_device_train_batch_size=2,
            max_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            parallelism_config=parallelism,
        )
        os.environ.update(env or {})
        try:
            UPipeTrainer(model=_model(False, 1), args=args, train_dataset=data, upipe_config=config)
            seen[key] = "no error"
        except (ValueError, NotImplementedError) as err:
            seen[key] = f"{type(err).__name__}: {err}"
        finally:
            for name in env or {}:
                del os.environ[name]
        seen[key + "_dir"] = os.path.exists(os.path.join(out_dir, key))

    attempt("deepspeed", ParallelismConfig(sp_size=2), env={"ACCELERATE_USE_DEEPSPEED": "true"})
    attempt("cp", ParallelismConfig(cp_size=2))
    attempt("disagree", ParallelismConfig(sp_size=2), UPipeConfig(sp_size=1))
    attempt("world", ParallelismConfig(sp_size=2, dp_replicate_size=2))
    return seen
