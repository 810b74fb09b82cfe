"""Optional-dependency detection: is DeepSpeed usable here, and which version.

Nothing in this module imports DeepSpeed itself (that costs seconds and prints warnings);
`importlib.metadata` answers the question from the installed distribution.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

from packaging.version import Version

#: The oldest DeepSpeed release ds_engine supports (first with `coalesce_grad_reduction`).
DEEPSPEED_MIN_VERSION = Version("0.19.2")

INSTALL_HINT = 'pip install "ds-engine[deepspeed]"  (or: pip install "deepspeed>=0.19.2,<0.20")'


@functools.cache
def deepspeed_version() -> Version | None:
    """The installed DeepSpeed version, or None when DeepSpeed is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        return Version(importlib.metadata.version("deepspeed"))
    except importlib.metadata.PackageNotFoundError:
        return None


def is_deepspeed_available() -> bool:
    """True when DeepSpeed is installed and at least `DEEPSPEED_MIN_VERSION`."""
    version = deepspeed_version()
    return version is not None and version >= DEEPSPEED_MIN_VERSION


def deepspeed_unavailable_reason() -> str:
    """Why DeepSpeed cannot be used ('' when it can)."""
    version = deepspeed_version()
    if version is None:
        return "DeepSpeed is not installed"
    if version < DEEPSPEED_MIN_VERSION:
        return f"DeepSpeed {version} is older than the supported floor {DEEPSPEED_MIN_VERSION}"
    return ""


def require_deepspeed() -> None:
    """Raise an ImportError that says how to install DeepSpeed when it is not usable."""
    reason = deepspeed_unavailable_reason()
    if reason:
        raise ImportError(f"{reason}; backend='deepspeed' needs it. HINT: {INSTALL_HINT}")
