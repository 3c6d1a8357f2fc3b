"""`mhmoe-eval` (and `python -m mhmoe.evaluation`): lm-eval's command line (`run`, `ls`, `validate`) with the `mhmoe`
model registered, `eval_tasks/` on the include path, `--model mhmoe` by default, and the papers' table rows and the
routing statistics added to the results (and printed).

`mhmoe-eval --print_tasks_dir` prints the installed `eval_tasks/` folder, for plain lm-eval
(`lm-eval run --include_path "$(mhmoe-eval --print_tasks_dir)" ...`). The arguments are parsed before the model and
lm-eval's evaluator (torch, Transformers) are imported, so a usage error prints at once."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

from .._plumbing.extras import require

require("eval", "lm_eval", feature="mhmoe-eval")

from .suites import EVAL_TASKS_ENV, _builtin_task_paths, add_paper_tables, eval_tasks_dir

log = logging.getLogger(__name__)


def _format_summary(results: dict) -> str:
    from .lm_eval_model import ROUTING_KEY

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
    `--model mhmoe` by default, and the paper table rows and routing statistics in the results (and printed).
    `--print_tasks_dir` (alone) prints the eval_tasks/ folder and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--print_tasks_dir" in argv:
        if argv != ["--print_tasks_dir"]:
            _exit_with_error("--print_tasks_dir takes no other argument")
        tasks_dir = eval_tasks_dir()
        if tasks_dir is None:
            _exit_with_error(f"this installation has no eval_tasks/ folder (set ${EVAL_TASKS_ENV})")
        print(tasks_dir)
        return
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    for handler in logging.getLogger("lm_eval").handlers:  # lm-eval binds its handler once, to the stderr of the
        if type(handler) is logging.StreamHandler:  # first call: follow today's (a second main() in one process)
            handler.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed
    saved_argv, sys.argv = sys.argv, ["mhmoe-eval", *argv]
    try:
        parser = HarnessCLI()
        _name_the_parsers(parser)
        args = parser.parse_args()  # reads sys.argv (and inserts `run` for the legacy form)
    finally:
        sys.argv = saved_argv
    from . import lm_eval_model  # noqa: F401 - registers the `mhmoe` lm-eval model (imports torch and Transformers)

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
        from ..hub.trust import code_refusal

        pretrained = args.model_args.get("pretrained", "") if isinstance(args.model_args, dict) else ""
        refusal = code_refusal(e, pretrained, "model or tokenizer", "--model_args ...,trust_remote_code=True")
        if refusal is None and not str(e).startswith(_USER_ERRORS):
            raise
        _exit_with_error(refusal or str(e))
    if captured and captured[-1]:
        summary = _format_summary(captured[-1])
        if summary:
            print(summary)


_USER_ERRORS = ("Tasks not found", "mhmoe_ppl_")  # lm-eval's unknown tasks; the ppl tasks' missing data


def _name_the_parsers(cli) -> None:
    """lm-eval's parsers (the command's and each subcommand's) call themselves `lm-eval` and print their usage before
    an error: here they are `mhmoe-eval` and a usage error is one line, `mhmoe-eval: error: MESSAGE (see ... --help)`,
    exit status 2."""
    main_parser, subparsers = getattr(cli, "_parser", None), getattr(cli, "_subparsers", None)
    parsers = [("", main_parser), *((f" {n}", p) for n, p in getattr(subparsers, "choices", {}).items())]
    for suffix, parser in parsers:
        if parser is None:
            continue
        parser.prog = f"mhmoe-eval{suffix}"
        if isinstance(parser.usage, str):
            parser.usage = parser.usage.replace("lm-eval", "mhmoe-eval")

        def one_line_error(message: str, prog=parser.prog) -> None:
            print(f"mhmoe-eval: error: {message} (see {prog} --help)", file=sys.stderr)
            raise SystemExit(2)

        parser.error = one_line_error


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
    from ..hub.trust import links_out

    for key in ("pretrained", "peft"):  # nothing is read through a link out of a checkpoint folder
        path = model_args.get(key)
        found = links_out(path) if isinstance(path, str) and os.path.isdir(path) else []
        if found:
            return (
                f"{key}={path} holds symbolic links out of the folder ({', '.join(found[:3])}); nothing is read "
                "through them: copy the files into the folder if you mean to use them, or remove the links"
            )
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


__all__ = ["main"]
