#!/usr/bin/env bash
# Fetch, on a machine with registry access, the wheels scripts/gpu_run.sh installs on a GPU machine that has no
# registry: only what the GPU image lacks. The image has Python 3.12, torch 2.11 (CUDA), Triton 3.6.0, Transformers
# 5.17, huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, accelerate 1.15; this project needs Transformers
# >=5.23 (pyproject.toml), so the one wheel is Transformers at the dev/CI pin of requirements-dev.txt (5.24.0, 13.5 MB,
# pure Python; it runs with the image's huggingface_hub and tokenizers, as the 2026-11-26 window showed).
#
#   bash scripts/gpu_wheels.sh            # -> .gpu_wheels/*.whl (git-ignored: name it in both calls' carry list)
#
# GPU_WHEELS_PACKAGES="name ..." fetches others too (each without dependencies, at the dev/CI pin where there is one,
# else at the version installed in $PYTHON's environment). The folder is replaced whole, so no wheel from an earlier
# fetch rides along; it must stay within gpu_pack.CARRY_BUDGET_MIB[".gpu_wheels"] (14 MiB).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu_wheels"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
PACKAGES="${GPU_WHEELS_PACKAGES:-transformers}"
TMP="$(mktemp -d "$ROOT/.gpu_wheels.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
for name in $PACKAGES; do
    # the dev/CI pin (requirements-dev.txt) where there is one, else the version installed in $PYTHON's environment
    version="$("$PYTHON" -c "import importlib.metadata as m, re, sys
pins = dict(re.findall(r'^([A-Za-z0-9_.-]+)==([^\s#;]+)', open(sys.argv[2]).read(), re.M))
norm = lambda n: re.sub(r'[-_.]+', '-', n).lower()
pins = {norm(k): v for k, v in pins.items()}
try: print(pins.get(norm(sys.argv[1])) or m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name" "$ROOT/requirements-dev.txt")"
    if [ -z "$version" ]; then
        echo "gpu_wheels: error: $name has no pin in requirements-dev.txt and is not installed for $PYTHON" >&2
        exit 1
    fi
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --dest "$TMP" "$name==$version"
done
bytes=$(du -sb "$TMP" | cut -f1)
if [ "$bytes" -gt $((14 * 1024 * 1024)) ]; then
    echo "gpu_wheels: error: $((bytes / 1024 / 1024)) MiB of wheels, over the 14 MiB budget (scripts/gpu_pack.py)" >&2
    exit 1
fi
rm -rf "$DEST"
mv "$TMP" "$DEST"
trap - EXIT
ls -l "$DEST"
