"""The command line's one error type and its wording in flag terms (shared by its modules)."""

from __future__ import annotations

import re


class CLIError(Exception):
    """A user error the CLI reports in one line with exit status 2."""


def _in_flag_terms(message: str, flags: dict[str, str]) -> str:
    """`message` with the Python keyword names in `flags` written as the CLI flags that set them.

    Library errors name keywords (`zero_stage`, `HINT: pass nvme_path=...`); on the command line
    the user typed `--zero-stage` / `--nvme-path`. Backticked names and `name=` become the flag,
    and so do bare names with an underscore (plain words such as "optimizer" stay as they are).
    """
    for name, flag in sorted(flags.items(), key=lambda item: -len(item[0])):
        message = re.sub(rf"`{re.escape(name)}`", f"`{flag}`", message)
        message = re.sub(rf"(?<![\w.`-]){re.escape(name)}=", f"{flag} ", message)
        if "_" in name:
            message = re.sub(rf"(?<![\w.`-]){re.escape(name)}(?![\w`])", flag, message)
    return message
