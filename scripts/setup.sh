# Shared setup for scripts/demo.sh and scripts/test.sh; source it, don't run it.
# Creates .venv (if missing) at the repository root, installs requirements-dev.txt into it (skipped when a stamp file
# matches the hash of requirements-dev.txt + pyproject.toml + setup.py), activates it, and sets the offline environment.
# Override the interpreter with PYTHON=python3.12, the venv location with VENV=/path/to/venv.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.mhmoe-install-stamp"
HASH="$(cat requirements-dev.txt pyproject.toml setup.py | "$VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$HASH" ]; then
    echo "setup: installing requirements-dev.txt into $VENV (first run: under a minute)" >&2
    # torch through pip: pip's configuration may name a local CPU build (uv reads no pip configuration and would fetch
    # a multi-GB CUDA build). The rest through uv, which installs in parallel: seconds where pip takes minutes.
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile uv==0.13.9 \
        "$(grep '^torch==' requirements-dev.txt)"
    "$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" -r requirements-dev.txt
    echo "$HASH" > "$STAMP"
else
    echo "setup: $VENV is up to date (requirements unchanged)" >&2
fi

# shellcheck disable=SC1091
source "$VENV/bin/activate"
# Nothing is downloaded from the Hugging Face Hub: fail fast instead of waiting on lookups.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# Bytecode is compiled when a module is first imported and cached, as Python does by default (nothing is compiled at
# install: most of the ~21k files are never imported). A machine that sets PYTHONDONTWRITEBYTECODE would recompile
# every module in every process: ~10 s more per fresh interpreter.
unset PYTHONDONTWRITEBYTECODE
