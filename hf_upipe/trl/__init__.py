"""hf_upipe's TRL trainers: TRL's trainers with hf_upipe's sequence parallelism (`pip install hf_upipe[trl]`).

The three trainers are siblings on one base (`hf_upipe.trl.base.UPipeTRLTrainer`: the constructor prelude and the
shared refusals); each trainer's module holds its own config checks, and none imports another trainer.

Entry points:
- `UPipeSFTTrainer` (`hf_upipe.trl.sft`): `trl.SFTTrainer` on the runtime `UPipeTrainer` uses;
- `sft_config_errors`: what an `SFTConfig` asks that SP cannot honour, checked at construction;
- `UPipeDPOTrainer` / `dpo_config_errors` (`hf_upipe.trl.dpo`): `trl.DPOTrainer` under SP;
- `UPipeGRPOTrainer` / `grpo_config_errors` (`hf_upipe.trl.grpo`): `trl.GRPOTrainer` under SP.
"""

from hf_upipe.trl.dpo import UPipeDPOTrainer, dpo_config_errors
from hf_upipe.trl.grpo import UPipeGRPOTrainer, grpo_config_errors
from hf_upipe.trl.sft import SFT_TRAINER_INTERNALS, UPipeSFTTrainer, sft_config_errors

__all__ = ["SFT_TRAINER_INTERNALS", "UPipeSFTTrainer", "sft_config_errors"]
__all__ += ["UPipeDPOTrainer", "dpo_config_errors"]  # hf_upipe.trl.dpo: trl.DPOTrainer under SP
__all__ += ["UPipeGRPOTrainer", "grpo_config_errors"]  # hf_upipe.trl.grpo: trl.GRPOTrainer under SP
