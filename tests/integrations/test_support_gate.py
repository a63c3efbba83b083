"""Never silently wrong, never hung: the support gate, dropped semantics, settings agreement and the smaller cases.

Under sequence parallelism every class of model or call that hf_upipe does not run exactly is refused with a clear
error, the same on every rank, before any collective: unverified architectures and token mixers other than
attention (hybrids), attention that bypasses transformers' interface, attention arguments "upipe" does not implement
(also without SP), sliding windows that live only in the config or mask, RoPE whose frequencies depend on the
sequence length, `labels=` / `output_attentions` / `use_cache` under SP, shards cut for another
SP size. Ranks that ask for other settings, or that never reach a validation collective, fail within the validation
timeout with a message instead of hanging. Value heads of another width than the query/key heads (MLA) are exact.
"""

import copy
import dataclasses
import os
import types

import pytest
import torch
import torch.nn.functional as F

import hf_upipe
from hf_upipe.adapters.support import config_refusal, model_refusal, sdpa_refusal
from hf_upipe.distributed import set_sequence_parallel_state
from hf_upipe.models.presets import tiny_config
from tests._dist import run_distributed
from tests.integrations._models import build_pair
from tests.integrations._models import tiny_config as llama_like


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _outcome(fn):
    try:
        fn()
        return "ok"
    except (ValueError, NotImplementedError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"


# ---- single process: the gate's verdicts -------------------------------------------------------------------------
def test_config_refusals():
    assert config_refusal(llama_like("llama")) is None
    assert "has not verified model_type 'nonesuch'" in config_refusal(
        types.SimpleNamespace(model_type="nonesuch")
    )
    assert (
        config_refusal(types.SimpleNamespace(model_type="nonesuch"), allow_unverified=True) is None
    )
    dynamic = llama_like(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    assert "RoPE of type 'dynamic'" in config_refusal(dynamic)
    older = types.SimpleNamespace(
        model_type="llama", rope_scaling={"type": "longrope", "short_factor": [1.0]}
    )
    assert "'longrope'" in config_refusal(older)  # the older key and spelling too
    windowed = llama_like(
        "mistral", sliding_window=64
    )  # windows run in the kernel (hf_upipe.ops.windowed)
    assert config_refusal(windowed, seq_len=128) is None


@pytest.mark.parametrize(
    "model_type, reason",
    [
        # the attention layers of Qwen4-Exp are always indexed (its QSA); on transformers 5.24 its gated DeltaNet is
        # refused first while the mixers' source fingerprints are those of 5.23
        ("qwen4_exp_text", ("'indexed_attention': sparse attention", "Qwen4ExpTextGatedDeltaNet")),
        ("deepseek_v32", ("'indexed_attention': sparse attention",)),
        (
            "kimi_linear",
            ("does not go through transformers' attention interface",),
        ),  # a delta rule hf_upipe does not run
        ("mamba", ("Mamba",)),  # a pure SSM
        ("falcon_mamba", ("Mamba",)),
        (
            "jamba",
            ("Mamba",),
        ),  # a hybrid with Mamba (v1) layers, whose full-sequence scan takes no initial state
        # (the Mamba2 mixers of Bamba, Falcon-H1, Nemotron-H, Granite 4, Zamba2 and Mamba2 models run across shards)
        (
            "lfm3",
            ("Lfm3ShortConv: a short convolution",),
        ),  # a short convolution of a class hf_upipe does not run
        ("minimax", ("linear_attention",)),  # lightning attention layers
        ("rwkv", ("RWKV",)),
        ("recurrent_gemma", ("recurrent",)),
        ("xlstm", ("xLSTM",)),
        ("openai-gpt", ("does not go through transformers' attention interface",)),
        (
            "bloom",
            ("does not go through transformers' attention interface",),
        ),  # ALiBi as a float bias, its own attention
        (
            "doge",
            ("computes with attention_mask as a tensor",),
        ),  # its own mask code: measured (the matrix), not found
    ],
)
def test_model_refusals_name_the_module(model_type, reason):
    """Built on the meta device (only the modules matter): tiny where the type builds tiny, else its default size.
    The mechanism is named, not 'not verified'; opting in does not make an unhandled module handled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (a type that does not build at the tiny sizes)
        config = AutoConfig.for_model(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for found in (model_refusal(model), config_refusal(config)):
        assert (
            found is not None
            and any(r in found for r in reason)
            and "has not verified" not in found
        ), found
    if (
        model_type != "doge"
    ):  # a mechanism measured at run time (`support._MEASURED`) is named for the type alone
        found = model_refusal(model, allow_unverified=True)
        assert found is not None and any(r in found for r in reason), found


def test_config_mechanisms_whatever_the_registry_says():
    """Qwen4-Exp's PLE layers (measured wrong at SP 2) and Gemma 4's KV sharing (a crash: its code slices the masks)
    are refused for verified types and opted in too."""
    ple = types.SimpleNamespace(model_type="qwen4_exp_text", ple_layer_ids=[1])
    assert "n-gram embeddings of the previous tokens' ids" in config_refusal(
        ple, allow_unverified=True
    )
    for model_type in ("gemma4_text", "gemma4_unified_text"):
        shared = types.SimpleNamespace(model_type=model_type, num_kv_shared_layers=2)
        assert "share keys and values" in config_refusal(shared)
    assert (
        config_refusal(types.SimpleNamespace(model_type="gemma3n_text", num_kv_shared_layers=2))
        is None
    )


def test_without_sp_upipe_refuses_what_sdpa_refuses():
    assert sdpa_refusal(tiny_config("llama")) is None
    assert "does not support 'sdpa'" in sdpa_refusal(tiny_config("gemma2"))


def test_a_window_must_be_found_where_the_config_says_it_is():
    """A sliding layer (config.layer_types) whose window is neither in its mask nor in its call is refused; the
    mask's window and the call's must agree; windows at least as long as the sequence change nothing."""
    from hf_upipe.attention.kernel import sp_window
    from hf_upipe.attention.mask import SequenceParallelMask

    config = types.SimpleNamespace(
        layer_types=["full_attention", "sliding_attention"], sliding_window=4
    )
    sliding, full = (types.SimpleNamespace(config=config, layer_idx=i) for i in (1, 0))
    plain, windowed = (
        SequenceParallelMask(padding=None, plain_causal=True, window=w) for w in (None, 4)
    )
    with pytest.raises(NotImplementedError, match="layer 1 is a sliding-window layer"):
        sp_window(plain, None, 16, sliding)
    assert sp_window(plain, None, 16, full) is None
    assert sp_window(windowed, 4, 16, sliding) == 4 and sp_window(windowed, None, 16, sliding) == 4
    assert sp_window(plain, None, 4, sliding) is None  # the window covers the whole sequence
    with pytest.raises(
        NotImplementedError,
        match="passes sliding_window=3 to its attention but its mask has window 4",
    ):
        sp_window(windowed, 3, 16, sliding)


@pytest.mark.parametrize("model_type", ["bloom", "codegen", "xglm", "gpt_neox_japanese", "gpt2"])
def test_without_sp_upipe_is_sdpa_or_refused_for_float_bias_masks(model_type):
    """ALiBi and other models that add the mask as a float bias: "upipe" without SP is their reference or refused,
    never causal masking lost (`hf_upipe.tools.matrix.single_process` compares logits and every gradient)."""
    from hf_upipe.tools.matrix import single_process

    row = single_process(model_type)
    assert row["builds"] and row["decoder"], row
    assert row["sp1"] in ("exact", "refused"), row


@pytest.mark.parametrize("name", ["s_aux", "sinks", "softcap", "position_bias"])
def test_unimplemented_attention_arguments_are_refused_without_sp(name):
    from hf_upipe.attention.registered import upipe_attention_forward

    module = types.SimpleNamespace(is_causal=True, config=llama_like("llama"), training=False)
    q = torch.randn(1, 8, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    with pytest.raises(NotImplementedError, match=f"passes '{name}' to its attention"):
        upipe_attention_forward(module, q, kv, kv, None, **{name: torch.zeros(8)})


# ---- two ranks: refused on every rank, before any collective ------------------------------------------------------
def _gate_worker(rank, world):
    from transformers import AutoModelForCausalLM

    hf_upipe.init_sequence_parallel(world)
    out = {}
    S = 16
    ids = torch.randint(3, 96, (1, S), generator=torch.Generator().manual_seed(0))
    shard = hf_upipe.shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", "num_label_tokens")}
    # an attention call without position_ids (GPT-BigCode): checked where the model receives them once prepared
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config("gpt_bigcode"), attn_implementation="sdpa")
    bigcode = AutoModelForCausalLM.from_config(
        tiny_config("gpt_bigcode"), attn_implementation="upipe"
    )
    bigcode.load_state_dict(ref.state_dict())
    out["no positions, unprepared"] = _outcome(lambda: bigcode(**inputs))
    hf_upipe.prepare_model(bigcode)
    with hf_upipe.without_sequence_parallel():
        want = ref(input_ids=ids).logits[:, rank * (S // world) : (rank + 1) * (S // world)]
    out["no positions, prepared"] = float((bigcode(**inputs).logits - want).abs().max())
    hybrid = AutoModelForCausalLM.from_config(tiny_config("jamba"), attn_implementation="upipe")
    out["hybrid forward"] = _outcome(
        lambda: hybrid(**inputs)
    )  # refused at the call (the guard), before any layer
    out["hybrid prepare"] = _outcome(lambda: hf_upipe.prepare_model(hybrid))
    gpt = AutoModelForCausalLM.from_config(tiny_config("openai-gpt"), attn_implementation="upipe")
    out["no interface prepare"] = _outcome(lambda: hf_upipe.prepare_model(gpt))
    _, llama = build_pair(llama_like("llama"), "upipe", seed=3)
    dynamic = AutoModelForCausalLM.from_config(
        llama_like(
            "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        ),
        attn_implementation="upipe",
    )
    out["dynamic rope"] = _outcome(lambda: dynamic(**inputs))
    state = hf_upipe.get_sequence_parallel_state()
    set_sequence_parallel_state(dataclasses.replace(state, allow_unverified=True))  # phimoe, doge
    for model_type in (
        "qwen2_moe",
        "phimoe",
    ):  # windows that these models apply through the mask only: exact
        windowed = tiny_config(model_type)
        windowed.sliding_window, windowed.use_sliding_window, windowed.max_window_layers = (
            4,
            True,
            0,
        )
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(windowed, attn_implementation="sdpa")
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(windowed), attn_implementation="upipe"
        )
        model.load_state_dict(ref.state_dict())
        with hf_upipe.without_sequence_parallel():
            want = ref(input_ids=ids).logits[:, rank * (S // world) : (rank + 1) * (S // world)]
        out[f"window {model_type}"] = float((model(**inputs).logits - want).abs().max())
    doge = AutoModelForCausalLM.from_config(
        tiny_config("doge"), attn_implementation="upipe"
    )  # its own mask code
    out["mask used as a tensor"] = _outcome(lambda: doge(**inputs))
    set_sequence_parallel_state(state)
    hf_upipe.prepare_model(llama)
    out["labels"] = _outcome(lambda: llama(**inputs, labels=shard["shift_labels"]))
    out["shift labels"] = _outcome(
        lambda: llama(**inputs, labels=shard["shift_labels"], shift_labels=shard["shift_labels"])
    )
    out["output_attentions"] = _outcome(lambda: llama(**inputs, output_attentions=True))
    out["use_cache"] = _outcome(lambda: llama(**inputs, use_cache=True))
    out["other sp_size"] = _outcome(lambda: hf_upipe.shard_batch({"input_ids": ids}, rank, 4))
    from hf_upipe.attention.registered import upipe_attention_forward

    attention = llama.model.layers[0].self_attn
    for v_dim in (
        16,
        4,
    ):  # value heads wider / narrower than query/key heads (MLA): exact, output and gradients
        gen = torch.Generator().manual_seed(v_dim)
        full = [
            torch.randn(1, h, S, d, generator=gen, dtype=torch.float64)
            for h, d in ((8, 8), (2, 8), (2, v_dim))
        ]
        w = torch.randn(1, S, 8, v_dim, generator=gen, dtype=torch.float64)
        ref = [t.clone().requires_grad_() for t in full]
        want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).transpose(
            1, 2
        )  # [1, S, 8, Dv]
        (want * w).sum().backward()
        sh = slice(rank * (S // world), (rank + 1) * (S // world))
        mine = [t[:, :, sh].float().requires_grad_() for t in full]
        got, _ = upipe_attention_forward(
            attention, *mine, None, position_ids=inputs["position_ids"]
        )
        (got * w[:, sh].float()).sum().backward()
        out[f"mla {v_dim}"] = max(
            [_rel(got, want[:, sh])] + [_rel(m.grad, r.grad[:, :, sh]) for m, r in zip(mine, ref)]
        )
    q = torch.randn(
        1, 8, S // world, 8
    )  # sinks and softcap run under SP (tests/ops); other arguments do not
    out["position_bias under SP"] = _outcome(
        lambda: upipe_attention_forward(
            attention,
            q,
            q[:, :2],
            q[:, :2],
            None,
            position_ids=inputs["position_ids"],
            position_bias=torch.zeros(1),
        )
    )
    return out


def test_refusals_on_every_rank_before_any_collective():
    for out in run_distributed(_gate_worker, 2):
        assert out["hybrid forward"].startswith(
            "NotImplementedError: This model cannot run under sequence "
            "parallelism with hf_upipe: JambaMambaDecoderLayer: a Mamba/SSM "
            "layer"
        ), out["hybrid forward"]  # the mechanism, not 'not verified'
        assert "Train it without sequence parallelism" in out["hybrid forward"]
        assert (
            "This model's attention receives no position_ids: call hf_upipe.prepare_model(model)"
            in out["no positions, unprepared"]
        ), out["no positions, unprepared"]
        assert out["no positions, prepared"] < 1e-5
        assert "Mamba" in out["hybrid prepare"]
        assert "attention interface" in out["no interface prepare"]
        assert "RoPE of type 'dynamic'" in out["dynamic rope"]
        assert "the model reads attention_mask.dtype" in out["mask used as a tensor"], out[
            "mask used as a tensor"
        ]
        for model_type in ("qwen2_moe", "phimoe"):
            assert out[f"window {model_type}"] < 1e-5, out[f"window {model_type}"]
        assert out["labels"].startswith(
            "ValueError: labels= under sequence parallelism would be shifted"
        )
        assert out["shift labels"] == "ok"
        assert "output_attentions=True" in out["output_attentions"]
        assert "use_cache=True" in out["use_cache"]
        assert "shard_batch(sp_rank=" in out["other sp_size"] and "of 2" in out["other sp_size"]
        assert out["mla 16"] < 1e-5 and out["mla 4"] < 1e-5, (out["mla 16"], out["mla 4"])
        assert "passes 'position_bias' to its attention" in out["position_bias under SP"]


def _opt_in_worker(rank, world, allow):
    """An architecture removed from the registry: refused, unless the run opts in."""
    from hf_upipe.models import architectures

    del architectures.ARCHITECTURES["llama"]
    hf_upipe.init_sequence_parallel(world, allow_unverified=allow)
    ref, model = build_pair(llama_like("llama"), "upipe", seed=4)
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    shard = hf_upipe.shard_batch({"input_ids": ids}, rank, world)
    try:
        logits = model(**shard).logits
    except NotImplementedError as err:
        return str(err)
    with hf_upipe.without_sequence_parallel():
        want = ref(input_ids=ids).logits[:, rank * 8 : (rank + 1) * 8]
    return float((logits - want).abs().max())


def test_unverified_architectures_run_only_when_opted_in():
    for refused in run_distributed(_opt_in_worker, 2, False):
        assert "has not verified model_type 'llama'" in refused
    for error in run_distributed(_opt_in_worker, 2, True):
        assert error < 1e-5


# ---- settings agreement and bounded waits ---------------------------------------------------------------------------
def _settings_worker(rank, world, case):
    os.environ["UPIPE_VALIDATION_TIMEOUT"] = "3"
    if case == "sp_size":
        return _outcome(lambda: hf_upipe.init_sequence_parallel(2 if rank == 0 else 1))
    if case == "heads_per_chunk":
        return _outcome(
            lambda: hf_upipe.init_sequence_parallel(world, heads_per_chunk=1 if rank == 0 else None)
        )
    if case == "environment":  # a setting exported on one node only, which prepare_model would read
        if rank == 0:
            os.environ["UPIPE_FUSED_BACKWARD"] = "save"
            os.environ["UPIPE_MIXER_STATE_PASSING"] = "sequential"
        os.environ["UPIPE_OFFLOAD_PATH"] = f"/tmp/rank{rank}"  # a folder of its own: may differ
        try:
            return _outcome(lambda: hf_upipe.init_sequence_parallel(world))
        finally:
            for name in ("UPIPE_FUSED_BACKWARD", "UPIPE_MIXER_STATE_PASSING", "UPIPE_OFFLOAD_PATH"):
                os.environ.pop(name, None)
    if case == "skipped":  # rank 1 never calls init_sequence_parallel
        return _outcome(lambda: hf_upipe.init_sequence_parallel(world)) if rank == 0 else "skipped"
    if case == "reinit":
        first = hf_upipe.init_sequence_parallel(world)
        again = hf_upipe.init_sequence_parallel(world)
        other = _outcome(lambda: hf_upipe.init_sequence_parallel(world, heads_per_chunk=None))
        hf_upipe.reset_sequence_parallel()
        changed = hf_upipe.init_sequence_parallel(world, heads_per_chunk=None)
        return (again is first, other, changed.heads_per_chunk)
    # "forward": both initialise, rank 1 then runs the model without SP: rank 0 waits in the layout check
    hf_upipe.init_sequence_parallel(world)
    if rank == 1:
        hf_upipe.reset_sequence_parallel()
    _, model = build_pair(llama_like("llama"), "upipe", seed=5)
    dtype = torch.float32
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    return _outcome(
        lambda: model(
            input_ids=ids, position_ids=torch.arange(rank * 8, rank * 8 + 8)[None]
        ).logits.to(dtype)
    )


def test_ranks_with_other_upipe_variables_get_the_same_error():
    outs = run_distributed(_settings_worker, 2, "environment")
    assert outs[0] == outs[1], outs
    assert outs[0].startswith(
        "ValueError: The ranks have different UPIPE_* settings in their environment "
        "(UPIPE_FUSED_BACKWARD: 'save' on rank 0, unset on rank 1; UPIPE_MIXER_STATE_PASSING: "
        "'sequential' on rank 0, unset on rank 1)"
    ), outs[0]


@pytest.mark.parametrize("case", ["sp_size", "heads_per_chunk"])
def test_ranks_that_ask_for_other_settings_get_the_same_error(case):
    outs = run_distributed(_settings_worker, 2, case)
    assert outs[0] == outs[1] and outs[0].startswith(
        "ValueError: The ranks asked init_sequence_parallel for different settings"
    ), outs
    assert "rank 0:" in outs[0] and "rank 1:" in outs[0]


def test_a_rank_that_never_arrives_fails_the_others_within_the_timeout():
    outs = run_distributed(_settings_worker, 2, "skipped", timeout=60)
    assert outs[1] == "skipped"
    assert outs[0].startswith(
        "RuntimeError: hf_upipe: the other ranks did not reach init_sequence_parallel within 3 s"
    ), outs[0]
    outs = run_distributed(_settings_worker, 2, "forward", timeout=60)
    assert outs[1] == "ok"  # the rank without SP computed plain local attention
    assert (
        "did not reach the layout check of the attention" in outs[0] and "within 3 s" in outs[0]
    ), outs[0]


def test_initialising_again():
    same, other, changed = run_distributed(_settings_worker, 2, "reinit")[0]
    assert same is True
    assert "already called with sp_size=2, ring_size=1, heads_per_chunk=1" in other
    assert "reset_sequence_parallel()" in other
    assert changed is None


def test_attention_calls_without_documents_use_the_model_calls():
    """Nemotron's decoder layers drop the attention kwargs (upipe_cu_seqlens): the attention takes the documents of
    its own prepared model's call, for the same batch only (that call's position_ids tensor)."""
    from hf_upipe.adapters.call_checks import (
        adopt_modules,
        note_model_positions,
        with_model_documents,
    )

    model, other = (
        torch.nn.Sequential(torch.nn.Linear(2, 2)),
        torch.nn.Sequential(torch.nn.Linear(2, 2)),
    )
    adopt_modules(model)
    attention = model[0]
    pos, docs = torch.arange(8)[None], torch.tensor([0, 3, 8], dtype=torch.int32)
    note_model_positions(pos, docs, 5, model)
    try:
        got = with_model_documents({"position_ids": pos}, attention)
        assert got["upipe_cu_seqlens"] is docs and got["upipe_max_seqlen"] == 5
        assert (
            with_model_documents({}, attention)["upipe_cu_seqlens"] is docs
        )  # no positions in the call
        assert "upipe_cu_seqlens" not in with_model_documents(
            {"position_ids": pos.clone()}, attention
        )  # other batch
        assert "upipe_cu_seqlens" not in with_model_documents(
            {"position_ids": pos}, other[0]
        )  # another model
        own = torch.tensor([0, 8], dtype=torch.int32)
        assert (
            with_model_documents({"position_ids": pos, "upipe_cu_seqlens": own}, attention)[
                "upipe_cu_seqlens"
            ]
            is own
        )
    finally:
        note_model_positions(None)
    assert "upipe_cu_seqlens" not in with_model_documents({"position_ids": pos}, attention)


def _gemma3_small_vision():
    """The tiny gemma3 with a one-layer vision tower (the default one holds 86M of its 93M parameters): text runs
    and pixel values are refused before the tower would run, so its size only costs time."""
    config = tiny_config("gemma3")
    config.vision_config.update(
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    return config


def _text_only_worker(rank, world):
    """A multimodal type verified for text only: text runs; pixel values are refused on every rank, before any
    collective."""
    from transformers import AutoModelForCausalLM

    hf_upipe.init_sequence_parallel(world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gemma3_small_vision(), attn_implementation="upipe")
    hf_upipe.prepare_model(model)
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    shard = hf_upipe.shard_batch({"input_ids": ids}, rank, world)
    out = {
        "text": _outcome(
            lambda: model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        )
    }
    out["pixels"] = _outcome(
        lambda: model(
            input_ids=shard["input_ids"],
            position_ids=shard["position_ids"],
            pixel_values=torch.zeros(1, 3, 8, 8),
        )
    )
    hf_upipe.reset_sequence_parallel()
    # the same type unregistered, run opted in: its images are refused all the same
    from hf_upipe.models.architectures import ARCHITECTURES

    entries = {t: ARCHITECTURES.pop(t) for t in ("gemma3", "gemma3_text")}
    try:
        hf_upipe.init_sequence_parallel(world, allow_unverified=True)
        model = AutoModelForCausalLM.from_config(
            _gemma3_small_vision(), attn_implementation="upipe"
        )
        hf_upipe.prepare_model(model)
        out["opted in, pixels"] = _outcome(
            lambda: model(
                input_ids=shard["input_ids"],
                position_ids=shard["position_ids"],
                pixel_values=torch.zeros(1, 3, 8, 8),
            )
        )
    finally:
        ARCHITECTURES.update(entries)
        hf_upipe.reset_sequence_parallel()
    return out


def _mllama_worker(rank, world):
    """Mllama's language model, with a cross-attention layer, on text: exact (the cross-attention layer is skipped, as
    on one device); cross-attention inputs are refused on every rank before any collective."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    hf_upipe.init_sequence_parallel(world)
    config = tiny_config("mllama")  # builds MllamaForCausalLM (its text config)
    config.text_config.cross_attention_layers = [1]
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="upipe")
    model.load_state_dict(ref.state_dict())
    hf_upipe.prepare_model(model)
    ids = torch.randint(
        3, config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with hf_upipe.without_sequence_parallel():
        want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    shard = hf_upipe.shard_batch({"input_ids": ids, "labels": ids}, rank, world)
    kw = {"input_ids": shard["input_ids"], "position_ids": shard["position_ids"]}
    got = model(
        **kw,
        labels=shard["shift_labels"],
        shift_labels=shard["shift_labels"],
        num_items_in_batch=shard["num_label_tokens"],
    )
    got.loss.backward()
    loss = got.loss.detach().clone()
    dist.all_reduce(loss)
    errors, skipped = {"loss": ((loss - want.loss).abs() / want.loss.abs()).item()}, []
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), (
            name
        )  # the cross-attention layer gets none on either side
        if p.grad is None:
            skipped.append(name)
        else:
            g = q.grad.clone()
            dist.all_reduce(g)
            errors[name] = ((g - p.grad).abs().max() / p.grad.abs().max()).item()
    cross = torch.zeros(2, 4, config.text_config.hidden_size)
    refused = _outcome(lambda: model(**kw, cross_attention_states=cross))
    hf_upipe.reset_sequence_parallel()
    return errors, refused, skipped


@pytest.mark.slow
def test_mllama_runs_text_only():
    from hf_upipe.models.architectures import ARCHITECTURES

    assert ARCHITECTURES["mllama"].text_only and ARCHITECTURES["mllama_text_model"].text_only
    for errors, refused, skipped in run_distributed(_mllama_worker, 2):
        assert skipped and all(name.startswith("model.layers.1.") for name in skipped), skipped
        assert len(errors) > 10 and max(errors.values()) < 2e-5, errors
        assert refused.startswith(
            "NotImplementedError: mllama_text_model is verified under sequence parallelism "
            "for text input only, and this call passes ['cross_attention_states']"
        ), refused


def test_multimodal_types_run_text_only():
    from hf_upipe.models.architectures import ARCHITECTURES

    assert ARCHITECTURES["gemma3"].text_only and not ARCHITECTURES["gemma3_text"].text_only
    for out in run_distributed(_text_only_worker, 2):
        assert out["text"] == "ok", out["text"]
        assert out["pixels"].startswith(
            "NotImplementedError: gemma3 is verified under sequence parallelism for text "
            "input only, and this call passes ['pixel_values']"
        ), out["pixels"]
        assert out["opted in, pixels"].startswith(
            "NotImplementedError: gemma3 is not in hf_upipe's architecture registry, and this call passes "
            "['pixel_values']"
        ), out["opted in, pixels"]
