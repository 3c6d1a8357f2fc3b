#!/usr/bin/env bash
# Quick start: set up .venv (first run only) and run the end-to-end demo. Extra arguments go to the demo,
# e.g. `bash scripts/demo.sh --steps 100 --output_dir outputs/my-demo`.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m mhmoe.demo "$@"
