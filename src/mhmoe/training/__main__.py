"""`python -m mhmoe.training`: the same as `mhmoe-train` (also under `accelerate launch -m mhmoe.training`)."""

from .cli import main

main()
