#!/usr/bin/env python
"""CPU proof of continue-tuning: train a tiny dense LLaMA on the stdlib's pydoc topics, convert it to MoH (75% heads
active), continue-tune it, and check that held-out perplexity recovers to <= 1.05x the dense parent's.

    python conversion/demo_recovery.py [--dense_steps 600 --tune_steps 150 ...]

Exits 1 when the MoH model does not recover. The logic is `mhmoe.recovery_demo`.
"""

import sys

from mhmoe.recovery_demo import main

if __name__ == "__main__":
    main(sys.argv[1:])
