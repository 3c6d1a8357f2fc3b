#!/usr/bin/env bash
# One GPU window (15 minutes in all, the machine's start and every wait counted) in two commands. Everything a command
# returns lies directly in $OUT: call 1 writes 4 files, call 2 writes 2 (the device tool returns at most 8).
#
# Before the window, in the checkout the GPU calls are made from (that checkout is what travels):
#   bash scripts/gpu_wheels.sh      # .gpu_wheels/: the one wheel the image lacks (Transformers 5.24.0, 13.5 MB)
#   bash scripts/get_corpus.sh      # data/corpus/ (once)
#   bash scripts/gpu_run.sh pack    # .gpu_pack/: provenance (commit + blob hashes), the corpus splits the gpu scales
#                                   # read (xz, ~7.5 MB), seed/; prints the payload, fails above 48 MiB
# The window (benchmarks/README.md, "One GPU window", gives the tool calls exactly):
#   call 1  timeout 360 s, carry .gpu_wheels .gpu_pack:  bash scripts/gpu_run.sh setup probe bench
#   call 2  timeout 240 s, carry .gpu_wheels .gpu_pack:  bash scripts/gpu_run.sh reproduce
#
# Stages
#   pack       (here, before the window) scripts/gpu_pack.py pack, then the payload check
#   setup      the image's Python and torch as they are; each carried wheel whose package the image lacks or has older
#              (Transformers: at any other version) goes into .gpu_site/ (pip --no-index --no-deps --target: nothing
#              else changes); data/corpus/ from the pack (SHA-256 checked); the pack's provenance checked against the
#              files (MHMOE_PROVENANCE: every result records the packed commit, and whether the tree matched it);
#              mhmoe imports with a Transformers in pyproject.toml's range; torch sees a CUDA GPU, else exit 3.
#              Every other stage runs it first (a second time on a warm machine it installs nothing).
#   probe      PROBE_STEPS (20) training steps each of the gpu-scale SMoE and MH-MoE h=3 (bf16, random ids), cut at
#              PROBE_SECONDS (60): $OUT/probe_mhmoe_table1_gpu.json, which call 2 estimates its runs from. Call 1 is
#              at most ~15 s of setup + 60 + HS_SECONDS (45) + BENCH_SECONDS (205) = 325 s, under its 360 s timeout.
#   bench      benchmarks/gpu_head_sparse.py cut at HS_SECONDS (45): $OUT/gpu_head_sparse.json (MoH's head-sparse
#              attention kernels vs SDPA over all heads; not in the dry run); then benchmarks/gpu_moe.py, cut at
#              BENCH_SECONDS (205): $OUT/gpu_moe.json, rewritten after every section
#   reproduce  Table 1 at SCALE (gpu_slice: the gpu scale's models, 1550 steps), seed by seed (SEEDS "0 1 2"), the cells
#              in the priority CELLS gives ("smoe mhmoe_h3 finegrained_smoe mhmoe_h2 dense"); the runs already in the
#              committed benchmarks/results/reproduce_mhmoe_table1_<scale>.json or in .gpu_pack/seed/ are skipped; no
#              run starts whose estimate does not fit DEADLINE_MINUTES (3.6) after this command began:
#              $OUT/runs_mhmoe_table1_<scale>.json, rewritten after every run with all finished ones (seeded included)
# Every command writes $OUT/gpu_run.log too: all output, nvidia-smi, the provenance check.
# After the window, here (benchmarks/README.md gives the commands): merge the returned bundle into benchmarks/results
#   (run.py mhmoe_table1 --merge RETURNED/runs_mhmoe_table1_gpu_slice.json --out benchmarks/results), copy gpu_moe.json,
#   probe_*.json and gpu_run.log into benchmarks/results/gpu_moe-<device>-<commit>/, then gpu_moe.py --write_table.
#
# Environment: OUT (default outputs/gpu_run), GPU_RUN_PYTHON (python3), GPU_RUN_FORCE_WHEELS=1 (install every carried
# wheel), GPU_RUN_STARTED (epoch seconds the deadline counts from; default this command's start), CELLS, SEEDS, SCALE,
# DEADLINE_MINUTES, PROBE_STEPS, PROBE_SECONDS, HS_SECONDS, BENCH_SECONDS, BENCH_SECTIONS, BENCH_REPEATS.
# GPU_RUN_DRY=1: a dry run on a machine without a GPU (tests/benchmarks/test_gpu_run.py): setup does not stop, probe
# and reproduce run the quick scale, bench its --smoke shapes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
GPU_RUN_STARTED="${GPU_RUN_STARTED:-$(date +%s.%N)}"
OUT="${OUT:-$ROOT/outputs/gpu_run}"
PY="${GPU_RUN_PYTHON:-python3}"
SITE="$ROOT/.gpu_site"
PACK="$ROOT/.gpu_pack"
WORK="$ROOT/outputs/gpu_reproduce"  # git-ignored; kept on a warm machine between commands (cache, run files)
TABLE=mhmoe_table1
DRY="${GPU_RUN_DRY:-0}"
CELLS="${CELLS:-smoe mhmoe_h3 finegrained_smoe mhmoe_h2 dense}"
SEEDS="${SEEDS:-0 1 2}"
SCALE="${SCALE:-gpu_slice}"
export PYTHONPATH="$SITE:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[ -f "$PACK/provenance.json" ] && export MHMOE_PROVENANCE="$PACK/provenance.json"

STAGES=("$@")
if [ ${#STAGES[@]} -eq 0 ]; then
    echo "usage: bash scripts/gpu_run.sh pack | STAGE... (setup probe bench reproduce)" >&2
    exit 2
fi
for stage in "${STAGES[@]}"; do
    case "$stage" in
        pack | setup | probe | bench | reproduce) ;;
        *) echo "gpu_run: error: unknown stage '$stage' (pack | setup probe bench reproduce)" >&2; exit 2 ;;
    esac
done

if [ "${STAGES[*]}" = pack ]; then  # here, before the window: nothing goes to $OUT
    exec "$PY" scripts/gpu_pack.py pack
fi

mkdir -p "$OUT" "$WORK"
log() { echo "gpu_run: $*"; }

setup() {
    if [ -f "$PACK/provenance.json" ]; then
        "$PY" - <<'PYEOF'
import json, sys
sys.path.insert(0, "benchmarks")
import _provenance
state = _provenance.git_state()
print("gpu_run: provenance", json.dumps({k: state[k] for k in ("commit", "dirty", "tree_verified", "changed_files")}))
if not state["tree_verified"]:
    print("gpu_run: warning: the tree here differs from the packed one (listed above): results are marked dirty; run "
          "`bash scripts/gpu_run.sh pack` again right before the calls")
PYEOF
    else
        log "warning: no .gpu_pack/provenance.json carried (bash scripts/gpu_run.sh pack): results record what git says \
here, which on a device machine may be another checkout's commit"
    fi
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
            log "the image (or .gpu_site/) already has every carried wheel's package"
        fi
    else
        log "no .gpu_wheels/ carried: using the image's packages as they are"
    fi
    if [ -d "$PACK/corpus" ]; then
        "$PY" scripts/gpu_pack.py unpack --pack "$PACK" --corpus data/corpus
    fi
    # one interpreter for the checks that import torch (each import costs seconds): torch at all (status 2), the
    # Transformers range (1), mhmoe's model layer, then a CUDA GPU (3: none)
    local status=0
    "$PY" - "$ROOT/pyproject.toml" "$PY" <<'PYEOF' || status=$?
import re, sys
try:
    import torch
except ImportError as error:
    print(f"gpu_run: error: {sys.argv[2]} cannot import torch ({error}); the GPU image must provide torch built with "
          "CUDA (set GPU_RUN_PYTHON to its interpreter)")
    sys.exit(2)
from packaging.specifiers import SpecifierSet
import transformers
wanted = SpecifierSet(re.search(r'"transformers([^"]*)"', open(sys.argv[1]).read()).group(1))  # pyproject's range
if transformers.__version__ not in wanted:
    sys.exit(f"gpu_run: error: Transformers {transformers.__version__} is not in the range this project needs "
             f"({wanted}), and no such wheel was carried: run `bash scripts/gpu_wheels.sh` where there is network "
             "and carry .gpu_wheels")
import mhmoe
from mhmoe import MHMoEForCausalLM  # noqa: F401  (the model layer imports)
print(f"gpu_run: mhmoe {mhmoe.__version__}; torch {torch.__version__} (CUDA build {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
if not torch.cuda.is_available():
    sys.exit(3)
print("gpu_run: GPU", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
PYEOF
    if [ "$status" = 3 ]; then
        if [ "$DRY" = 1 ]; then
            log "dry run (GPU_RUN_DRY=1): no CUDA GPU; probe and reproduce run the quick scale, bench its smoke shapes"
            return 0
        fi
        log "stop: no CUDA GPU is visible to torch (torch.cuda.is_available() is False). Everything above (the install \
from the carried files, the imports) worked; the probe, the GPU benchmark and the reproduction need a GPU machine."
        exit 3
    elif [ "$status" != 0 ]; then
        exit "$status"
    fi
    command -v nvidia-smi >/dev/null && nvidia-smi || true
}

probe() {
    local scale=(--scale gpu)
    [ "$DRY" = 1 ] && scale=(--quick)
    log "probe: ${PROBE_STEPS:-20} training steps each of SMoE and MH-MoE h=3 (${scale[*]}, bf16 on a GPU)"
    timeout "${PROBE_SECONDS:-60}" "$PY" benchmarks/reproduce/run.py "$TABLE" "${scale[@]}" --probe "${PROBE_STEPS:-20}" \
        --cells smoe mhmoe_h3 --out "$OUT" || log "probe stopped (exit $?)"
    cp "$OUT"/probe_*.json "$WORK/" 2>/dev/null || true  # kept on a warm machine for call 2's estimates
}

bench() {
    # MoH's head-sparse attention kernels first (never run on a GPU yet; bounded), then gpu_moe.py: the cheap sections
    # first, the block timings (the longest) last: a run cut at its limit keeps the rest
    if [ "$DRY" != 1 ]; then
        log "bench: benchmarks/gpu_head_sparse.py (at most ${HS_SECONDS:-45} s) -> $OUT/gpu_head_sparse.json"
        timeout "${HS_SECONDS:-45}" "$PY" benchmarks/gpu_head_sparse.py --out "$OUT" --repeats 10 \
            || log "gpu_head_sparse stopped (exit $?)"
    fi
    local seconds="${BENCH_SECONDS:-205}"
    local sections="${BENCH_SECTIONS:-checks routing head_router gemm model parts blocks compiled}"
    local smoke=()
    [ "$DRY" = 1 ] && smoke=(--smoke) && sections="${BENCH_SECTIONS:-routing}"
    log "bench: benchmarks/gpu_moe.py ($sections; at most $seconds s) -> $OUT/gpu_moe.json after every section"
    # shellcheck disable=SC2086
    timeout "$seconds" "$PY" benchmarks/gpu_moe.py --out "$OUT" --repeats "${BENCH_REPEATS:-10}" \
        --sections $sections "${smoke[@]}" || log "bench stopped (exit $?): the sections written so far are in $OUT"
}

reproduce() {
    local scale=(--scale "$SCALE") name="$SCALE"
    if [ "$DRY" = 1 ]; then
        scale=(--quick) && name=quick
    elif [ ! -f data/corpus/train.jsonl ]; then
        log "reproduce: skipped: no corpus (bash scripts/get_corpus.sh, bash scripts/gpu_run.sh pack, carry .gpu_pack)"
        return 0
    fi
    local minutes="${DEADLINE_MINUTES:-3.6}" extra=() seeds=() probes=()
    for file in "benchmarks/results/reproduce_${TABLE}_${name}.json" "$PACK"/seed/runs_*.json; do
        [ -f "$file" ] && seeds+=("$file")
    done
    for file in "$WORK"/probe_*.json "$PACK"/seed/probe_*.json benchmarks/results/gpu_moe-*/probe_*.json; do
        [ -f "$file" ] && probes+=("$file")
    done
    [ ${#seeds[@]} -gt 0 ] && extra+=(--seed_from "${seeds[@]}")
    [ ${#probes[@]} -gt 0 ] && extra+=(--probe_file "${probes[@]}")
    log "reproduce: $TABLE at ${scale[*]}, cells in this order: $CELLS; seeds $SEEDS; deadline $minutes min after the \
command began; finished runs also from: ${seeds[*]:-none}"
    # shellcheck disable=SC2086
    "$PY" benchmarks/reproduce/run.py "$TABLE" "${scale[@]}" --cells $CELLS --seeds $SEEDS --out "$WORK" \
        --bundle "$OUT/runs_${TABLE}_${name}.json" "${extra[@]}" --deadline "$minutes" --started "$GPU_RUN_STARTED" \
        --no_merge
}

check_out() {
    # what the device tool returns: at most 8 files, none deeper than one folder under $OUT (this plan: directly in it)
    local files deep
    files=$(find "$OUT" -type f | wc -l)
    deep=$(find "$OUT" -mindepth 3 -type f | wc -l)
    log "returned: $files file(s) in $OUT: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
    { [ "$files" -le 8 ] && [ "$deep" -eq 0 ]; } || log "warning: more than 8 files or some deeper than one folder: \
the device tool would not return them all"
}
run_stages() {
    [ "${STAGES[0]}" = setup ] || setup  # every stage needs the install, the corpus and the GPU check
    for stage in "${STAGES[@]}"; do
        "$stage"
    done
}

# The log is committed with the results: no path of the machine in it ($OUT, <checkout>, <site-packages> instead)
no_local_paths() {
    sed -u -e "s#$OUT#\$OUT#g" -e "s#$ROOT#<checkout>#g" -e 's#[^ ]*/site-packages/#<site-packages>/#g'
}

set +e
(set -e; run_stages) 2>&1 | no_local_paths | tee -a "$OUT/gpu_run.log"  # one log of everything, returned with the results
status=${PIPESTATUS[0]}
check_out 2>&1 | no_local_paths | tee -a "$OUT/gpu_run.log"
exit "$status"
