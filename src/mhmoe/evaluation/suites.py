"""The lm-eval suites shipped in `eval_tasks/` and the papers' table rows computed from their results.

- `eval_tasks_dir()`: the suites' folder ($MHMOE_EVAL_TASKS, else the copy shipped with mhmoe); `task_manager()` an
  lm-eval TaskManager with it on the include path, indexing only the lm-eval task folders the suites build on.
- `PAPER_TABLES` / `add_paper_tables`: the papers' table rows (one metric per column, e.g. TruthfulQA = mean of mc1 and
  mc2) and their averages, added to lm-eval results; `simple_evaluate` is lm-eval's plus the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .._plumbing.resources import data_dirs

log = logging.getLogger(__name__)

EVAL_TASKS_ENV = "MHMOE_EVAL_TASKS"


def eval_tasks_dir() -> Path | None:
    """The lm-eval suites: $MHMOE_EVAL_TASKS when set, else the `eval_tasks/` shipped with mhmoe (`mhmoe._plumbing.resources`:
    the repository's folder, or the wheel's copy); None when neither is there."""
    return next((path for path in data_dirs("eval_tasks", EVAL_TASKS_ENV) if path.is_dir()), None)


@dataclass(frozen=True)
class PaperTable:
    """One row of a paper table: `columns` maps a column name to the (task or group, lm-eval metric key) entries it
    averages (usually one). `average` is the unweighted mean of the columns, as the paper computes it."""

    title: str
    key: str  # the metric name under which the average is added to the suite's group results
    columns: dict


_TRUTHFULQA = [("truthfulqa_mc1", "acc,none"), ("truthfulqa_mc2", "acc,none")]


_TABLE5_AND_E = {
    "MMLU": [("mmlu", "acc,none")],
    "CEVAL": [("ceval-valid", "acc,none")],
    "CMMLU": [("cmmlu", "acc,none")],
    "GSM8K": [("gsm8k", "exact_match,strict-match")],
    "TruthfulQA": _TRUTHFULQA,
    "HellaSwag": [("hellaswag", "acc_norm,none")],
    "LogiQA": [("logiqa", "acc,none")],
    "BoolQ": [("boolq", "acc,none")],
    "LAMBADA": [("lambada_openai", "acc,none")],
    "SciQ": [("sciq", "acc,none")],
    "PIQA": [("piqa", "acc,none")],
    "WinoGrande": [("winogrande", "acc,none")],
    "NQ": [("nq_open", "exact_match,remove_whitespace")],
    "ARC-C": [("arc_challenge", "acc_norm,none")],
    "ARC-E": [("arc_easy", "acc,none")],
}


PAPER_TABLES: dict[str, list[PaperTable]] = {
    "moh_llm_suite": [
        PaperTable(
            "MoH Table 4 (MoH-LLM, 0-shot accuracy)",
            "table4_avg",
            {
                "SciQ": [("sciq", "acc,none")],
                "PIQA": [("piqa", "acc,none")],
                "WinoGrande": [("winogrande", "acc,none")],
                "OpenbookQA": [("openbookqa", "acc,none")],
                "LogiQA": [("logiqa", "acc,none")],
                "TruthfulQA": _TRUTHFULQA,
            },
        )
    ],
    "moh_llama3_suite": [
        PaperTable(
            "MoH Table 5 (MoH-LLaMA3-8B, 14 benchmarks)",
            "table5_avg",
            {k: v for k, v in _TABLE5_AND_E.items() if k != "ARC-E"},
        ),
        PaperTable(
            "MoH Appendix Table E (14 benchmarks, ARC-E in place of CEVAL)",
            "tableE_avg",
            {k: v for k, v in _TABLE5_AND_E.items() if k != "CEVAL"},
        ),
    ],
}


def add_paper_tables(results: dict | None) -> dict | None:
    """Add the paper table rows of every suite in `results` (lm-eval's `simple_evaluate` output), in place.

    `results["paper_tables"][suite][title]` = {"columns": {name: value}, "average": mean or None, "missing": [...]};
    the average is also added to `results["results"][suite]` and `results["groups"][suite]` as `<key>,none` so lm-eval's
    tables print it. Columns whose tasks did not run are listed in "missing" and leave the average unset.
    """
    if not results or "results" not in results:
        return results
    scores = {**results.get("results", {}), **results.get("groups", {})}
    for suite, tables in PAPER_TABLES.items():
        if suite not in results.get("group_subtasks", {}) and suite not in results["results"]:
            continue
        rows = results.setdefault("paper_tables", {}).setdefault(suite, {})
        for table in tables:
            columns, missing = {}, []
            for column, entries in table.columns.items():
                values = [scores.get(task, {}).get(metric) for task, metric in entries]
                if any(not isinstance(v, (int, float)) for v in values):
                    missing.append(column)
                    continue
                columns[column] = sum(values) / len(values)
            average = None if missing else sum(columns.values()) / len(columns)
            rows[table.title] = {"columns": columns, "average": average, "missing": missing}
            if average is not None:
                for section in ("results", "groups"):
                    entry = results.setdefault(section, {}).setdefault(suite, {"alias": suite})
                    entry[f"{table.key},none"] = average
                    entry[f"{table.key}_stderr,none"] = "N/A"
                results.setdefault("higher_is_better", {}).setdefault(suite, {})[table.key] = True
            else:
                log.warning("%s: %s not averaged, missing columns: %s", suite, table.title, ", ".join(missing))
    return results


def simple_evaluate(*args, **kwargs):
    """`lm_eval.simple_evaluate` plus `add_paper_tables` (routing statistics come from the `mhmoe` model itself)."""
    import lm_eval

    return add_paper_tables(lm_eval.simple_evaluate(*args, **kwargs))


BUILTIN_TASK_DIRS = {  # lm-eval task folders the suites use (for a fast TaskManager without the 14k-task index)
    "moh_llm_suite": ["sciq", "piqa", "winogrande", "openbookqa", "logiqa", "truthfulqa"],
    "moh_llama3_suite": [
        "mmlu/default",
        "ceval",
        "cmmlu",
        "gsm8k",
        "truthfulqa",
        "hellaswag",
        "logiqa",
        "super_glue/boolq",
        "lambada",
        "sciq",
        "piqa",
        "winogrande",
        "nq_open",
        "arc",
    ],
    "mhmoe_ppl": [],
}


def _builtin_task_paths(suites=None) -> list[str]:
    """The lm-eval task folders that `suites` (default: all suites here) build on."""
    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    names = BUILTIN_TASK_DIRS if suites is None else {s: BUILTIN_TASK_DIRS.get(s, []) for s in suites}
    return sorted({str(root / d) for dirs in names.values() for d in dirs})


def task_manager(suites=None, include_defaults: bool = False, include_path=None, metadata: dict | None = None):
    """A TaskManager with `eval_tasks/` on the include path. Without the defaults (the fast path: no 7 s index of all
    lm-eval tasks) it indexes only the lm-eval task folders that `suites` (default: all suites here) build on."""
    from lm_eval.tasks import TaskManager

    paths = [] if include_defaults else _builtin_task_paths(suites)
    tasks_dir = eval_tasks_dir()
    if tasks_dir is not None:
        paths.append(str(tasks_dir))
    paths += [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    return TaskManager(include_path=paths, include_defaults=include_defaults, metadata=metadata)


__all__ = [
    "BUILTIN_TASK_DIRS",
    "EVAL_TASKS_ENV",
    "PAPER_TABLES",
    "PaperTable",
    "add_paper_tables",
    "eval_tasks_dir",
    "simple_evaluate",
    "task_manager",
]
