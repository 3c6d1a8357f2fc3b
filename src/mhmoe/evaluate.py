"""lm-eval-harness integration: the `mhmoe` lm-eval model, routing statistics, the papers' table rows, `mhmoe-eval`.

- `MHMoELM` (lm-eval model name `mhmoe`): lm-eval's `HFLM` with the library imported, so checkpoints of every model
  type mhmoe registers load through the Auto classes. It takes HFLM's model_args (`pretrained`, `dtype`, `peft`,
  `batch_size`, `max_length`, ...) plus `routing_stats` (default true), and adds to `results["config"]`
  `routing_statistics`: per MoE layer the expert load entropy and max-load ratio over the evaluated tokens (padding
  excluded), averaged over layers, and MoH activated heads % from every MoH head router (`MoHRouter`, whose first output is the (B, T, H) gates).
- `PAPER_TABLES` / `add_paper_tables`: the papers' table rows (one metric per column, e.g. TruthfulQA = mean of mc1
  and mc2) and their averages, added to lm-eval results for the suites in `eval_tasks/`.
- `main` (`mhmoe-eval`, `python -m mhmoe.evaluate`): lm-eval's CLI with this module imported, `eval_tasks/` on the
  include path, `--model mhmoe` by default, and the table rows and routing statistics added to the results.

lm-eval finds models only in modules that are imported (no entry points), so plain `lm-eval --model mhmoe` does not
work; use `mhmoe-eval`, or `import mhmoe.evaluate` before calling `lm_eval.simple_evaluate`. A checkpoint exported
with its modeling code (`mhmoe.hub.export_pretrained`, `mhmoe-export`) also runs with plain lm-eval and no mhmoe
installed: `lm-eval run --model hf --model_args pretrained=DIR,trust_remote_code=True` (without routing statistics).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mhmoe.extras import require

require("eval", "lm_eval", feature="mhmoe.evaluate")

from lm_eval.api.registry import register_model
from lm_eval.models import huggingface as _hf_module
from lm_eval.models.huggingface import HFLM

import mhmoe  # noqa: F401  (registers the model types with the Auto classes)
from mhmoe.analysis import RoutingStatistics
from mhmoe.resources import data_dirs

log = logging.getLogger(__name__)

ROUTING_KEY = "routing_statistics"
EVAL_TASKS_ENV = "MHMOE_EVAL_TASKS"

_ACTIVE: dict = {}  # the most recently built MHMoELM's tokenizer, for the perplexity tasks' token counts


def eval_tasks_dir() -> Path | None:
    """The lm-eval suites: $MHMOE_EVAL_TASKS when set, else the `eval_tasks/` shipped with mhmoe (`mhmoe.resources`:
    the repository's folder, or the wheel's copy); None when neither is there."""
    return next((path for path in data_dirs("eval_tasks", EVAL_TASKS_ENV) if path.is_dir()), None)


def active_tokenizer():
    """The tokenizer of the most recently built `mhmoe` lm-eval model in this process (or None)."""
    return _ACTIVE.get("tokenizer")


@contextlib.contextmanager
def _recording_padding(stats: RoutingStatistics | None):
    """Let the statistics see the real lengths of HFLM's right-padded loglikelihood batches.

    HFLM calls the model on zero-padded rows without an attention mask; causal outputs of real tokens do not depend on
    the padding, but the routers still route it. HFLM pads through its module-level `pad_and_concat`, which this
    wraps for the duration of one `_loglikelihood_tokens` call to record the lengths. If lm-eval stops padding this
    way, statistics simply include padding (as with any batch of unequal lengths).
    """
    original = getattr(_hf_module, "pad_and_concat", None)
    if stats is None or original is None:
        yield
        return

    def recording(max_length, tensors, padding_side="right"):
        stats.pending_lengths = [int(t.shape[-1]) for t in tensors] if padding_side == "right" else None
        return original(max_length, tensors, padding_side=padding_side)

    _hf_module.pad_and_concat = recording
    try:
        yield
    finally:
        _hf_module.pad_and_concat = original


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class MHMoELM(HFLM):
    """lm-eval's HFLM for mhmoe checkpoints (any model type `import mhmoe` registers), with routing statistics.

    Model args: everything HFLM takes (`pretrained`, `dtype`, `peft`, `batch_size`, `max_length`, `device`, ...);
    `backend` defaults to "causal" (mhmoe model types are not in Transformers' static causal-LM list);
    `routing_stats=false` turns the forward hooks off.
    """

    def __init__(self, pretrained, backend: str = "causal", routing_stats: bool | str = True, **kwargs):
        super().__init__(pretrained=pretrained, backend=backend, **kwargs)
        self.routing = RoutingStatistics(self.model) if _as_bool(routing_stats) else None
        _ACTIVE["tokenizer"] = self.tokenizer

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        with _recording_padding(self.routing):
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    def _detect_batch_size(self, requests=None, pos: int = 0):
        # the probe batches are not evaluation data
        with self.routing.paused() if self.routing is not None else contextlib.nullcontext():
            return super()._detect_batch_size(requests, pos)

    def routing_summary(self, reset: bool = False) -> dict:
        if self.routing is None:
            return {}
        summary = self.routing.summary()
        if reset:
            self.routing.reset()
        return summary

    def get_model_info(self) -> dict:
        """HFLM's model info plus the routing statistics of this evaluation (counters restart afterwards, so each
        `simple_evaluate` call reports its own)."""
        info = super().get_model_info()
        if self.routing is not None:
            info[ROUTING_KEY] = self.routing_summary(reset=True)
        return info


if __name__ != "__main__":  # `python -m mhmoe.evaluate` registers through the imported module (see the bottom)
    register_model("mhmoe")(MHMoELM)


# ------------------------------------------------------------------------------------------------ paper table rows


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
    "moh_llama3_suite": ["mmlu/default", "ceval", "cmmlu", "gsm8k", "truthfulqa", "hellaswag", "logiqa",
                         "super_glue/boolq", "lambada", "sciq", "piqa", "winogrande", "nq_open", "arc"],  # fmt: skip
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


# ------------------------------------------------------------------------------------------------------------ CLI


def _format_summary(results: dict) -> str:
    lines = []
    for suite, tables in results.get("paper_tables", {}).items():
        for title, row in tables.items():
            cols = ", ".join(f"{k} {100 * v:.1f}" for k, v in row["columns"].items())
            avg = f"{100 * row['average']:.1f}" if row["average"] is not None else "n/a (missing columns)"
            lines.append(f"{suite} | {title}: average {avg} | {cols}")
    stats = results.get("config", {}).get(ROUTING_KEY)
    if stats:
        parts = [f"MoE layers {stats['moe_layers']}"]
        if stats.get("moe_layers"):
            parts += [
                f"expert load entropy {stats['expert_load_entropy']:.4f} nats "
                f"(normalized {stats['expert_load_entropy_normalized']:.4f})",
                f"max-load ratio {stats['expert_max_load_ratio']:.3f}",
            ]
        if stats.get("moh_layers"):
            parts.append(f"MoH layers {stats['moh_layers']}, activated heads {stats['activated_heads_pct']:.1f}%")
        lines.append("routing statistics: " + "; ".join(parts))
    return "\n".join(lines)


def _suite_names(tasks_dir: Path | None) -> set[str]:
    """Names of the tasks and groups defined in `eval_tasks/` (read from its YAML only)."""
    if tasks_dir is None:
        return set()
    from lm_eval.tasks._index import TaskIndex

    return set(TaskIndex().build([tasks_dir]))


def _requested_tasks(tasks) -> list[str]:
    if tasks is None:
        return []
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    return [t for item in items if isinstance(item, str) for t in item.split(",") if t]


@contextlib.contextmanager
def _cli_patches(captured: list, suites_only: bool):
    """Patch the two names lm-eval's `run` command looks up at call time: `lm_eval.simple_evaluate` (to add the paper
    table rows) and, when every requested task is one of ours, `lm_eval.tasks.TaskManager` (to index only
    `eval_tasks/` and the lm-eval task folders the suites build on instead of all ~14k tasks: ~10 s less per run)."""
    import lm_eval
    import lm_eval.tasks

    original_evaluate, original_manager = lm_eval.simple_evaluate, lm_eval.tasks.TaskManager

    def evaluate_and_add_tables(*a, **k):
        results = add_paper_tables(original_evaluate(*a, **k))
        captured.append(results)
        return results

    class SuiteTaskManager(original_manager):
        def __init__(self, *a, include_path=None, include_defaults=True, **k):
            paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
            super().__init__(*a, include_path=_builtin_task_paths() + paths, include_defaults=False, **k)

    lm_eval.simple_evaluate = evaluate_and_add_tables
    if suites_only:
        lm_eval.tasks.TaskManager = SuiteTaskManager
    try:
        yield
    finally:
        lm_eval.simple_evaluate, lm_eval.tasks.TaskManager = original_evaluate, original_manager


def main(argv: list[str] | None = None) -> None:
    """`mhmoe-eval`: lm-eval's CLI (`run`, `ls`, `validate`) with mhmoe imported, `eval_tasks/` on the include path,
    `--model mhmoe` by default, and the paper table rows and routing statistics in the results (and printed)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    saved_argv, sys.argv = sys.argv, ["mhmoe-eval", *argv]
    try:
        parser = HarnessCLI()
        args = parser.parse_args()  # reads sys.argv (and inserts `run` for the legacy form)
    finally:
        sys.argv = saved_argv
    tasks_dir = eval_tasks_dir()
    if tasks_dir is None:
        log.warning("eval_tasks/ not found (set $%s): the mhmoe suites are unavailable", EVAL_TASKS_ENV)
    if getattr(args, "command", None) != "run":  # ls / validate
        if tasks_dir is not None and hasattr(args, "include_path"):
            user = args.include_path
            args.include_path = [str(tasks_dir), *([user] if user else [])]
        parser.execute(args)
        return

    yaml_cfg = {}
    if getattr(args, "config", None):  # keep a --config YAML's model, tasks and include_path
        from lm_eval.config.evaluate_config import EvaluatorConfig

        yaml_cfg = EvaluatorConfig.load_yaml_config(args.config)
    args.model = args.model or yaml_cfg.get("model") or "mhmoe"
    user = args.include_path or yaml_cfg.get("include_path")
    user = [] if user is None else user if isinstance(user, list) else [user]
    args.include_path = ([str(tasks_dir)] if tasks_dir else []) + [str(p) for p in user]
    requested = _requested_tasks(args.tasks or yaml_cfg.get("tasks"))
    ours = _suite_names(tasks_dir)
    suites_only = bool(requested) and all(name in ours for name in requested)

    problem = _model_args_problem(args.model, args.model_args)
    if problem:
        _exit_with_error(problem)
    captured: list = []
    try:
        with _cli_patches(captured, suites_only):
            parser.execute(args)
    except ValueError as e:  # user mistakes lm-eval and the mhmoe_ppl tasks report as ValueError: one line, no trace
        if not str(e).startswith(_USER_ERRORS):
            raise
        _exit_with_error(str(e))
    if captured and captured[-1]:
        summary = _format_summary(captured[-1])
        if summary:
            print(summary)


_USER_ERRORS = ("Tasks not found", "mhmoe_ppl_")  # lm-eval's unknown tasks; the ppl tasks' missing data


def _exit_with_error(message: str) -> None:
    print(f"mhmoe-eval: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _model_args_problem(model: str, model_args) -> str | None:
    """What is wrong with the checkpoint paths in --model_args (local folders; the Hub only from its cache when
    offline), in words; None when nothing is (or when another model type's arguments are given)."""
    model_args = {} if model_args in (None, "") else model_args
    if model not in ("mhmoe", "hf") or not isinstance(model_args, dict):
        return None
    pretrained = model_args.get("pretrained")
    if pretrained is None:
        return "give the checkpoint with --model_args pretrained=DIR" if model == "mhmoe" else None
    for key in ("pretrained", "peft"):
        path = model_args.get(key)
        if isinstance(path, str) and not os.path.isdir(path) and _offline() and not _cached_on_hub(path):
            return f"{key}={path}: no such directory, and the Hub is offline (HF_HUB_OFFLINE=1) with no cached copy"
    if isinstance(pretrained, str) and os.path.isdir(pretrained):
        has = {name: os.path.isfile(os.path.join(pretrained, name)) for name in ("config.json", "adapter_config.json")}
        if has["adapter_config.json"] and not has["config.json"]:
            return f"pretrained={pretrained} is a LoRA adapter folder: use pretrained=BASE_MODEL_DIR,peft={pretrained}"
    return None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_on_hub(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id either
        return False


if __name__ == "__main__":
    from mhmoe.evaluate import main as _main  # the importable module is the one registered with lm-eval

    _main()
