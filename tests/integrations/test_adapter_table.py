"""`prepare_model` installs the adapters of `hf_upipe.prepare.ADAPTERS` in order and `unprepare_model` removes them
in the reverse order, so the revert is exact by construction: no instance forward is left, outputs are equal."""

import dataclasses

import torch

import hf_upipe.prepare as prep
from hf_upipe.config import UPipeConfig
from tests.integrations._models import build_pair, tiny_config


def _recording(adapter, log):
    def install(model, base, config):
        log.append(("+", adapter.name))
        return adapter.install(model, base, config)

    def remove(model, base):
        log.append(("-", adapter.name))
        adapter.remove(model, base)

    return dataclasses.replace(adapter, install=install, remove=remove)


def test_unprepare_removes_the_adapters_in_the_reverse_order_of_prepare(monkeypatch):
    log = []
    table = tuple(_recording(a, log) for a in prep.ADAPTERS)
    monkeypatch.setattr(prep, "ADAPTERS", table)
    _, model = build_pair(tiny_config("llama"), "sdpa", seed=2)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    want = model(input_ids=ids).logits
    prep.prepare_model(model, UPipeConfig(tiled_mlp=True))
    assert (
        sum("forward" in m.__dict__ for m in model.modules()) > 0
    )  # the fused block, the tiled MLP
    prep.unprepare_model(model)
    names = [a.name for a in table]
    assert log == [("+", n) for n in names] + [("-", n) for n in reversed(names)]
    assert not [type(m).__name__ for m in model.modules() if "forward" in m.__dict__]
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(input_ids=ids).logits, want)
