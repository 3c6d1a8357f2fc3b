"""The version of mhmoe, written once (pyproject.toml reads it from here; `mhmoe.__version__` re-exports it)."""

__version__ = "0.1.0"
