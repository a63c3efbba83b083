"""Deprecated package: its modules moved to `hf_upipe.models`, `hf_upipe.adapters`, `hf_upipe.attention`,
`hf_upipe.training` and `hf_upipe.prepare` (docs/architecture.md). The old module paths quoted in the docs
(``peft``, ``model_offload``, ``attention_tables``, ``accelerate``) re-export their new homes for one release."""

import warnings

warnings.warn(
    "hf_upipe.integrations is dissolved (docs/architecture.md); its old module paths re-export for one release.",
    DeprecationWarning,
    stacklevel=2,
)
