"""Environment variables the Engine reads, as names (imports nothing: cheap for the launcher)."""

from __future__ import annotations

__all__ = ["CONFIG_ENV"]

#: Environment variable `ds-engine launch --config` uses to hand a config to `Engine()`.
CONFIG_ENV = "DS_ENGINE_CONFIG"
