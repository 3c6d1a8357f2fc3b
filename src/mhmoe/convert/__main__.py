"""`python -m mhmoe.convert`: the same as `mhmoe-convert`."""

from .cli import main

main()
