"""hf_upipe's own log lines on the console by default: INFO and up, from the first rank only.

Entry point: `install_console_handler()`, called once by `import hf_upipe`. It adds one handler to the `hf_upipe`
logger and sets that logger to INFO, unless the user already gave that logger a level or a handler. The handler
writes each message (each names hf_upipe or its class) to stderr, only while nobody configured logging (the root
logger has no handler) and only on rank 0 (the initialized process group's rank, else the launcher's RANK
variable; never in the planner's simulated ranks). Records still propagate: once the user configures logging
(`logging.basicConfig`, a framework, pytest's capture), their handlers get the records and this one stays silent,
so no line is printed twice. `logging.getLogger("hf_upipe").setLevel(logging.WARNING)` silences the INFO lines.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "hf_upipe"


def _is_first_rank() -> bool:
    """Rank 0 of a real run; False inside the planner's simulated ranks (a "fake" process group), whose setup
    lines (SP groups, fused blocks of the simulated model) are not the user's run."""
    dist = sys.modules.get("torch.distributed")  # not imported: no process group can exist
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0 and dist.get_backend() != "fake"
    return os.environ.get("RANK", "0") == "0"


class _ConsoleHandler(logging.StreamHandler):
    """Writes to the current sys.stderr, and only where nobody else would: no root handler, rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # the stderr of the moment (tests and tools swap sys.stderr)
        return sys.stderr

    @stream.setter
    def stream(
        self, value
    ) -> None:  # StreamHandler.__init__ assigns it; the property always reads sys.stderr
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or not _is_first_rank():
            return  # the user's logging configuration prints it (propagation), or another rank's line
        if any(h is not self for h in logging.getLogger(LOGGER_NAME).handlers):
            return  # the user gave the hf_upipe logger its own handler
        super().emit(record)


def install_console_handler() -> None:
    """Add the console handler to the `hf_upipe` logger (once), unless the user configured that logger."""
    logger = logging.getLogger(LOGGER_NAME)
    if logger.handlers or logger.level != logging.NOTSET:
        return  # configured by the user (or already installed)
    logger.addHandler(_ConsoleHandler())
    logger.setLevel(logging.INFO)
