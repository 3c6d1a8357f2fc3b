#!/usr/bin/env bash
# Fetch the reproduction corpus: real English text from Debian's documentation packages, without root installs.
#   bash scripts/get_corpus.sh [OUT_DIR]      (default: data/corpus)
# Downloads python3.11-doc (~1.4M words in html/_sources/*.rst.txt) and linux-doc-6.1 (~3.1M words in
# html/_sources/**/*.rst.txt) with `apt-get download` (apt checks each file against the signed package index), unpacks
# them with `dpkg -x` into a temporary folder, checks sizes and, for the versions recorded below, SHA-256 hashes, and
# writes train / validation / test JSONL splits by document (benchmarks/reproduce/make_splits.py) plus manifest.json.
# The output is written to a temporary folder next to OUT_DIR and renamed at the end.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/data/corpus}"
PYTHON="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}"
# package -> "version sha256 min_bytes" of the .deb this corpus was built from (another version is used with a warning)
declare -A KNOWN=(
  [python3.11-doc]="3.11.2-6+deb12u8 50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b 10000000"
  [linux-doc-6.1]="6.1.176-1 0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f 30000000"
)

for tool in apt-get dpkg sha256sum; do
  command -v "$tool" >/dev/null || { echo "get_corpus: needs $tool (a Debian or Ubuntu system)" >&2; exit 2; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download python3.11-doc linux-doc-6.1 >download.log 2>&1; then
  echo "get_corpus: apt-get download failed (run 'apt-get update' first?):" >&2
  tail -5 download.log >&2
  exit 1
fi
for pkg in python3.11-doc linux-doc-6.1; do
  deb=$(ls "${pkg}"_*.deb)
  read -r version sha min_bytes <<<"${KNOWN[$pkg]}"
  size=$(stat -c %s "$deb")
  [ "$size" -ge "$min_bytes" ] || { echo "get_corpus: $deb is only $size bytes (expected >= $min_bytes)" >&2; exit 1; }
  got=$(sha256sum "$deb" | cut -d' ' -f1)
  actual_version=$(dpkg-deb -f "$deb" Version)
  if [ "$actual_version" = "$version" ]; then
    [ "$got" = "$sha" ] || { echo "get_corpus: $deb has SHA-256 $got, expected $sha" >&2; exit 1; }
  else
    echo "get_corpus: warning: $pkg $actual_version instead of $version (a newer Debian point release); its text may differ slightly" >&2
  fi
  echo "$pkg $actual_version $got $size" >>debs.txt
  mkdir -p "unpacked/$pkg"
  dpkg -x "$deb" "unpacked/$pkg"
done
"$PYTHON" "$ROOT/benchmarks/reproduce/make_splits.py" \
  --source "python3.11-doc=unpacked/python3.11-doc/usr/share/doc/python3.11/html/_sources" \
  --source "linux-doc-6.1=unpacked/linux-doc-6.1/usr/share/doc/linux-doc-6.1/html/_sources" \
  --debs debs.txt --out "$OUT"
