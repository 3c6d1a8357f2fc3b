"""`python -m mhmoe.evaluation`: the same as `mhmoe-eval`."""

from .cli import main

main()
