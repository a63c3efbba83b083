"""Liger and Hub kernels under sequence parallelism (docs/kernels.md): the support gate finds every replaced forward
(`hf_upipe.adapters.replaced`), admits per-token ones it verified by behaviour and refuses the rest; the fused
block and the tiled MLP/norms compose with the admitted ones exactly (SP 2 against one process, with the same
replacements); UPipeTrainer applies Liger itself, with its fused linear cross-entropy, cross-entropy and RoPE off.
The replacements are simulated with plain torch (`tests/integrations/_kernels.py`); the tests marked `liger` run
the real liger-kernel where it is installed."""

import importlib.util
import logging
import sys
import types

import pytest
import torch

import hf_upipe
from hf_upipe.adapters.replaced import replaced_forwards, replacement_refusal
from tests._dist import run_distributed
from tests.integrations import _kernels as K
from tests.integrations._models import build_pair, sharded_errors, tiny_config

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


def _model(arch="llama", seed=0):
    return build_pair(tiny_config(arch), "upipe", seed)[1]


def test_gate_sees_each_kind_of_replacement():
    model = K.simulate_liger(_model(), flce=True)
    kinds = {(r.owner, r.kind) for r in replaced_forwards(model)}
    assert kinds == {
        ("LlamaRMSNorm", "instance"),
        ("LlamaMLP", "instance"),
        ("LlamaForCausalLM", "instance"),
    }
    assert "LlamaForCausalLM (the model)" in replacement_refusal(model)
    assert "fused_linear_cross_entropy=False" in replacement_refusal(model)
    from transformers.models.llama import modeling_llama as ml

    plain, forward, rope = _model(), ml.LlamaDecoderLayer.forward, ml.apply_rotary_pos_emb
    try:  # a class forward and the modeling module's RoPE function, replaced by hand
        ml.LlamaDecoderLayer.forward = K.liger_swiglu_forward
        ml.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: rope(q, k, cos, sin)
        found = {(r.owner, r.kind) for r in replaced_forwards(plain)}
        assert found == {
            ("LlamaDecoderLayer", "class"),
            ("transformers.models.llama.modeling_llama.apply_rotary_pos_emb", "function"),
        }
        assert "LlamaDecoderLayer (model.layers.0)" in replacement_refusal(plain)
    finally:
        ml.LlamaDecoderLayer.forward, ml.apply_rotary_pos_emb = forward, rope
    assert replaced_forwards(plain) == []
    assert replaced_forwards(K.simulate_hub_kernels(_model())) == []  # kernelize's CPU fallback


def test_fsdp2_layer_classes_are_the_layers_own_forward():
    """FSDP2 swaps each sharded module's class for `FSDP<Layer>(FSDPModule, Layer)`, and transformers wraps every
    subclass's forward in its checkpointing wrapper: that is still the layer's own forward. The same wrapper around
    a replaced base forward is still seen."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.models.llama import modeling_llama as ml

    def fsdp_class(cls):  # as torch.distributed.fsdp's fully_shard builds it
        dct = {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"}
        return type(f"FSDP{cls.__name__}", (FSDPModule, cls), dct)

    model = _model()
    layer = model.model.layers[0]
    layer.__class__ = fsdp_class(ml.LlamaDecoderLayer)
    assert type(layer).__dict__["forward"] is not ml.LlamaDecoderLayer.__dict__["forward"]
    assert replaced_forwards(model) == []
    forward = ml.LlamaDecoderLayer.forward
    try:  # the wrapper around a replaced forward
        ml.LlamaDecoderLayer.forward = K.liger_swiglu_forward
        layer.__class__ = fsdp_class(ml.LlamaDecoderLayer)
        found = {(r.path, r.owner, r.kind, r.by) for r in replaced_forwards(model)}
        liger = f"{K.liger_swiglu_forward.__module__}.{K.liger_swiglu_forward.__qualname__}"
        assert ("model.layers.0", "FSDPLlamaDecoderLayer", "class", liger) in found
    finally:
        ml.LlamaDecoderLayer.forward = forward


def test_trls_fused_lm_head_is_the_class_forward_and_a_lookalike_is_not():
    """TRL's DPOTrainer installs its fused LM head as the model's forward (functools.wraps of the class's): the gate
    admits exactly that function; another wrapper that copies the same name is still a replacement."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = _model()
    trl_utils.add_fused_lm_head(model)
    assert "forward" in model.__dict__ and replaced_forwards(model) == []
    import functools

    cls_forward = type(model).forward

    @functools.wraps(cls_forward)
    def _fused_forward(self, *args, **kwargs):  # same name and __wrapped__, another module
        return cls_forward(self, *args, **kwargs)

    other = _model()
    other.forward = types.MethodType(_fused_forward, other)
    assert [(r.owner, r.kind) for r in replaced_forwards(other)] == [
        ("LlamaForCausalLM", "instance")
    ]


def test_gate_verifies_per_token_replacements_by_behaviour():
    assert replacement_refusal(K.simulate_liger(_model())) is None
    mixing = replacement_refusal(K.simulate_liger(_model(), mlp=K.not_per_token_forward))
    assert "not verified to be per-token" in mixing and "differs from the whole" in mixing
    raising = replacement_refusal(K.simulate_liger(_model(), mlp=K.gpu_only_forward))
    assert "raised RuntimeError" in raising and "0 active drivers" in raising
    assert replacement_refusal(K.simulate_hub_kernels(_model(), real=True)) is None
    from transformers.models.llama import modeling_llama as ml

    rope = ml.apply_rotary_pos_emb
    try:  # a RoPE that rotates by the position in the shard, not the angle given: not per-token
        ml.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q.cumsum(2), k)
        assert "rotated q/k part 1" in replacement_refusal(_model())
    finally:
        ml.apply_rotary_pos_emb = rope


def test_tiled_mlp_wraps_a_kernel_forward_and_gives_it_back():
    model = K.simulate_liger(_model())
    mlp = model.model.layers[0].mlp
    kernel = mlp.__dict__["forward"]
    hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=True, mlp_chunk_tokens=3))
    assert mlp.__dict__["_upipe_wrapped_forward"] is kernel
    assert mlp.__dict__["forward"].__func__.__name__ == "_tiled_forward"
    hf_upipe.unprepare_model(model)
    assert mlp.__dict__["forward"] is kernel and "_upipe_wrapped_forward" not in mlp.__dict__


def test_a_replaced_projection_norm_keeps_the_registered_path():
    from hf_upipe.attention.fused import unfused_reason

    model = K.simulate_liger(
        _model("olmo2"), swiglu=False
    )  # OLMo 2's q_norm/k_norm: re-implemented
    reason = unfused_reason(model.model.layers[0].self_attn)
    assert reason == "a replaced q_norm forward (tests.integrations._kernels.liger_rms_forward)"


def test_tiled_mlp_leaves_a_replacement_it_cannot_verify(caplog):
    model = K.simulate_liger(_model(), mlp=K.gpu_only_forward, rms_norm=False)
    with caplog.at_level(logging.WARNING, logger="hf_upipe"):
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=True))
    mlp = model.model.layers[0].mlp
    assert mlp.forward.__func__ is K.gpu_only_forward  # not stacked on
    assert "LlamaMLP: another library replaced its forward" in caplog.text
    hf_upipe.unprepare_model(model)


def _kernels_case(rank, world, arch, how, tiled, lora):
    cfg = tiny_config(arch, heads=4, kv_heads=2)
    ref, model = build_pair(cfg, "upipe", 3)
    if lora:
        from tests.integrations.test_fused_models import _with_lora

        ref, model = _with_lora(ref, model, 3)
    if (
        how == "rope"
    ):  # Liger's RoPE as apply_liger_kernel_to_llama() applies it: the module's function
        from transformers.models.llama import modeling_llama as ml

        ml.apply_rotary_pos_emb = K.kernel_rope(ml.apply_rotary_pos_emb)
    for m in (ref, model) if how != "dropped" else (model,):  # the same kernels in the reference
        if how in ("liger", "dropped"):
            K.simulate_liger(m)
        elif how.startswith("hub"):
            K.simulate_hub_kernels(m, real=how == "hub")
    hf_upipe.init_sequence_parallel()
    try:
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(tiled_mlp=tiled, mlp_chunk_tokens=3))
        from hf_upipe.attention.fused import count_fused

        fused = count_fused(model)
        wrapped = sum("_upipe_wrapped_forward" in m.__dict__ for m in model.modules())
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
        errors, n = sharded_errors(ref, model, ids, rank, world)
    finally:
        hf_upipe.reset_sequence_parallel()
    return errors, n, fused, wrapped


KERNEL_CASES = [  # (arch, simulated kernels, tiled MLP/norms, LoRA): modules wrapped by the tiles, fused
    ("llama", "liger", True, False, 2 * 1 + 2 * 2 + 1, 2),
    ("qwen3", "liger", True, True, 2 + 4 + 1, 2),  # q_norm/k_norm: called by the fused block
    ("llama", "hub", True, False, 2 * 2 + 1, 2),
    ("llama", "hub-fallback", True, False, 2 * 2 + 1, 2),  # kernelize without a kernel for CPU
    ("llama", "liger", False, False, 0, 2),
    # the fused block re-implements transformers' RoPE: its verdict (by behaviour, the source changed) fails
    # against the replaced function, so attention takes the registered path, which calls it
    ("llama", "rope", True, False, 0, 0),
]


@pytest.fixture(scope="module")
def kernel_results():
    cases = [("llama", "dropped", True, False)] + [
        c[:4] for c in KERNEL_CASES
    ]  # rope last: it stays
    return run_distributed(_kernels_worker, 2, cases)


def _kernels_worker(rank, world, cases):
    return [_kernels_case(rank, world, *c) for c in cases]


@pytest.mark.slow  # one 2-rank run of every case: about 30 s on 2 busy cores
@pytest.mark.parametrize("i", range(len(KERNEL_CASES)))
def test_kernels_compose_exactly_under_sp(kernel_results, i):
    *_, want_wrapped, want_fused = KERNEL_CASES[i]
    for errors, n, fused, wrapped in (r[i + 1] for r in kernel_results):
        assert n > 0 and fused == want_fused, (n, fused)
        assert wrapped == want_wrapped
        bad = {k: v for k, v in errors.items() if not v <= 2e-5}
        assert not bad, bad


@pytest.mark.slow
def test_the_comparison_sees_a_dropped_kernel(kernel_results):
    for errors, *_ in (r[0] for r in kernel_results):  # kernels on one side only
        assert errors["logits"] > 1e-2, errors["logits"]


def _fake_liger():
    """A stand-in for liger_kernel.transformers: patches the instance as liger does, and rebinds transformers'
    modeling module as it does."""

    def apply(model, **kwargs):
        from transformers.models.llama import modeling_llama as ml

        ml.LlamaRMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
        ml.apply_rotary_pos_emb = lambda *a, **k: None
        apply.calls.append(kwargs)
        K.simulate_liger(model, flce=kwargs.get("fused_linear_cross_entropy", True))

    apply.calls = []
    package = types.ModuleType("liger_kernel")
    module = types.ModuleType("liger_kernel.transformers")
    module._apply_liger_kernel_to_instance = apply
    package.transformers = module
    return {"liger_kernel": package, "liger_kernel.transformers": module}, apply


def test_trainer_applies_liger_before_prepare_and_not_again(tmp_path, monkeypatch):
    from transformers import TrainingArguments
    from transformers.models.llama import modeling_llama as ml

    modules, apply = _fake_liger()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    before = ml.LlamaRMSNorm, ml.apply_rotary_pos_emb
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_liger_kernel=True,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        save_strategy="no",
        liger_kernel_config={"fused_linear_cross_entropy": True, "swiglu": True},
    )
    model = _model()
    ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in ids]
    trainer = hf_upipe.UPipeTrainer(
        model, args, train_dataset=data, upipe_config=hf_upipe.UPipeConfig(tiled_mlp=True)
    )
    assert apply.calls == [
        {"fused_linear_cross_entropy": False, "swiglu": True, "cross_entropy": False, "rope": False}
    ]
    assert (ml.LlamaRMSNorm, ml.apply_rotary_pos_emb) == before  # transformers' module as it was
    assert args.use_liger_kernel and not trainer.args.use_liger_kernel
    mlp = model.model.layers[0].mlp
    assert mlp.__dict__["_upipe_wrapped_forward"].__func__ is K.liger_swiglu_forward
    trainer.train()
    assert len(apply.calls) == 1  # not applied again by Trainer.train
    assert mlp.__dict__["_upipe_wrapped_forward"].__func__ is K.liger_swiglu_forward


@pytest.mark.skipif(
    not HAS_LIGER, reason="liger-kernel is not installed (the simulated tests above run)"
)
def test_real_liger_is_found_and_refused_where_its_kernels_cannot_run():
    from hf_upipe.training.liger import apply_liger

    model = _model("qwen3")
    settings = apply_liger(model)
    assert settings["fused_linear_cross_entropy"] is False and settings["rope"] is False
    owners = {(r.owner, r.by.rsplit(".", 2)[-2]) for r in replaced_forwards(model)}
    assert owners == {("Qwen3RMSNorm", "LigerRMSNorm"), ("Qwen3MLP", "LigerSwiGLUMLP")}
    reason = replacement_refusal(model)
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "liger_kernel.transformers" in reason and "raised" in reason


def _refused_worker(rank, world, tmp):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=tmp, use_liger_kernel=True, report_to=[], use_cpu=True)
    try:
        hf_upipe.UPipeTrainer(_model(), args, upipe_config=hf_upipe.UPipeConfig(sp_size=2))
    except NotImplementedError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_LIGER, reason="liger-kernel is not installed (the simulated tests above run)"
)
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU Liger's kernels run and are admitted"
)
def test_real_liger_trainer_refused_on_every_rank(tmp_path):
    errors = run_distributed(_refused_worker, 2, str(tmp_path))
    assert all(e is not None and "LigerSwiGLUMLP.forward" in e for e in errors), errors
