#!/usr/bin/env bash
# Fetch, on a machine with registry access, the wheels scripts/gpu_run.sh installs on a GPU machine that has none:
# the pinned Transformers and the pure-Python / abi3 packages it and the training need, at the dev/CI pins of
# requirements-dev.txt where it pins them, else at the dev environment's versions, each without its dependencies
# (they are listed here one by one).
# Compiled per-Python packages (numpy, regex, pyyaml, pydantic) are not fetched: the GPU image's own are used.
#
#   bash scripts/gpu_wheels.sh            # -> .gpu_wheels/*.whl (git-ignored: name it in the run's carry list)
#
# Override the interpreter whose versions are copied with PYTHON=/path/to/python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu_wheels"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
PACKAGES="transformers huggingface_hub tokenizers safetensors hf_xet accelerate httpx2 httpcore2 h11 truststore anyio
idna typing_extensions filelock fsspec packaging tqdm click typer shellingham rich markdown_it_py mdurl pygments
annotated_doc psutil"
mkdir -p "$DEST"
for name in $PACKAGES; do
    # the dev/CI pin (requirements-dev.txt) where there is one, else the version installed in $PYTHON's environment
    version="$("$PYTHON" -c "import importlib.metadata as m, re, sys
pins = dict(re.findall(r'^([A-Za-z0-9_.-]+)==([^\s#;]+)', open(sys.argv[2]).read(), re.M))
norm = lambda n: re.sub(r'[-_.]+', '-', n).lower()
pins = {norm(k): v for k, v in pins.items()}
try: print(pins.get(norm(sys.argv[1])) or m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name" "$ROOT/requirements-dev.txt")"
    if [ -z "$version" ]; then
        echo "gpu_wheels: $name is not installed in $PYTHON's environment; skipped" >&2
        continue
    fi
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --dest "$DEST" "$name==$version"
done
du -sh "$DEST"
