"""Reproduction tables read back: a committed table against an earlier commit's, and the sentences the READMEs say
about a table's ordering and seed spread, derived from its JSON so that the prose cannot drift from the numbers.

    python benchmarks/reproduce/compare.py REV TABLE SCALE [--new DIR] [--labels OLD NEW]
    python benchmarks/reproduce/compare.py --claims TABLE SCALE [final|mid]
    python benchmarks/reproduce/compare.py --check FILE.md ... | --write FILE.md ...

REV: the git revision holding the earlier `benchmarks/results/reproduce_<TABLE>_<SCALE>.json`; the newer file is read
from DIR (default benchmarks/results). Each column is headed by the commit its runs recorded.

`--claims` prints, for one table and validation point, the perplexities (mean of the seeds, min–max), the order of the
means, which seed ranges are apart (the worse seed of one below the better seed of the other) and, where the paper
states an ordering (`PAPER_ORDER`), whether the means follow it and whether the seed ranges separate each step of it.
In a Markdown file such a text sits between `<!-- claims TABLE SCALE [POINT] -->` and `<!-- /claims -->`; `--check`
fails when one differs from what the JSON gives now, `--write` rewrites them (tests/benchmarks/test_reproduce.py runs
the check on README.md and benchmarks/reproduce/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def comparison(old: dict, new: dict, labels: tuple[str, str] = ("library conventions", "official preset")) -> str:
    lines = [f"| model | {labels[0]} ({old['commit']}) | {labels[1]} ({new['commit']}) |", "| --- | --- | --- |"]
    for name, cell in new["cells"].items():
        before = old["cells"].get(name, {}).get("summary", {}).get("final")
        lines.append(f"| {name} | {harness._fmt(before)} | {harness._fmt(cell['summary'].get('final'))} |")
    return "\n".join(lines)


# The orderings the papers report (best first; cells in one group are not ordered among themselves)
PAPER_ORDER = {
    "mhmoe_table1": (
        "MH-MoE < fine-grained SMoE < SMoE < dense",
        [["MH-MoE h=2", "MH-MoE h=3"], ["Fine-grained SMoE"], ["SMoE"], ["Dense"]],
    ),
    "bitnet_table3": (
        "MH-MoE < fine-grained SMoE < SMoE < dense",
        [["MH-MoE h=2", "MH-MoE h=3"], ["Fine-grained SMoE"], ["SMoE"], ["Dense"]],
    ),
    "mhmoe_table2": (
        "MH-MoE < fine-grained SMoE < SMoE",
        [["MH-MoE h=2", "MH-MoE h=3"], ["Fine-grained SMoE"], ["SMoE"]],
    ),
    "mhmoe_ablation": (
        "both layers < without the merge layer < without the head layer < without both",
        [["MH-MoE h=2"], ["w/o merge layer"], ["w/o head layer"], ["w/o both"]],
    ),
    "moh_table4": ("MoH < MHA", [["MoH 75% heads", "MoH 50% heads"], ["MHA (100% heads)"]]),
}
CLAIMS = re.compile(
    r"^([ \t]*)<!-- claims (\S+) (\S+)(?: (final|mid))? -->\n(.*?)^[ \t]*<!-- /claims -->", re.S | re.M
)  # the text keeps the opening marker's indent (inside a list item)


def _points(data: dict, point: str) -> dict:
    """{cell: (mean, min, max)} at a validation point, cells in table order."""
    return {
        name: (p["mean"], p["min"], p["max"])
        for name, cell in data["cells"].items()
        if (p := cell.get("summary", {}).get(point))
    }


def fig2_claims(data: dict) -> str:
    """MoH Fig. 2 per seed: parent, converted, tuned, control, and which of tuned MoH and control is lower."""
    runs = data["runs"]

    def each(key, fmt="{:.2f}"):
        return " / ".join(fmt.format(run[key]) for run in runs)

    converted = " / ×".join(f"{run['moh_ppl_before_tuning'] / run['dense_ppl']:.3f}" for run in runs)
    conversion = runs[0].get("conversion", {})
    mode = conversion.get("moh_straight_through")
    ratio = [run["moh_ppl_after_tuning"] / run["dense_continued_ppl"] for run in runs]
    below = [str(seed) for seed, r in zip(data["seeds"], ratio) if r < 1]
    text = (
        f"Seeds {' / '.join(map(str, data['seeds']))}, converter router `{conversion.get('moh_router')}` with "
        f"straight-through `{mode!r}`, {runs[0]['active_heads']} heads active: the dense parent "
        f"({runs[0]['dense_tokens']:,} tokens) {each('dense_ppl')}; converted {each('moh_ppl_before_tuning')} "
        f"(×{converted} of the parent); after "
        f"{runs[0]['tune_tokens']:,} continue-tuning tokens {each('moh_ppl_after_tuning')} "
        f"(×{each('moh_over_dense', '{:.3f}').replace(' / ', ' / ×')} of the parent); the dense control trained "
        f"the same extra tokens {each('dense_continued_ppl')}: MoH / control "
        f"×{' / ×'.join(f'{r:.3f}' for r in ratio)}"
    )
    if len(below) == len(runs):
        return text + ", below the control in every seed."
    return text + (
        f", below the control in seed {', '.join(below)} only." if below else ", above the control in every seed."
    )


def claims(data: dict, point: str = "final") -> str:
    """The sentences about one table at one validation point (see the module docstring)."""
    if data["table"] == "moh_fig2":
        return fig2_claims(data)
    values = _points(data, point)
    tokens = next(iter(data["cells"].values()))["summary"][point]["tokens"]
    seeds = len(data["seeds"])
    runs = {name: len(data["cells"][name].get("runs", [])) for name in values}  # cells may lack seeds (a cut run)
    fewer = [f"{name} {n} seed{'s' if n > 1 else ''}" for name, n in runs.items() if n < seeds]
    listed = ", ".join(f"{name} {harness._fmt(data['cells'][name]['summary'][point])}" for name in values)
    order = sorted(values, key=lambda name: values[name][0])
    text = [
        f"{'Final' if point == 'final' else 'Mid-training'} validation perplexity after {tokens:,} tokens, mean of "
        f"{seeds} seeds (min–max){' (' + ', '.join(fewer) + ' so far)' if fewer else ''}: {listed}.",
        "Means: " + " < ".join(order) + ".",
    ]
    apart = [(a, b) for i, a in enumerate(order) for b in order[i + 1 :] if values[a][2] < values[b][1]]
    pairs = len(order) * (len(order) - 1) // 2
    ranges = "seed ranges" + (" (one seed's range: its value)" if fewer else "")
    if not apart:
        text.append(f"Every pair's {ranges} overlap.")
    elif len(apart) == pairs:
        text.append(f"Every pair's {ranges} are apart.")
    else:
        gaps = "; ".join(f"{a} below {b} (by {values[b][1] - values[a][2]:.2f})" for a, b in apart)
        text.append(f"{ranges.capitalize()} apart: {gaps}; the other {pairs - len(apart)} pair(s) overlap.")
    if data["table"] in PAPER_ORDER:
        words, groups = PAPER_ORDER[data["table"]]
        groups = [kept for group in groups if (kept := [c for c in group if c in values])]  # the cells run
        steps = [(a, b) for i, g in enumerate(groups) for h in groups[i + 1 :] for a in g for b in h]  # every pair
        wrong = [(a, b) for a, b in steps if values[a][0] >= values[b][0]]
        if wrong:
            text.append(
                f"The paper's ordering ({words}) does not hold in the means: "
                + "; ".join(f"{a} is not below {b}" for a, b in wrong)
                + "."
            )
        else:
            unseparated = [(a, b) for a, b in steps if values[a][2] >= values[b][1]]
            text.append(
                f"The paper's ordering ({words}) holds in the means"
                + (
                    ", and the seed ranges separate every step of it."
                    if not unseparated
                    else ", but the seed ranges do not separate "
                    + "; ".join(f"{a} from {b}" for a, b in unseparated)
                    + ", so two seeds do not establish it."
                )
            )
    return " ".join(text)


def results_table(table: str, scale: str) -> dict:
    return json.loads((harness.RESULTS / f"reproduce_{table}_{scale}.json").read_text())


def rewrite_claims(text: str) -> str:
    """`text` with every claims block replaced by what the committed JSON gives now."""

    def block(m: re.Match) -> str:
        indent, table, scale, point = m.group(1), m.group(2), m.group(3), m.group(4) or "final"
        point_words = f" {point}" if m.group(4) else ""
        said = textwrap.fill(
            claims(results_table(table, scale), point),
            width=118,
            initial_indent=indent,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        )
        return f"{indent}<!-- claims {table} {scale}{point_words} -->\n{said}\n{indent}<!-- /claims -->"

    return CLAIMS.sub(block, text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--claims"]:
        print(claims(results_table(argv[1], argv[2]), argv[3] if len(argv) > 3 else "final"))
        return
    if argv[:1] in (["--check"], ["--write"]):
        stale = []
        for name in argv[1:]:
            path = Path(name)
            text = path.read_text()
            new = rewrite_claims(text)
            if new != text:
                stale.append(name)
                if argv[0] == "--write":
                    path.write_text(new)
        if stale and argv[0] == "--check":
            sys.exit(f"claims differ from the JSON in: {', '.join(stale)} (compare.py --write them)")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("table")
    parser.add_argument("scale")
    parser.add_argument("--new", type=Path, default=harness.REPO / "benchmarks" / "results")
    parser.add_argument(
        "--labels",
        nargs=2,
        default=["library conventions", "official preset"],
        metavar=("OLD", "NEW"),
        help="the two columns' headings (each followed by the commit its runs recorded)",
    )
    args = parser.parse_args(argv)
    name = f"reproduce_{args.table}_{args.scale}.json"
    shown = subprocess.run(
        ["git", "show", f"{args.rev}:benchmarks/results/{name}"], cwd=harness.REPO, capture_output=True, text=True
    )
    if shown.returncode != 0:
        parser.error(f"no benchmarks/results/{name} at {args.rev}: {shown.stderr.strip()}")
    print(comparison(json.loads(shown.stdout), json.loads((args.new / name).read_text()), tuple(args.labels)))


if __name__ == "__main__":
    main()
