"""benchmarks/ holds what a user runs: at most 12 scripts at its top level, each in the README's benchmark table (the
finished studies are in benchmarks/studies/, each in its README), and no import circle among the scripts."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def _scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py") if not p.name.startswith("_"))


def test_at_most_12_benchmarks_each_in_the_readme_table():
    scripts = _scripts(BENCHMARKS)
    assert 0 < len(scripts) <= 12, scripts
    section = (REPO / "README.md").read_text().split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([\w.]+\.py)` \|", section, re.M))
    assert rows == set(scripts), (sorted(rows - set(scripts)), sorted(set(scripts) - rows))


def test_every_study_in_the_studies_readme():
    studies = _scripts(BENCHMARKS / "studies")
    rows = set(re.findall(r"^\| `([\w.]+\.py)` \|", (BENCHMARKS / "studies" / "README.md").read_text(), re.M))
    assert rows == set(studies), (sorted(rows - set(studies)), sorted(set(studies) - rows))


def test_no_import_circle_among_the_scripts():
    """Scripts import each other by file name (their folder on sys.path), so a name is one module: names are unique,
    and following every import (deferred ones too) never comes back to where it started."""
    files = [*BENCHMARKS.rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    names = [p.stem for p in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    graph = {}
    for path in files:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
        graph[path.stem] = imported & set(names) - {path.stem}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(graph[name]):
            assert nxt not in path, " -> ".join([*path, nxt])
            if nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(name)

    for name in sorted(graph):
        visit(name, [name])
    assert {"moh_convert_real"} <= graph["moh_convert_real_recovery"]  # the direction the circle was cut in
    assert "moh_convert_real_recovery" not in graph["moh_convert_real"]
