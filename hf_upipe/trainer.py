"""Deprecated path: the code lives in `hf_upipe.training.trainer`."""

from hf_upipe._moved import alias

alias(__name__, "hf_upipe.training.trainer")
