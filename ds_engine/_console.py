"""What a run prints: rank 0 speaks, the other ranks only when asked.

DeepSpeed, torch and transformers each print their start-up chatter once per process, and
torch warns at every call of a collective DeepSpeed still uses under its deprecated name
(`reduce_scatter_tensor`, `all_gather_into_tensor`): on 2 ranks that was 600 of the 720 lines
a short fine-tune printed, and it broke the progress bar onto a new line at every step.
`quiet_console()` (called once per Engine, before DeepSpeed is imported) keeps the console
to what a user wants to watch:

* torch's deprecation warnings about DeepSpeed's collective names, and transformers' about
  the attribute name peft reads, are dropped everywhere (nothing the user can change; the
  libraries' own code makes those calls);
* on every rank but 0, ds_engine's own warnings (rank 0 gives the same), DeepSpeed's log
  below ERROR, transformers' log below ERROR and its progress bars are silenced, and the line
  DeepSpeed prints when it loads its shared-memory communication op is kept off stdout.

`DS_ENGINE_LOG_ALL_RANKS=1` keeps every rank's output as the libraries print it. Errors are
never silenced on any rank.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator

__all__ = ["ALL_RANKS_ENV", "all_ranks_speak", "quiet_console", "quiet_deepspeed_log", "quiet_unless_main"]

ALL_RANKS_ENV = "DS_ENGINE_LOG_ALL_RANKS"
_DEPRECATED_COLLECTIVE = r"`?torch\.distributed\.\w+`? is deprecated"
_DONE = False


def _env_rank() -> int:
    """This process's global rank as the launcher set it (0 when unset or unreadable)."""
    value = os.environ.get("RANK", "0").strip()
    return int(value) if value.isdigit() else 0


def all_ranks_speak() -> bool:
    """True when the user asked to see every rank's output (`DS_ENGINE_LOG_ALL_RANKS=1`)."""
    return os.environ.get(ALL_RANKS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def quiet_console() -> None:
    """Apply the policy above to this process (idempotent)."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVE, category=FutureWarning)
    # peft reads this transformers attribute by its old name when it wraps a model
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )
    if _env_rank() == 0 or all_ranks_speak():
        return
    # A filter on the logger object outlives DeepSpeed's own set-up of it at import (which
    # sets its level and handler but keeps filters), so it also covers the accelerator
    # detection message DeepSpeed logs while it is being imported.
    logging.getLogger("DeepSpeed").addFilter(_BelowError())
    # ds_engine's own warnings say the same on every rank: rank 0 says it (one that names a
    # rank is about that rank, and stays)
    warnings.filterwarnings("ignore", message=r"(?s)ds_engine: (?!.*\brank \d)", category=UserWarning)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def quiet_deepspeed_log() -> None:
    """Keep DeepSpeed's log below ERROR off the console (a command-line tool that trains nothing:
    its accelerator detection and op-build chatter say nothing about what was asked)."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _BelowError) for f in logger.filters):
        logger.addFilter(_BelowError())


@contextlib.contextmanager
def quiet_unless_main() -> Iterator[None]:
    """Keep stdout of the block off the console on ranks other than 0 (unless all ranks speak)."""
    if _env_rank() == 0 or all_ranks_speak():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
