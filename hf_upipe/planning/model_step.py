"""The model of a simulated or measured training step: a Llama (or any causal LM config) with the attention
implementation under test, prepared as a run prepares it.

Entry points:
- `StepSettings`: the knobs of a step (attention implementation, head chunk, tiled MLP and loss with their tiles,
  offload of checkpointed inputs, model offload, ring); `device_twin(settings)`: the settings whose device memory
  they have. `StepCase`: what the step runs (model config, depth, length, SP degree, dtype, LoRA, kernel).
- `build_step_model(case, settings, group, *, dtype)`: the model with `case.layers` decoder layers, activation
  checkpointing, the tiled MLP, LoRA, and for our impls `prepare_model`.
- `impl_context(impl, group, seq_len, sp_size, heads_per_chunk, ring_size=1, ...)`: validates and installs the SP
  defaults of an impl (DeepSpeed's communicator for the peer); restores them on exit.
- `require_deepspeed()`, `deepspeed_comm()`, `deepspeed_attention` (registered as `DS_ATTN_NAME`): DeepSpeed's
  Ulysses, the peer: its class, its communicator on the initialised process group, its attention function.
- `step_config(model_config, layers, seq_len)`, `llama_config(name)`: the configs (presets of
  `hf_upipe.models.presets.PRESETS`: "llama3-8b", "qwen3-8b", ...).

`impl`: "deepspeed" (DeepSpeed 0.19.8 `UlyssesSPAttentionHF` around sdpa, the peer), "ulysses" (our registered
path with all local heads in one chunk), "upipe" (registered, `heads_per_chunk`), "fused" (the fused block); each
of ours prepared as a run prepares it (`prepare_model`: global RoPE, a hybrid's mixers, the input checks).
Every impl gets the same stack around attention: activation checkpointing of every layer, optional tiled MLP
(`hf_upipe.adapters.tiled_mlp`, chunks of `hidden_size` tokens), optional offload of the checkpointed layer inputs
("cpu": to host memory, the last layer's input kept on the device), and the tiled loss. The activation
measurements on this model are in `hf_upipe.planning.activation_step`, the whole step's in
`hf_upipe.planning.train_step`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import importlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hf_upipe import distributed as _sp
from hf_upipe.adapters.hooks import sync_guard
from hf_upipe.models.peft import base_model
from hf_upipe.models.presets import PRESETS
from hf_upipe.ops.fake import simulating
from hf_upipe.planning.simulate import is_fake

__all__ = [
    "DS_ATTN_NAME",
    "MODEL_IMPLEMENTATIONS",
    "PRESETS",
    "StepCase",
    "StepSettings",
    "build_step_model",
    "deepspeed_attention",
    "deepspeed_comm",
    "device_twin",
    "llama_config",
    "require_deepspeed",
    "step_config",
]

MODEL_IMPLEMENTATIONS = ("deepspeed", "ulysses", "upipe", "fused")
DS_ATTN_NAME = "ds_ulysses"  # DeepSpeed's Ulysses, the peer, as transformers' attention function


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The settings of a simulated step.

    Attributes:
        impl: "fused" (UPipe, the fused attention block), "upipe" (registered attention), "ulysses" (the same code,
            all local heads in one chunk) or "deepspeed" (DeepSpeed's `UlyssesSPAttentionHF`, the peer).
        heads_per_chunk: query heads per rank per UPipe stage (ignored by "ulysses" and "deepspeed").
        tiled_mlp: tile the MLPs and RMSNorms over `mlp_chunk_tokens` (None: `hidden_size` tokens).
        tiled_loss: compute the loss in chunks of `loss_chunk_tokens` (None: about 512 MiB of fp32 logits).
        offload: "none", "cpu" or "disk": checkpointed layer inputs go to host memory or to files (the last
            layer's stays). On the device "disk" is "cpu": the disk store copies each input to the host before its
            background write (`OffloadStore._write`: the pending writes hold host copies, not device tensors) and
            reads it back onto the compute stream when its layer is recomputed, one at a time; it is simulated as
            "cpu" (`device_twin`).
        model_offload: "none" or "cpu": FSDP2's host offload (`UPipeConfig.model_offload`): the parameter shards,
            the reduced gradient shards, AdamW's states and its step in host memory (`_host_model_state`).
        fused_backward: the fused block's backward mode, "recompute" (least memory) or "save" (`UPipeConfig`).
        overlap: the fused block's all-to-alls issued one stage ahead (`UPipeConfig.overlap_comm`).
        ring_size: ring attention across R ring shards of the SP group (`UPipeConfig.ring_size`; our impls only):
            UPipe's head chunks over sp_size / R ranks.
    """

    impl: str = "fused"
    heads_per_chunk: int | None = 1
    tiled_mlp: bool = True
    mlp_chunk_tokens: int | None = None
    tiled_loss: bool = True
    loss_chunk_tokens: int | None = None
    offload: str = "cpu"
    fused_backward: str = "recompute"
    overlap: bool = False
    ring_size: int = 1
    model_offload: str = "none"

    def __post_init__(self):
        if self.impl not in MODEL_IMPLEMENTATIONS:
            raise ValueError(f"impl={self.impl!r}: choose one of {MODEL_IMPLEMENTATIONS}")
        if self.offload not in ("none", "cpu", "disk"):
            raise ValueError(f"offload={self.offload!r}: choose 'none', 'cpu' or 'disk'")
        if self.model_offload not in ("none", "cpu"):
            raise ValueError(f"model_offload={self.model_offload!r}: choose 'none' or 'cpu'")
        if self.fused_backward not in ("recompute", "save"):
            raise ValueError(
                f"fused_backward={self.fused_backward!r}: choose 'recompute' or 'save'"
            )
        if self.impl != "fused" and (self.overlap or self.fused_backward != "recompute"):
            raise ValueError(
                f"overlap and fused_backward are settings of the fused block, not of impl={self.impl!r}"
            )


def device_twin(settings: StepSettings) -> StepSettings:
    """The settings whose device memory `settings` has: offload="disk" holds on the device what "cpu" holds (the
    input leaves the device at pack, synchronously copied to the host for the background write; one is copied back
    per recomputed layer), so it is simulated, calibrated and cached as "cpu"."""
    if settings.offload == "disk":
        return dataclasses.replace(settings, offload="cpu")
    return settings


@dataclasses.dataclass(frozen=True)
class StepCase:
    """What a simulated or measured step runs, apart from its `StepSettings`: the model and its depth, the sequence
    and how many ranks share it, the compute dtype, the kind of fine-tune and the inner attention kernel.

    Attributes:
        model_config: a Llama geometry dict (`llama_config`) or a transformers config.
        seq_len: tokens of the whole sequence (batch 1), divisible by `sp_size`.
        sp_size: ranks sharing one sequence (contiguous groups, as `hf_upipe.init_sequence_parallel` builds them).
        layers: decoder layers to build.
        dtype: compute dtype (FSDP2's param_dtype).
        lora: None for a full fine-tune (fp32 master weights); (rank, target module names) for LoRA: the frozen base
            in `dtype`, fp32 adapters, AdamW on the adapters only.
        kernel: the inner attention kernel of our impls (`init_sequence_parallel`'s `kernel`); a hollow one
            ("hollow-<name>", inside `hf_upipe.ops.kernels_hollow.hollow_attention()`) measures the step's memory
            without the attention's arithmetic, also for "deepspeed" (`hf_upipe.planning.hollow_step`).
    """

    model_config: object
    seq_len: int
    sp_size: int
    layers: int
    dtype: torch.dtype = torch.bfloat16
    lora: tuple | None = None
    kernel: str = "auto"


def require_deepspeed():
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError as err:
        raise ImportError(
            "impl='deepspeed' needs DeepSpeed (UlyssesSPAttentionHF, tested with 0.19.8): "
            "pip install 'hf_upipe[bench]'"
        ) from err
    return UlyssesSPAttentionHF


def deepspeed_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """Registered as "ds_ulysses": hands the call to the DeepSpeed wrapper attached to the module."""
    return module.ds_ulysses(module, query, key, value, attention_mask, *args, **kwargs)


@contextlib.contextmanager
def deepspeed_comm() -> Iterator[None]:
    """deepspeed.comm on top of the already initialised torch.distributed group; restored on exit.

    `deepspeed.comm.init_distributed` would JIT-compile DeepSpeed's shared-memory all-reduce (about a minute, and
    unused by Ulysses), so the TorchBackend is built with that step skipped.
    """
    require_deepspeed()
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module(
        "deepspeed.comm.torch"
    )  # `import ... as` would give the torch package

    previous = ds_comm.cdb
    if previous is None or not previous.is_initialized():
        build = ds_torch.build_shm_op
        ds_torch.build_shm_op = lambda: None
        try:
            ds_comm.cdb = ds_torch.TorchBackend(
                dist.get_backend(), datetime.timedelta(minutes=30), None
            )
        finally:
            ds_torch.build_shm_op = build
    try:
        yield
    finally:
        ds_comm.cdb = previous


def llama_config(name: str) -> dict:
    """A copy of a preset geometry (keys of `transformers.LlamaConfig`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[name])


@contextlib.contextmanager
def impl_context(
    impl: str,
    group,
    seq_len: int,
    sp_size: int,
    heads_per_chunk: int | None,
    ring_size: int = 1,
    kernel: str = "auto",
):
    """Validate, install the SP defaults for our impls (DeepSpeed's communicator for the peer), restore on exit.
    With `ring_size` > 1 the SP groups are built anew (`init_sequence_parallel(sp_size, ring_size=...)`).
    `kernel`: our impls' inner attention kernel (`init_sequence_parallel`'s)."""
    if impl not in MODEL_IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: choose one of {MODEL_IMPLEMENTATIONS}")
    if seq_len % (sp_size * (2 if ring_size > 1 else 1)):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by sp_size={sp_size}"
            + (f" x 2 (a ring of {ring_size} cuts {2 * ring_size} chunks)" if ring_size > 1 else "")
        )
    if ring_size > 1 and impl == "deepspeed":
        raise ValueError("ring_size > 1 is hf_upipe's ring attention: DeepSpeed's Ulysses has none")
    previous = _sp.get_sequence_parallel_state()
    hpc = None if impl == "ulysses" else heads_per_chunk
    if ring_size > 1:
        _sp.set_sequence_parallel_state(None)
        _sp.init_sequence_parallel(sp_size, ring_size=ring_size, heads_per_chunk=hpc, kernel=kernel)
    elif impl != "deepspeed":
        _sp.init_sequence_parallel(group=group, heads_per_chunk=hpc, kernel=kernel)
    try:
        with deepspeed_comm() if impl == "deepspeed" else contextlib.nullcontext():
            if impl == "deepspeed":  # the peer measured as it runs: no hf_upipe guard on its model
                sync_guard(False)
            yield
    finally:
        _sp.set_sequence_parallel_state(previous)  # (the guard follows the state again)


def _no_mask(*args, **kwargs):
    return None


def step_config(model_config, layers: int, seq_len: int):
    """A transformers config with `layers` decoder layers: from a geometry dict (Llama's keys, or a preset's row
    with its model_type), or a copy of a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        config = copy.deepcopy(model_config)
        text = config.get_text_config()  # the language model's (itself for a text model)
        text.num_hidden_layers = layers
        text.max_position_embeddings = max(
            seq_len, getattr(text, "max_position_embeddings", 0) or 0
        )
        config.use_cache = text.use_cache = False
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = list(text.layer_types)[:layers] + [text.layer_types[-1]] * max(
                0, layers - len(text.layer_types)
            )
        return config
    values = dict(model_config)  # a geometry dict: Llama's keys, or a preset's with its model_type
    model_type = values.pop("model_type", "llama")
    values = {"tie_word_embeddings": False, **values, "num_hidden_layers": layers}
    return AutoConfig.for_model(
        model_type,
        **values,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        use_cache=False,
    )


_MODULE_TO = torch.nn.Module.to


def _to_unless_unchanged(module, *args, **kwargs):
    """`nn.Module.to`, returning the module untouched when no tensor would change device or dtype."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = [*module.parameters(), *module.buffers()]
    if all(
        (device is None or t.device == device)
        and (dtype is None or t.dtype == dtype or not t.is_floating_point())
        for t in tensors
    ):
        return module
    return _MODULE_TO(module, *args, **kwargs)


def _new_model(config, dtype):
    """The model of `config` with its parameters in `dtype` (no initialisation on fake tensors).

    `dtype` is passed to `from_config`: a config's own `dtype` (a Hub config's "bfloat16") would otherwise win over
    the default dtype set here, and the step would hold bf16 master weights where a run holds fp32. Tied weights
    are tied here (skipping the initialisation skips transformers' tying)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # module.to(dtype) fails under fake mode
    try:
        # fake weights need no values (and some initialisations read them: truncated normals, Gemma 3's vision)
        with no_init_weights() if simulating() else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # without initialisation transformers ties no weights: tie them as a run's model has them (one tensor for
        # the embeddings and the lm_head where the config says tie_word_embeddings)
        model.tie_weights()
        return model
    finally:
        torch.set_default_dtype(previous)


def _attach_deepspeed(model, config, layers, group) -> None:
    """DeepSpeed's `UlyssesSPAttentionHF` on every attention module of `model` (the peer)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ds_cls = require_deepspeed()
    for layer in model.model.layers:
        layer.self_attn.ds_ulysses = ds_cls(
            attn=sdpa_attention_forward,
            batch_size=1,
            attn_head_count=config.num_attention_heads,
            attn_head_size=config.head_dim,
            kv_head_count=config.num_key_value_heads,
            num_hidden_layers=layers,
            process_group=group,
            seq_length_is_variable=True,
        )


def _with_lora(model, lora, dtype):
    """`model` wrapped with PEFT LoRA adapters of `lora` = (rank, target module names)."""
    from peft import LoraConfig

    from hf_upipe.models.peft import get_peft_model

    rank, targets = lora
    previous = torch.get_default_dtype()
    # On fake tensors: PEFT moves each new adapter to its base layer's device and dtype with module.to(), which
    # cannot swap fake parameters. Made on the base's device in the base's dtype, the adapters need no move, so
    # those calls are skipped; PEFT then casts the adapters to fp32 itself (autocast_adapter_dtype) by assigning
    # new parameters. Real tensors take PEFT's own path untouched.
    torch.set_default_dtype(dtype)
    if is_fake(next(model.parameters())):
        torch.nn.Module.to = _to_unless_unchanged
    try:
        return get_peft_model(
            model,
            LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets)),
        )
    finally:
        torch.nn.Module.to = _MODULE_TO
        torch.set_default_dtype(previous)


def _prepare_ours(model, config, impl, fused_backward, overlap) -> None:
    """`prepare_model` as a run calls it: the fused block (impl "fused"), global RoPE, mixers, the checks."""
    from hf_upipe.attention.fused import count_fused, fused_unavailable
    from hf_upipe.config import UPipeConfig
    from hf_upipe.prepare import prepare_model

    # impl "fused" must measure the fused block, or its figures would be the registered path's under its name
    if impl == "fused" and (why := fused_unavailable(config)) is not None:
        raise ValueError(
            f"the fused attention block cannot be planned for this model: {why}. Plan the "
            "registered path instead (impl 'upipe')."
        )
    # (explicit values: the planner's settings, not the environment's UPIPE_*; tiling is applied by the caller)
    prepare_model(
        model,
        UPipeConfig(
            fused_attention=impl == "fused",
            fused_backward=fused_backward,
            overlap_comm=overlap,
            tiled_mlp=False,
            auto=False,
        ),
    )
    if impl == "fused" and not count_fused(model):
        raise ValueError(
            "the fused attention block cannot be planned for this model: prepare_model installed "
            "it on none of its attention modules (they keep the registered 'upipe' path). Plan "
            "that path instead (impl 'upipe')."
        )


def _enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, or ValueError if the model has none."""
    if not getattr(base_model(model), "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(base_model(model)).__name__} does not support activation checkpointing, which "
            "every step hf_upipe plans (and its Trainer runs) uses on every decoder layer: the "
            "planner cannot plan it."
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def build_step_model(
    case: StepCase,
    settings: StepSettings,
    group,
    *,
    dtype: torch.dtype,
    checkpointing: bool = True,
    drop_grads: bool = True,
):
    """The model a simulated step runs: `settings.impl`'s attention, optional tiled MLP (`settings.tiled_mlp`, tiles
    of `settings.mlp_chunk_tokens`), checkpointing; parameters in `dtype`.

    `case.model_config`: a Llama geometry dict or a transformers config (any supported architecture), built with
    `case.layers` decoder layers. `drop_grads`: each parameter's gradient is dropped once accumulated (the
    activation-only steps; FSDP2 keeps its sharded ones). `case.lora`: (rank, target module names) wraps the model
    with PEFT LoRA adapters (fp32; the base stays in `dtype`, frozen), as a LoRA fine-tune loads it.
    `settings.fused_backward`: the fused block's backward mode ("recompute" or "save"); `settings.overlap`: its
    all-to-alls one stage ahead.
    """
    impl, layers, lora = settings.impl, case.layers, case.lora
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = step_config(case.model_config, layers, case.seq_len)
    config._attn_implementation = DS_ATTN_NAME if impl == "deepspeed" else "upipe"
    if impl == "deepspeed":
        AttentionInterface.register(DS_ATTN_NAME, deepspeed_attention)
        AttentionMaskInterface.register(
            DS_ATTN_NAME, _no_mask
        )  # DeepSpeed's sdpa runs is_causal=True
    model = _new_model(config, dtype)
    if impl == "deepspeed":
        _attach_deepspeed(model, config, layers, group)
    if lora is not None:
        model = _with_lora(model, lora, dtype)
    if impl != "deepspeed":  # as a run prepares it
        _prepare_ours(model, config, impl, settings.fused_backward, settings.overlap)
    if settings.tiled_mlp:
        from hf_upipe.adapters.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, settings.mlp_chunk_tokens)
    if checkpointing:
        _enable_checkpointing(model)
    model.train()
    if drop_grads:
        for p in (
            model.parameters()
        ):  # persistent gradients are not activations: drop each one once accumulated
            p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))
    return model
