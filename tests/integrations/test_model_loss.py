"""The tiled loss of a transformers model equals the model's own loss, for every way a model post-processes its
logits that hf_upipe knows (Granite's division by `logits_scaling`, HyperCLOVA X's and Cohere's multiplication,
Gemma-style soft-capping), and anything else is refused instead of computing another loss.

`hf_upipe.training.loss.shard_loss_sum(tiled=True)` reads the lm_head's input and computes the logits itself;
before the registry knew the scalings, a Granite model with `logits_scaling=8` trained on a loss 8x too sharp.
"""

import pytest
import torch

from hf_upipe.models.presets import tiny_config
from hf_upipe.training import loss as loss_module
from hf_upipe.training.loss import shard_loss_sum


def _model(model_type, **overrides):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )


def _both(model):
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # [2, 12]: next-token targets
    model.zero_grad()
    want = model(input_ids=ids, labels=ids).loss * int((labels != -100).sum())
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, outputs = shard_loss_sum(model, {"input_ids": ids}, labels, tiled=True)
    got.backward()
    grad_error = max(
        float((p.grad - want_grads[n]).abs().max() / want_grads[n].abs().max().clamp_min(1e-12))
        for n, p in model.named_parameters()
    )
    return float(got.detach()), float(want.detach()), grad_error, outputs


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("granite", {"logits_scaling": 8.0}),  # logits / 8
        ("granitemoe", {"logits_scaling": 3.0}),
        ("hyperclovax", {"logits_scaling": 0.25}),  # logits * 0.25
        ("cohere", {"logit_scale": 0.0625}),  # logits * 0.0625
        ("gemma2", {"final_logit_softcapping": 2.0, "sliding_window": 64}),  # 2 tanh(logits / 2)
        ("llama", {}),
    ],
)
def test_tiled_loss_is_the_models_own_loss(model_type, overrides):
    model = _model(model_type, **overrides)
    got, want, grad_error, outputs = _both(model)
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert grad_error < 1e-4, grad_error
    assert (
        outputs.logits.shape[1] == 0
    )  # no logits returned on the tiled path, the probe's included


def test_unknown_logit_transforms_are_refused(monkeypatch):
    model = _model("granite", logits_scaling=8.0)
    monkeypatch.setattr(
        loss_module, "logit_multiplier", lambda config: 1.0
    )  # as before the registry knew Granite
    monkeypatch.setattr(loss_module, "_CHECKED_HEADS", type(loss_module._CHECKED_HEADS)())
    with pytest.raises(
        NotImplementedError,
        match="logits of this 'granite' model are not its lm_head's output.*tiled_loss=False",
    ):
        _both(model)


@pytest.mark.parametrize(
    "model_type, overrides", [("gemma2", {"final_logit_softcapping": 2.0}), ("llama", {})]
)
def test_token_stats_of_the_tiled_and_the_untiled_loss_agree(model_type, overrides):
    """TRL's entropy / accuracy numerators: from the tiles, or from the model's own (soft-capped) logits."""
    from hf_upipe.ops.tiled_loss import TokenStats

    model = _model(model_type, **overrides)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # [2, 12]
    labels[0, :4] = -100
    stats = {tiled: TokenStats() for tiled in (True, False)}
    for tiled, s in stats.items():
        shard_loss_sum(model, {"input_ids": ids}, labels, tiled=tiled, token_stats=s)
    assert stats[True].correct.item() == stats[False].correct.item()
    torch.testing.assert_close(stats[True].entropy_sum, stats[False].entropy_sum, rtol=1e-5, atol=0)
    assert stats[True].entropy_sum > 0
