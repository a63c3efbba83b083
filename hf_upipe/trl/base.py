"""What the TRL trainers share: one base under `UPipeSFTTrainer`, `UPipeDPOTrainer` and `UPipeGRPOTrainer`.

Each trainer is `class UPipeXTrainer(UPipeTRLTrainer, <TRL's trainer>)`, so the method resolution order is
UPipeXTrainer -> UPipeTRLTrainer -> UPipeTrainer -> TRL's trainer -> transformers.Trainer. The trainers are
siblings on this base: none imports another.

Entry points:
- `UPipeTRLTrainer`: the constructor prelude the three trainers run (the config's type; the settings it refuses,
  raised on every rank before TRL or hf_upipe run any collective; TRL's setup with peft's
  `is_gradient_checkpointing` warning filtered; then `_refuse_after_setup`), and the refusals after TRL's setup
  that more than one trainer runs;
- `accelerator_parallelism_error(pc)`: why the accelerator still asks for accelerate's own sequence or context
  parallelism (None when it does not);
- `checkpointing_off(model, kwargs)`: activation checkpointing off around a no-grad pass (a reference model's).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

from trl.models.utils import disable_gradient_checkpointing

from hf_upipe.config import UPipeConfig
from hf_upipe.training.trainer import UPipeTrainer

__all__ = ["UPipeTRLTrainer", "accelerator_parallelism_error", "checkpointing_off"]


def accelerator_parallelism_error(pc) -> str | None:
    """Why the accelerator's `ParallelismConfig` `pc` still asks for accelerate's own sequence/context parallelism
    after UPipeTrainer handed it a copy without (None when it does not)."""
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        return (
            "accelerate's sequence/context parallelism is configured on the accelerator, which would shard the "
            "sequence a second time: hf_upipe does the sequence parallelism; drop the parallelism config's "
            "sp_size/cp_size (or give the degree as UPipeConfig(sp_size=...))."
        )
    return None


@contextmanager
def checkpointing_off(model, kwargs: dict | None):
    """TRL's `disable_gradient_checkpointing` by transformers 5's names (TRL 1.16 calls the deprecated
    `is_gradient_checkpointing` / `gradient_checkpointing_*`, which warn on every reference pass); TRL's own on a
    transformers without them."""
    enabled = getattr(model, "is_activation_checkpointing", None)
    if enabled is None:
        with disable_gradient_checkpointing(model, kwargs):
            yield
        return
    if enabled:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if enabled:
            model.activation_checkpointing_enable(kwargs)


class UPipeTRLTrainer(UPipeTrainer):
    """The base of hf_upipe's TRL trainers (module docstring). A trainer sets `args_class` (TRL's config class)
    and `args_named` (how its TypeError names it), and defines `_config_errors` and `_refuse_after_setup`."""

    args_class: type = type(None)
    args_named: str = ""

    def __init__(self, model, args=None, *pargs, upipe_config: UPipeConfig | None = None, **kwargs):
        if args is not None:
            if not isinstance(args, self.args_class):
                raise TypeError(
                    f"{self._trainer_name()} takes {self.args_named}, got {type(args).__name__}."
                )
            errors = self._config_errors(args, kwargs)
            if errors:  # the same on every rank: raised before TRL or hf_upipe run any collective
                raise errors[0]
        with warnings.catch_warnings():
            # inside TRL's setup: peft 0.21 (get_peft_model for `peft_config`) reads transformers' deprecated
            # `is_gradient_checkpointing`; neither hf_upipe nor the user can avoid that read
            warnings.filterwarnings(
                "ignore",
                message="`is_gradient_checkpointing` is deprecated",
                category=FutureWarning,
            )
            super().__init__(model, args, *pargs, upipe_config=upipe_config, **kwargs)
        self._refuse_after_setup()

    @classmethod
    def _trainer_name(cls) -> str:
        """The name of the hf_upipe trainer (the class that sets `args_class`), also for a user's subclass."""
        return next(c.__name__ for c in cls.__mro__ if "args_class" in vars(c))

    def _config_errors(self, args, kwargs: dict) -> list[Exception]:
        """The trainer's refused settings of `args` and the constructor's `kwargs` (each trainer's own checks)."""
        raise NotImplementedError

    def _refuse_after_setup(self) -> None:
        """What only TRL's setup reveals; the same on every rank (same model, data and settings)."""
        raise NotImplementedError

    # ---- the refusals after TRL's setup that more than one trainer runs -----------------------------------
    def _refuse_vision_dataset(self) -> None:
        if self._is_vision_dataset:
            raise NotImplementedError(
                f"{self._trainer_name()} trains causal language models on text; vision datasets are not "
                "supported under hf_upipe's sequence parallelism."
            )

    def _refuse_aux_loss(self, why: str) -> None:
        if self.aux_loss_enabled:
            raise NotImplementedError(
                f"The model returns router logits and the MoE auxiliary loss is weighted by "
                f"{self.router_aux_loss_coef}: {why}; set "
                f"{self.args_class.__name__}(router_aux_loss_coef=0.0)."
            )

    def _refuse_accelerate_parallelism(self) -> None:
        # also set through an accelerate config file
        why = accelerator_parallelism_error(self.accelerator.parallelism_config)
        if why is not None:
            raise NotImplementedError(why)

    def _refuse_prompt_learning(self) -> None:
        peft_config = getattr(self.model, "peft_config", None) or {}
        if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
            raise NotImplementedError(
                "Prompt-learning PEFT (prefix/prompt tuning) prepends virtual tokens to every call, so each "
                "sequence shard would get its own: use an adapter method such as LoRA."
            )
