"""A committed reproduction table against an earlier commit's: final validation perplexity, mean (min–max) over
seeds, per cell (the README's "Before and after the preset" tables).

    python benchmarks/reproduce/compare.py REV TABLE SCALE [--new DIR]

REV: the git revision holding the earlier `benchmarks/results/reproduce_<TABLE>_<SCALE>.json`; the newer file is read
from DIR (default benchmarks/results). Each column is headed by the commit its runs recorded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def comparison(old: dict, new: dict) -> str:
    lines = [
        f"| model | library conventions ({old['commit']}) | official preset ({new['commit']}) |",
        "| --- | --- | --- |",
    ]
    for name, cell in new["cells"].items():
        before = old["cells"].get(name, {}).get("summary", {}).get("final")
        lines.append(f"| {name} | {harness._fmt(before)} | {harness._fmt(cell['summary'].get('final'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("table")
    parser.add_argument("scale")
    parser.add_argument("--new", type=Path, default=harness.REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    name = f"reproduce_{args.table}_{args.scale}.json"
    shown = subprocess.run(
        ["git", "show", f"{args.rev}:benchmarks/results/{name}"], cwd=harness.REPO, capture_output=True, text=True
    )
    if shown.returncode != 0:
        parser.error(f"no benchmarks/results/{name} at {args.rev}: {shown.stderr.strip()}")
    print(comparison(json.loads(shown.stdout), json.loads((args.new / name).read_text())))


if __name__ == "__main__":
    main()
