"""accelerate's ParallelismConfig under hf_upipe (`hf_upipe.training.parallelism`): its sp_size is the SP degree
when UPipeConfig gives none, what hf_upipe cannot honour is refused with the numbers and the fix named, and
accelerate/transformers get a config without SP. The accelerate config file's keys are read as accelerate launches
them (its own parser and environment code)."""

import pytest
from accelerate.parallelism_config import ParallelismConfig

from hf_upipe.config import UPipeConfig
from hf_upipe.training.parallelism import (
    ParallelismSizes,
    accelerate_view,
    find_parallelism,
    resolve_launch,
    uses_deepspeed,
    with_parallelism_sp,
)

_VARS = (
    "ACCELERATE_USE_PARALLELISM_CONFIG",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_FSDP",
    "LOCAL_WORLD_SIZE",
    "UPIPE_SP_SIZE",
    *(f"PARALLELISM_CONFIG_{d}_SIZE" for d in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")),
    "PARALLELISM_CONFIG_SP_BACKEND",
    "PARALLELISM_CONFIG_CP_BACKEND",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


def _sizes(**sizes) -> ParallelismSizes:
    return find_parallelism(ParallelismConfig(**{f"{d}_size": v for d, v in sizes.items()}))


def test_no_parallelism_config_changes_nothing():
    assert find_parallelism(None) is None
    assert resolve_launch(UPipeConfig(), None, 4).errors == ()
    assert with_parallelism_sp(config := UPipeConfig(), None) is config
    assert accelerate_view(None, 2, 4) is None


def test_sp_size_of_the_parallelism_config_is_the_degree():
    sizes = _sizes(sp=2, dp_replicate=2)
    assert (sizes.sp, sizes.dp_replicate, sizes.source) == (2, 2, "ParallelismConfig")
    assert UPipeConfig().resolve_sp_size(4) == 4  # the default the parallelism config overrides
    config = with_parallelism_sp(UPipeConfig(), sizes)
    assert config.resolve_sp_size(4) == 2 and config.sp_size == 2
    assert config.describe("sp_size") == "ParallelismConfig(sp_size=2)"
    assert resolve_launch(UPipeConfig(), sizes, 4).errors == ()
    assert (
        resolve_launch(UPipeConfig(sp_size=2), sizes, 4).errors == ()
    )  # the same degree twice is fine
    # an explicit UPipe sp_size is kept; with a parallelism config of sp 1 the dp sizes must leave room for it
    assert (
        with_parallelism_sp(UPipeConfig(sp_size=2), _sizes(dp_shard=2)).describe("sp_size")
        == "UPipeConfig(sp_size=2)"
    )
    assert resolve_launch(UPipeConfig(sp_size=2), _sizes(dp_shard=2), 4).errors == ()


def test_accelerate_config_keys_through_accelerate_launch(tmp_path, monkeypatch):
    """The YAML of docs/parallelism-config.md, parsed and exported by accelerate's own launch code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    yaml = tmp_path / "config.yaml"
    yaml.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
        "num_processes: 4\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: false\n"
        "main_process_port: 29517\nrdzv_backend: static\nsame_network: true\n"
        "parallelism_config:\n  parallelism_config_sp_size: 2\n  parallelism_config_dp_replicate_size: 2\n"
    )
    args = launch_command_parser().parse_args(["--config_file", str(yaml), "train.py"])
    args = _validate_launch_command(args)[0]
    env = prepare_multi_gpu_env(args)
    assert (
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        and env["PARALLELISM_CONFIG_SP_SIZE"] == "2"
    )
    sizes = find_parallelism(None, environ=env)
    assert (sizes.sp, sizes.dp_replicate, sizes.dp_shard) == (2, 2, 1)
    assert sizes.describe("sp") == "parallelism_config_sp_size: 2 (PARALLELISM_CONFIG_SP_SIZE=2)"
    assert resolve_launch(UPipeConfig(), sizes, 4).errors == ()
    # accelerate's own ParallelismConfig() under that launch (what Accelerator() builds) is named the same way
    for key in (
        "ACCELERATE_USE_PARALLELISM_CONFIG",
        "PARALLELISM_CONFIG_SP_SIZE",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    ):
        monkeypatch.setenv(key, env[key])
    assert find_parallelism(ParallelismConfig()).describe("sp") == sizes.describe("sp")
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG")
    assert (
        find_parallelism(None, environ={"PARALLELISM_CONFIG_SP_SIZE": "2"}) is None
    )  # not switched on


def test_deepspeed_sp_is_refused():
    assert uses_deepspeed(environ={"ACCELERATE_USE_DEEPSPEED": "true"})
    assert not uses_deepspeed(environ={})
    errors = resolve_launch(UPipeConfig(), _sizes(sp=2), 2, deepspeed=True).errors
    assert len(errors) == 1
    message = str(errors[0])
    assert "ParallelismConfig(sp_size=2) with DeepSpeed" in message and "over 2 ranks" in message
    assert "sp_backend='deepspeed'" in message and "FSDP2 or DDP" in message
    assert (
        resolve_launch(UPipeConfig(sp_size=1), _sizes(dp_replicate=2), 2, deepspeed=True).errors
        == ()
    )  # no SP


def test_context_and_tensor_parallelism_are_refused():
    (cp,) = resolve_launch(UPipeConfig(), _sizes(cp=2, dp_shard=2), 4).errors
    assert "ParallelismConfig(cp_size=2) asks for context parallelism" in str(cp)
    assert "ParallelismConfig(cp_size=1, sp_size=2)" in str(cp)
    (tp,) = resolve_launch(UPipeConfig(), _sizes(tp=2, dp_shard=2), 4).errors
    assert "ParallelismConfig(tp_size=2)" in str(tp) and "ParallelismConfig(tp_size=1)" in str(tp)


def test_disagreeing_degrees_are_refused(monkeypatch):
    (err,) = resolve_launch(UPipeConfig(sp_size=4), _sizes(sp=2, dp_replicate=2), 4).errors
    assert str(err).startswith("UPipeConfig(sp_size=4) and ParallelismConfig(sp_size=2) disagree")
    assert "(4 vs 2)" in str(err)
    monkeypatch.setenv("UPIPE_SP_SIZE", "4")
    (err,) = resolve_launch(UPipeConfig(), _sizes(sp=2), 4).errors
    assert str(err).startswith("UPIPE_SP_SIZE=4 and ParallelismConfig(sp_size=2) disagree")


def test_sizes_that_do_not_make_the_world_are_refused():
    (err,) = resolve_launch(UPipeConfig(), _sizes(sp=2, dp_replicate=2), 8).errors
    message = str(err)
    assert (
        "sp_size 2 (ParallelismConfig(sp_size=2)) x dp_replicate_size 2 x dp_shard_size 1"
        in message
    )
    assert (
        "= 4 processes, but this launch has 8" in message
        and "ParallelismConfig(dp_replicate_size=4)" in message
    )
    # an FSDP-style config without sp_size, against hf_upipe's default degree (all 4 processes)
    (err,) = resolve_launch(UPipeConfig(), _sizes(dp_shard=4), 4).errors
    assert "sp_size 4 (hf_upipe's default: one node)" in str(err)
    assert "x dp_shard_size 4" in str(err) and "= 16 processes, but this launch has 4" in str(err)
    assert "ParallelismConfig(dp_shard_size=1)" in str(err)
    (err,) = resolve_launch(UPipeConfig(sp_size=2), _sizes(dp_shard=4), 4).errors
    assert "sp_size 2 (UPipeConfig(sp_size=2))" in str(
        err
    ) and "ParallelismConfig(dp_shard_size=2)" in str(err)
    env = find_parallelism(
        None,
        environ={
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_SP_SIZE": "2",
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        },
    )
    (err,) = resolve_launch(UPipeConfig(), env, 2).errors
    assert "parallelism_config_dp_shard_size: 2 (PARALLELISM_CONFIG_DP_SHARD_SIZE=2)" in str(err)
    assert "parallelism_config_dp_shard_size: 1" in str(err)
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_SP_SIZE='two'"):
        find_parallelism(
            None,
            environ={
                "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                "PARALLELISM_CONFIG_SP_SIZE": "two",
            },
        )


def test_accelerate_gets_no_sp():
    view = accelerate_view(
        _sizes(sp=2, dp_replicate=2), 2, 4
    )  # DDP: all 1, accelerate's DP over every process
    assert (
        view.sp_size,
        view.cp_size,
        view.tp_size,
        view.dp_replicate_size,
        view.dp_shard_size,
    ) == (1, 1, 1, 1, 1)
    assert not view.sp_enabled and view.total_size == 1
    view = accelerate_view(
        _sizes(sp=2, dp_shard=2), 2, 4, fsdp=True
    )  # FSDP sharding spans the SP ranks too
    assert (view.dp_replicate_size, view.dp_shard_size, view.sp_size) == (1, 4, 1)
    view = accelerate_view(_sizes(sp=2, dp_replicate=2, dp_shard=2), 2, 8, fsdp=True)  # HSDP
    assert (view.dp_replicate_size, view.dp_shard_size, view.sp_size) == (2, 4, 1)
    view = accelerate_view(_sizes(sp=2), 2, 2, fsdp=True)
    assert (view.dp_replicate_size, view.dp_shard_size, view.sp_size) == (1, 2, 1)
    assert accelerate_view(_sizes(), 2, 2, fsdp=True).total_size == 1


class _Accelerator:
    """What UPipePlugin.prepare reads of an accelerate.Accelerator before its checks (they raise before prepare)."""

    def __init__(self, parallelism_config, distributed_type="DistributedType.MULTI_GPU"):
        import torch

        self.parallelism_config, self.distributed_type = parallelism_config, distributed_type
        self.num_processes, self.device = 2, torch.device("cpu")


def test_plugin_reads_the_accelerators_parallelism_config():
    from transformers import AutoModelForCausalLM

    from hf_upipe.training.plugin import UPipePlugin
    from tests.integrations._models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    with pytest.raises(
        ValueError, match=r"UPipePlugin\(sp_size=1\) and ParallelismConfig\(sp_size=2\) disagree"
    ):
        UPipePlugin(sp_size=1).prepare(_Accelerator(ParallelismConfig(sp_size=2)), model)
    with pytest.raises(ValueError, match=r"ParallelismConfig\(sp_size=2\) with DeepSpeed"):
        UPipePlugin().prepare(
            _Accelerator(ParallelismConfig(sp_size=2), "DistributedType.DEEPSPEED"), model
        )
    with pytest.raises(
        ValueError, match=r"sp_size 2 \(ParallelismConfig\(sp_size=2\)\) x dp_replicate_size 2"
    ):
        UPipePlugin().prepare(
            _Accelerator(ParallelismConfig(sp_size=2, dp_replicate_size=2)), model
        )


def test_an_sp_backend_other_than_deepspeed_is_refused():
    """accelerate 1.15 knows only sp_backend='deepspeed' (whose degree hf_upipe takes); any other backend, from the
    accelerate config or a parallelism config object, would shard the sequence a second time: refused."""
    env = find_parallelism(
        None,
        environ={
            "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            "PARALLELISM_CONFIG_SP_SIZE": "2",
            "PARALLELISM_CONFIG_SP_BACKEND": "accelerate",
        },
    )
    assert env.sp_backend == "accelerate"
    (err,) = resolve_launch(UPipeConfig(), env, 2).errors
    message = str(err)
    assert message.startswith(
        "parallelism_config_sp_backend: accelerate (PARALLELISM_CONFIG_SP_BACKEND=accelerate) with "
        "parallelism_config_sp_size: 2"
    ), message
    assert "set it to 'deepspeed'" in message

    class FutureConfig:  # what a later accelerate's ParallelismConfig(sp_backend="accelerate") looks like
        sp_size, sp_backend = 2, "accelerate"

    (err,) = resolve_launch(UPipeConfig(), find_parallelism(FutureConfig()), 2).errors
    assert "ParallelismConfig(sp_backend='accelerate') with ParallelismConfig(sp_size=2)" in str(
        err
    )
    assert (
        resolve_launch(UPipeConfig(), _sizes(sp=2), 2).errors == ()
    )  # accelerate's default backend
