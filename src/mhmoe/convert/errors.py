"""The converter's one exception type."""

from .._plumbing.checkpoint_files import CheckpointError


class ConversionError(CheckpointError):
    """A checkpoint or an argument the converter refuses, with the reason in words."""
