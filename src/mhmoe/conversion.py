"""Deprecated: the converter is the package `mhmoe.convert` (one module per stage; `mhmoe-convert` is
`mhmoe.convert.cli:main`). This module re-exports its public names for one release."""

import sys
import warnings

from .convert import *  # noqa: F401,F403  (every public name of mhmoe.convert)
from .convert import __all__  # noqa: F401

warnings.warn(
    "mhmoe.conversion is deprecated and will be removed in the next release: import from mhmoe.convert",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    main(sys.argv[1:])
