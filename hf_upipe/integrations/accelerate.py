"""`UPipePlugin` lives in `hf_upipe.plugin`, beside `hf_upipe.trainer` (both on `hf_upipe.runtime.UPipeRuntime`);
this module re-exports it for imports written as `from hf_upipe.integrations.accelerate import UPipePlugin`."""

from hf_upipe.plugin import UPipePlugin

__all__ = ["UPipePlugin"]
