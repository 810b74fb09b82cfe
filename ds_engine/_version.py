"""The package version (one place; `ds_engine.__version__` re-exports it)."""

__version__ = "0.1.0"
