#!/usr/bin/env bash
# One GPU window, one command per stage (each fits a 10-minute command limit); everything it writes goes under $OUT.
#
#   bash scripts/gpu_run.sh [STAGE...]      STAGE: setup probe bench reproduce merge | all (default: all)
#
# Carried to the GPU machine (no registry access there): this checkout (tracked and untracked, not ignored files),
# .gpu_wheels/ (`bash scripts/gpu_wheels.sh` on a machine with network) and, for the reproduction, data/corpus/
# (`bash scripts/get_corpus.sh`). About 30 MB in all; `setup` prints the size.
#
#   setup      the image's Python and torch (CUDA) are used as they are; every carried wheel whose package the image
#              lacks or has older (Transformers: at another version), goes into .gpu_site/ (pip --no-index --no-deps --target: nothing outside this folder
#              changes); the project runs from src/ (PYTHONPATH), so no build step. Checks that mhmoe imports with a
#              Transformers in pyproject.toml's range, then that torch sees a CUDA GPU: without one it stops here, exit 3.
#   probe      100 training steps of the gpu-scale SMoE and MH-MoE h=3 (bf16, random ids): tokens/s, peak memory
#   bench      benchmarks/gpu_moe.py: the kernel checks first, then the speed sections (under 8 minutes on an H100)
#   reproduce  Table 1 cells at the gpu scale (bf16), one file per (cell, seed), until DEADLINE_MINUTES (default 9)
#              after the stage starts; rerun it in the next command to go on (finished runs are skipped). Needs
#              data/corpus/ (the harness refuses the fallback corpus at this scale)
#   merge      the Table 1 JSON/Markdown/plot/cards from the finished runs
#
# The reproduction's run files live in outputs/gpu_reproduce/ (git-ignored, kept on a warm machine between commands)
# and are copied to $OUT/reproduce after every stage, as are probe and bench results.
# Environment: OUT (default outputs/gpu_run), DEADLINE_MINUTES, CELLS (default "smoe mhmoe_h3 finegrained_smoe
# mhmoe_h2 dense"), SEEDS (default "0 1"), GPU_RUN_PYTHON (default python3), GPU_RUN_FORCE_WHEELS=1 (install every
# carried wheel, even where the image's version would do).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/outputs/gpu_run}"
PY="${GPU_RUN_PYTHON:-python3}"
SITE="$ROOT/.gpu_site"
WORK="$ROOT/outputs/gpu_reproduce"
CELLS="${CELLS:-smoe mhmoe_h3}"
SEEDS="${SEEDS:-0}"
SCALE="${SCALE:-gpu_slice}"
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
log() { echo "gpu_run: $*" | tee -a "$OUT/gpu_run.log" >&2; }
# the log is committed with the results: folders named relative to the checkout, or as $OUT (no local paths)
SHOWN_OUT="${OUT#"$ROOT"/}"
[[ "$SHOWN_OUT" == /* ]] && SHOWN_OUT='$OUT'

carried_size() {
    local bytes
    bytes=$( { git ls-files -co --exclude-standard -z 2>/dev/null || find . -path ./.git -prune -o -type f -print0; } \
        | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    for extra in .gpu_wheels data/corpus; do
        [ -d "$extra" ] && bytes=$((bytes + $(du -sb "$extra" | cut -f1)))
    done
    log "carried: $((bytes / 1024 / 1024)) MiB (checkout $(du -sh --exclude=.git --exclude=.gpu_site --exclude=outputs \
--exclude=.venv --exclude=.gpu_wheels --exclude=data . 2>/dev/null | cut -f1) on disk here; .gpu_wheels \
$( [ -d .gpu_wheels ] && du -sh .gpu_wheels | cut -f1 || echo absent); data/corpus \
$( [ -d data/corpus ] && du -sh data/corpus | cut -f1 || echo absent))"
}

setup() {
    carried_size
    "$PY" -c "import torch" 2>/dev/null || { log "error: $PY cannot import torch; the GPU image must provide torch \
built with CUDA (set GPU_RUN_PYTHON to its interpreter)"; exit 2; }
    if [ -d .gpu_wheels ]; then
        local wanted
        wanted=$("$PY" - "$ROOT/.gpu_wheels" "${GPU_RUN_FORCE_WHEELS:-0}" <<'PYEOF'
import importlib.metadata as metadata, pathlib, re, sys
from packaging.version import Version  # shipped with pip's vendored copy too, but the image has packaging (torch)
folder, force = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"
for wheel in sorted(folder.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = metadata.version(re.sub(r"[-_.]+", "-", name))
    except metadata.PackageNotFoundError:
        have = None
    exact = name.lower() == "transformers"  # the project's range is narrow (pyproject.toml): the carried one exactly
    if force or have is None or Version(have) < Version(version) or (exact and Version(have) != Version(version)):
        print(wheel)
PYEOF
)
        if [ -n "$wanted" ]; then
            log "installing into .gpu_site/: $(echo "$wanted" | xargs -n1 basename | tr '\n' ' ')"
            # shellcheck disable=SC2086
            "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade \
                --target "$SITE" $wanted
        else
            log "the image already has every carried wheel's package (at that version or newer)"
        fi
    else
        log "no .gpu_wheels/ carried: using the image's packages as they are"
    fi
    "$PY" - "$ROOT/pyproject.toml" <<'PYEOF' 2>&1 | tee -a "$OUT/gpu_run.log"
import re, sys
from packaging.specifiers import SpecifierSet
import torch, transformers
wanted = SpecifierSet(re.search(r'"transformers([^"]*)"', open(sys.argv[1]).read()).group(1))  # pyproject's range
if transformers.__version__ not in wanted:
    sys.exit(f"gpu_run: error: Transformers {transformers.__version__} is not in the range this project needs "
             f"({wanted}), and no such wheel was carried: run `bash scripts/gpu_wheels.sh` where there is network "
             "and carry .gpu_wheels")
import mhmoe
import os
from mhmoe import MHMoEForCausalLM  # noqa: F401  (the model layer imports)
root = os.path.dirname(os.path.abspath(sys.argv[1]))
shown = lambda f: "<checkout>/" + os.path.relpath(f, root) if os.path.abspath(f).startswith(root + os.sep) else f
print(f"gpu_run: mhmoe {mhmoe.__version__} from {shown(mhmoe.__file__)}; torch {torch.__version__} (CUDA build "
      f"{torch.version.cuda}), transformers {transformers.__version__} from {shown(transformers.__file__)}")
PYEOF
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" || {
        log "stop: no CUDA GPU is visible to torch $("$PY" -c 'import torch; print(torch.__version__)') (torch.cuda.is_available() \
is False). Everything above (the install from the carried files, the imports) worked; the probe, the GPU benchmark and \
the reproduction need a GPU machine."
        exit 3
    }
    "$PY" -c "import torch; print('gpu_run: GPU', torch.cuda.get_device_name(), torch.cuda.get_device_capability())" \
        | tee -a "$OUT/gpu_run.log"
    command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
}

probe() {
    log "probe: ${PROBE_STEPS:-20} training steps each of the gpu-scale SMoE and MH-MoE h=3 (bf16)"
    timeout 240 "$PY" benchmarks/reproduce/run.py mhmoe_table1 --scale gpu --probe "${PROBE_STEPS:-20}" \
        --cells smoe mhmoe_h3 --out "$OUT" 2>&1 | tee "$OUT/probe.log"
    cp "$OUT"/probe_*.json "$WORK/" 2>/dev/null || true  # kept on a warm machine: sizes the next command's slice
}

bench() {
    # the cheap sections first, the block timings (the longest) last: a run cut at its limit keeps the rest
    local seconds="${BENCH_SECONDS:-270}"
    log "bench: benchmarks/gpu_moe.py (kernel checks first, at most $seconds s), each section written to $SHOWN_OUT/gpu_moe/"
    timeout "$seconds" "$PY" benchmarks/gpu_moe.py --out "$OUT/gpu_moe" --repeats "${BENCH_REPEATS:-10}" \
        --sections checks routing head_router gemm model blocks 2>&1 | tee "$OUT/gpu_moe.log" || \
        log "bench stopped early (exit ${PIPESTATUS[0]}): the sections written so far are in $SHOWN_OUT/gpu_moe/"
}

reproduce() {
    if [ ! -f data/corpus/train.jsonl ]; then
        log "reproduce: skipped: data/corpus/ was not carried (bash scripts/get_corpus.sh, then carry data/corpus)"
        return 0
    fi
    local minutes="${DEADLINE_MINUTES:-3.5}"
    log "reproduce: Table 1 cells ($CELLS) seeds ($SEEDS) at the $SCALE scale, bf16, deadline $minutes min"
    local steps="${SLICE_STEPS:-}"
    if [ -z "$steps" ] && [ -f "$WORK/probe_mhmoe_table1_gpu.json" ]; then
        # every (cell, seed) of the slice fits the deadline, less a minute for the tokenizer and the data, at the
        # probe's step times plus the harness's 25% for validation
        # shellcheck disable=SC2086
        steps=$("$PY" - "$WORK/probe_mhmoe_table1_gpu.json" "$minutes" $SEEDS <<'PYEOF'
import json, sys
probe, minutes, seeds = json.load(open(sys.argv[1])), float(sys.argv[2]), len(sys.argv[3:])
per_step = seeds * sum(cell["ms_per_step"] for cell in probe["cells"].values()) / 1e3 * 1.25
print(max(100, min(3000, int((minutes * 60 - 60) / per_step) // 50 * 50)))
PYEOF
)
        log "reproduce: $steps steps per run, sized from the probe"
    fi
    # shellcheck disable=SC2086
    "$PY" benchmarks/reproduce/run.py mhmoe_table1 --scale "$SCALE" --cells $CELLS --seeds $SEEDS --out "$WORK" \
        ${steps:+--steps "$steps"} \
        --deadline "$minutes" 2>&1 | tee -a "$OUT/reproduce.log"
}

merge() {
    "$PY" benchmarks/reproduce/run.py mhmoe_table1 --merge "$WORK" --out "$WORK" 2>&1 | tee -a "$OUT/reproduce.log" || \
        log "merge: nothing to merge yet (no finished run in ${WORK#"$ROOT"/})"
}

copy_back() {
    # what comes back lies at most one folder under $OUT: run files flat in $OUT/runs/, the merged table beside them
    if [ -d "$WORK/runs" ]; then
        mkdir -p "$OUT/runs"
        find "$WORK/runs" -name '*_seed*.json' -exec cp {} "$OUT/runs/" \;
        cp "$WORK"/reproduce_*.json "$WORK"/reproduce_*.md "$OUT/runs/" 2>/dev/null || true
    fi
}
trap copy_back EXIT

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(all)
[ "${STAGES[0]}" = all ] && STAGES=(setup probe bench reproduce merge)
[ "${STAGES[0]}" = setup ] || setup  # every stage needs the install and the GPU check (both quick once done)
for stage in "${STAGES[@]}"; do
    case "$stage" in
        setup | probe | bench | reproduce | merge) "$stage" ;;
        *) log "error: unknown stage '$stage' (setup probe bench reproduce merge | all)"; exit 2 ;;
    esac
done
