"""Deprecated path: the code lives in `hf_upipe.planning.plan_command`."""

from hf_upipe._moved import alias

alias(__name__, "hf_upipe.planning.plan_command")
