"""RoPE whose frequencies depend on the sequence length ("dynamic" NTK, "longrope") under SP, from the global length.

Without hf_upipe each rank would take the length from its own shard (rank 0 the short-context frequencies, the last
rank the long ones). Here: 2 gloo ranks against one process, logits on every shard and every gradient, with
geometries where a shard's own length and the global one fall on opposite sides of the original context (so the
test fails when the shard's length is used); fused and registered attention; the version gate's fingerprint;
prepare/unprepare exactness; refusal when the model was not prepared.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_upipe
from hf_upipe.adapters import rope
from tests._dist import run_distributed
from tests.integrations._models import build_pair, tiny_config


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _configs():
    dynamic = tiny_config(
        "llama",
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    longrope = tiny_config(
        "phi3",
        max_position_embeddings=64,
        rope_parameters={  # Phi-3 validates 1 factor here
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0],
            "long_factor": [7.0],
            "partial_rotary_factor": 0.5,
        },
    )
    return {"dynamic": dynamic, "longrope": longrope}


def _worker(rank, world, name, fused, S):
    config = _configs()[name]
    ref, model = build_pair(config, "upipe", seed=3)
    ids = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    ref_logits = ref(ids).logits
    F.cross_entropy(
        ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    ).backward()
    state = hf_upipe.init_sequence_parallel(world)
    try:
        hf_upipe.prepare_model(model, hf_upipe.UPipeConfig(fused_attention=fused))
        installed = sum(
            "forward" in m.__dict__ and type(m).__name__.endswith("RotaryEmbedding")
            for m in model.modules()
        )
        s = S // world
        sh = slice(rank * s, (rank + 1) * s)
        logits = model(ids[:, sh], position_ids=torch.arange(S)[sh][None]).logits
        F.cross_entropy(
            logits.flatten(0, 1), labels[:, sh].flatten(), ignore_index=-100, reduction="sum"
        ).backward()
        errs = {"logits": _rel(logits, ref_logits[:, sh])}
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=state.sp_group)
            errs[n] = _rel(g, ref_params[n].grad)
        hf_upipe.unprepare_model(model)
        left = sum("forward" in m.__dict__ for m in model.modules())
    finally:
        hf_upipe.reset_sequence_parallel()
    return installed, errs, left


def test_length_dependent_rope_uses_the_global_length():
    for name, fused, S in (("dynamic", True, 48), ("dynamic", False, 48), ("longrope", True, 24)):
        for installed, errs, left in run_distributed(_worker, 2, name, fused, S):
            assert installed == 1 and left == 0
            worst = max(errs, key=errs.get)
            assert errs[worst] < 1e-4, f"{name} (fused={fused}): {worst} rel err {errs[worst]:.2e}"


def _shard_length_worker(rank, world):
    """The same model with the rotary modules left as transformers has them: the shards' own lengths are wrong."""
    config = _configs()["dynamic"]
    ref, model = build_pair(config, "upipe", seed=3)
    ids = torch.randint(0, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    hf_upipe.init_sequence_parallel(world)
    try:
        hf_upipe.prepare_model(model)
        rope.remove_global_rope(model)
        rope._READY[id(model.config)] = __import__("weakref").ref(
            model.config
        )  # let the gate pass, to show why
        sh = slice(rank * 24, (rank + 1) * 24)
        logits = model(ids[:, sh], position_ids=torch.arange(48)[sh][None]).logits
        with hf_upipe.without_sequence_parallel():
            return _rel(logits, ref(ids).logits[:, sh])
    finally:
        rope._READY.clear()
        hf_upipe.reset_sequence_parallel()


def test_the_shards_own_lengths_would_be_wrong():
    assert max(run_distributed(_shard_length_worker, 2)) > 1e-2  # so the test above can fail


def test_dynamic_rope_update_is_verified():
    from hf_upipe.models.verification import VERIFIED_RELEASES, installed_release

    got, verdict = rope.rope_update_fingerprint(), rope.rope_verdict()
    if installed_release() in VERIFIED_RELEASES:
        assert got in rope.ROPE_FINGERPRINTS, (
            f"transformers changed dynamic_rope_update: re-verify hf_upipe/adapters/rope.py, then record {got!r}"
        )
    assert verdict.ok, verdict


def test_prepare_installs_only_on_length_dependent_rope_and_gates_on_it():
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(tiny_config("llama"))
    dynamic = AutoModelForCausalLM.from_config(copy.deepcopy(_configs()["dynamic"]))
    assert rope.install_global_rope(plain) == 0
    assert not rope.global_rope_ready(dynamic.config)
    assert rope.install_global_rope(dynamic) == 1 and rope.global_rope_ready(dynamic.config)
    assert rope.remove_global_rope(dynamic) == 1 and not rope.global_rope_ready(dynamic.config)


def test_the_trainers_setup_check_admits_what_prepare_model_handles(monkeypatch):
    """`model_refusal` (run by UPipeTrainer/the plugin before `prepare_model`) admits a length-dependent RoPE that
    `prepare_model` will make global, and refuses it when it could not (a changed `dynamic_rope_update`)."""
    from transformers import AutoModelForCausalLM

    from hf_upipe.adapters.support import model_refusal
    from hf_upipe.models.verification import Verdict

    model = AutoModelForCausalLM.from_config(copy.deepcopy(_configs()["dynamic"]))
    assert model_refusal(model) is None
    monkeypatch.setattr(
        rope, "rope_verdict", lambda: Verdict(False, "failed", "a changed dynamic_rope_update")
    )
    assert "cannot make this model's rotary modules take the global length" in model_refusal(model)
