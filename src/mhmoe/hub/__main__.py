"""`python -m mhmoe.hub`: the same as `mhmoe-export`."""

from .cli import main

main()
