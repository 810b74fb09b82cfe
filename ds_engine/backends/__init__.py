"""Training backends behind one interface (`base.Backend`), and the one place that picks one.

`select_backend` is the registry: a name maps to the module and class that implement it,
imported only when chosen, so the Engine imports the interface and nothing backend-specific.
A third backend is one entry here and one module beside the others.
"""

from __future__ import annotations

import importlib
import warnings

from ds_engine._imports import INSTALL_HINT, deepspeed_unavailable_reason, require_deepspeed
from ds_engine.backends.base import Backend
from ds_engine.config import ConfigError

#: name -> (module, class); "auto" picks DeepSpeed when usable, else the accelerate fallback.
_REGISTRY = {
    "deepspeed": ("ds_engine.backends.deepspeed", "DeepSpeedBackend"),
    "accelerate": ("ds_engine.backends.accelerate", "AccelerateBackend"),
}
BACKEND_NAMES = ("auto", *_REGISTRY)


def select_backend(name: str) -> type[Backend]:
    """The backend class for `name` ("auto", "deepspeed" or "accelerate").

    Raises:
        ConfigError: an unknown name.
        ImportError: "deepspeed" where DeepSpeed is not usable (the message says how to install it).
    """
    if name not in BACKEND_NAMES:
        raise ConfigError(
            f"`backend={name!r}` is not a backend; allowed: {', '.join(BACKEND_NAMES)}. "
            "HINT: use backend='auto'."
        )
    if name == "deepspeed":
        require_deepspeed()
    if name == "auto":
        reason = deepspeed_unavailable_reason()
        if reason:
            warnings.warn(
                f"ds_engine: {reason}; using the plain-accelerate fallback (DDP). HINT: {INSTALL_HINT}",
                stacklevel=3,  # the user's Engine(...) call
            )
            name = "accelerate"
        else:
            name = "deepspeed"
    return backend_class(name)


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name` ("deepspeed" or "accelerate"), imported now.

    Raises:
        KeyError: `name` is not a registered backend.
    """
    module, cls = _REGISTRY[name]
    backend: type[Backend] = getattr(importlib.import_module(module), cls)
    return backend


__all__ = ["BACKEND_NAMES", "Backend", "backend_class", "select_backend"]
