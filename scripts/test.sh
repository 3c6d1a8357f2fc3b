#!/usr/bin/env bash
# Set up .venv (first run only) and run the test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k demo`.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export TRITON_INTERPRET=1  # Triton kernels run on CPU through the interpreter; must be set before they are imported
exec python -m pytest -q -n auto tests "$@"  # pytest-xdist: one worker per core
