"""The transformers.Trainer methods UPipeTrainer overrides still have the parameters it was written against.

`hf_upipe.training.trainer.TRAINER_INTERNALS` lists them; a transformers release that renames, adds or drops a
parameter of
one of them fails here, not in a user's run. (What the overrides rely on beyond signatures, e.g. that the Trainer's
checkpoint save writes through `_get_output_dir`, is checked by the equivalence and checkpoint tests.)
"""

import inspect

import pytest
from transformers import Trainer
from transformers.trainer_utils import EvalLoopOutput

from hf_upipe.training.trainer import TRAINER_INTERNALS, UPipeTrainer


@pytest.mark.parametrize("name", sorted(TRAINER_INTERNALS))
def test_overridden_trainer_method_keeps_its_parameters(name):
    params = tuple(
        p
        for p in inspect.signature(getattr(Trainer, name)).parameters
        if inspect.signature(getattr(Trainer, name)).parameters[p].kind
        not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    )
    assert params == TRAINER_INTERNALS[name], f"transformers.Trainer.{name} now takes {params}"
    assert name in vars(UPipeTrainer), (
        f"UPipeTrainer no longer overrides {name}: drop it from TRAINER_INTERNALS"
    )


def test_eval_loop_output_and_documented_attributes():
    assert EvalLoopOutput._fields == ("predictions", "label_ids", "metrics", "num_samples")
    assert "loss_is_scaled_for_ga" in vars(Trainer)  # the documented switch training_step honours
    source = inspect.getsource(Trainer.training_step)
    assert "self.loss_is_scaled_for_ga" in source
