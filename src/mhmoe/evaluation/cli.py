"""`mhmoe-eval` (and `python -m mhmoe.evaluation`): lm-eval's command line (`run`, `ls`, `validate`) with the `mhmoe`
model registered, `eval_tasks/` on the include path, `--model mhmoe` by default, and the papers' table rows and the
routing statistics added to the results (and printed).

`mhmoe-eval --print_tasks_dir` prints the installed `eval_tasks/` folder, for plain lm-eval
(`lm-eval run --include_path "$(mhmoe-eval --print_tasks_dir)" ...`). The arguments are parsed before the model and
lm-eval's evaluator (torch, Transformers) are imported, so a usage error prints at once."""

from __future__ import annotations

import contextlib
import logging
import math
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


def _public(value):
    """A local path (one that exists here) as the results name it: a Hugging Face cache snapshot by its repo id, any
    other by its file or folder name; anything else as it is."""
    if isinstance(value, str) and os.path.isabs(value) and os.path.exists(value):
        from ..hub.cards import base_model_name

        return base_model_name(value)
    return value


def _without_local_paths(obj):
    """`obj` (the results lm-eval saves with --output_path) with every local path replaced by `_public`."""
    if isinstance(obj, dict):
        return {key: _without_local_paths(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_without_local_paths(value) for value in obj)
    return _public(obj)


def _quiet_git_hash():
    """lm-eval's `get_git_commit_hash` without git's `fatal: not a git repository` on the terminal."""
    import subprocess

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, OSError):
        return None


class _SaveFailure(logging.Filter):
    """lm-eval logs a failure to save the results (a warning, then the exception's repr) and goes on with exit status
    0: kept here (and off the terminal) so that the command can stop with one line."""

    def __init__(self):
        super().__init__()
        self.failed, self.detail = False, None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Could not save results"):
            self.failed = True
            return False
        if self.failed and self.detail is None:
            self.detail = message
            return False
        return True

    def error(self):
        """The OSError the failure was (from its repr), else None."""
        import errno
        import re

        match = re.match(r"(\w+)\((\d+), ", self.detail or "")
        if match and int(match.group(2)) in errno.errorcode:
            code = int(match.group(2))
            return OSError(code, os.strerror(code))
        return None


class _DropMetadataHint(logging.Filter):
    """lm-eval's hint that a task takes `--metadata`, printed by every task that reads local files even when it was
    given."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def _cli_patches(captured: list, suites_only: bool, metadata_given: bool = False):
    """Patch the names lm-eval's `run` command looks up at call time: `lm_eval.simple_evaluate` (to add the paper
    table rows), `lm_eval.evaluator.get_git_commit_hash` (git's complaint outside a repository silenced) and, when
    every requested task is one of ours, `lm_eval.tasks.TaskManager` (to index only `eval_tasks/` and the lm-eval task
    folders the suites build on instead of all ~14k tasks: ~10 s less per run). With `metadata_given`, lm-eval's hint
    to pass `--metadata` is dropped."""
    import lm_eval
    import lm_eval.evaluator
    import lm_eval.tasks

    original_evaluate, original_manager = lm_eval.simple_evaluate, lm_eval.tasks.TaskManager
    original_git = getattr(lm_eval.evaluator, "get_git_commit_hash", None)
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker

    original_name = GeneralConfigTracker.__dict__.get("_get_model_name")
    hint_filter = _DropMetadataHint()

    def evaluate_and_add_tables(*a, **k):
        results = _without_local_paths(add_paper_tables(original_evaluate(*a, **k)))
        captured.append(results)
        return results

    class SuiteTaskManager(original_manager):
        def __init__(self, *a, include_path=None, include_defaults=True, **k):
            paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
            super().__init__(*a, include_path=_builtin_task_paths() + paths, include_defaults=False, **k)

    lm_eval.simple_evaluate = evaluate_and_add_tables
    if suites_only:
        lm_eval.tasks.TaskManager = SuiteTaskManager
    if original_git is not None:
        lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash
    if isinstance(original_name, staticmethod):  # the results' model name and folder: never a local path
        GeneralConfigTracker._get_model_name = staticmethod(lambda args: _public(original_name.__func__(args)))
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm_eval.api.task")]
    for logger in loggers if metadata_given else []:
        logger.addFilter(hint_filter)
    try:
        yield
    finally:
        lm_eval.simple_evaluate, lm_eval.tasks.TaskManager = original_evaluate, original_manager
        if original_git is not None:
            lm_eval.evaluator.get_git_commit_hash = original_git
        if isinstance(original_name, staticmethod):
            GeneralConfigTracker._get_model_name = original_name
        for logger in loggers:
            logger.removeFilter(hint_filter)


def main(argv: list[str] | None = None) -> None:
    """`mhmoe-eval`: lm-eval's CLI (`run`, `ls`, `validate`) with mhmoe imported, `eval_tasks/` on the include path,
    `--model mhmoe` by default, and the paper table rows and routing statistics in the results (and printed).
    `--print_tasks_dir` (alone) prints the eval_tasks/ folder and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--print_tasks_dir" in argv:
        _print_tasks_dir(argv)
        return
    if not argv:
        _exit_with_error(
            "give the checkpoint and the tasks: --model_args pretrained=DIR --tasks TASKS (see mhmoe-eval --help)"
        )
    parser, args = _parse(argv)
    from . import lm_eval_model  # noqa: F401 - registers the `mhmoe` lm-eval model (imports torch and Transformers)

    tasks_dir = eval_tasks_dir()
    if tasks_dir is None:
        log.warning("eval_tasks/ not found (set $%s): the mhmoe suites are unavailable", EVAL_TASKS_ENV)
    if getattr(args, "command", None) != "run":  # ls / validate
        _execute_other_command(parser, args, tasks_dir)
        return
    suites_only = _prepare_run(args, tasks_dir)
    problem = _run_arguments_problem(args) or _model_args_problem(args.model, args.model_args)
    if problem:
        _exit_with_error(problem)
    before = _files_under(args.output_path)
    try:
        results = _execute_run(parser, args, suites_only)
    except BaseException as e:  # a failed or interrupted run leaves no half-written results behind
        _remove_new_files(args.output_path, before)
        if not isinstance(e, KeyboardInterrupt):
            raise
        from .._plumbing.interrupts import report

        report("mhmoe-eval", "no results were written: run the same command again")
    if results:
        summary = _format_summary(results)
        if summary:
            print(summary)


def _results_folder(output_path: str | None) -> str | None:
    """Where lm-eval writes the results of --output_path (a folder, or a `.json` file name in its folder)."""
    if not output_path:
        return None
    return os.path.dirname(os.path.abspath(output_path)) if output_path.endswith(".json") else output_path


def _files_under(output_path: str | None) -> set[str]:
    """Every path under the results folder (the folder itself included) as it is now."""
    folder = _results_folder(output_path)
    if folder is None or not os.path.isdir(folder):
        return set()
    found = {os.path.join(root, name) for root, dirs, files in os.walk(folder) for name in dirs + files}
    return found | {folder}


def _remove_new_files(output_path: str | None, before: set[str]) -> None:
    """Remove what this run wrote under --output_path (a results file cut short by a full disk, a Ctrl-C); what was
    there before stays."""
    folder = _results_folder(output_path)
    if folder is None or not os.path.isdir(folder):
        return
    for root, dirs, files in os.walk(folder, topdown=False):
        for path in [os.path.join(root, name) for name in files]:
            if path not in before:
                os.remove(path)
        for path in [os.path.join(root, name) for name in dirs]:
            if path not in before and not os.listdir(path):
                os.rmdir(path)
    if folder not in before and not os.listdir(folder):
        os.rmdir(folder)


def _print_tasks_dir(argv: list[str]) -> None:
    """`--print_tasks_dir`, given alone: the installed eval_tasks/ folder on stdout."""
    if argv != ["--print_tasks_dir"]:
        _exit_with_error("--print_tasks_dir takes no other argument")
    tasks_dir = eval_tasks_dir()
    if tasks_dir is None:
        _exit_with_error(f"this installation has no eval_tasks/ folder (set ${EVAL_TASKS_ENV})")
    print(tasks_dir)


def _parse(argv: list[str]):
    """lm-eval's parser under mhmoe-eval's name and the arguments it reads from `argv`; lm-eval's logging to today's
    stderr."""
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
    except ValueError as e:  # lm-eval's dict arguments (--model_args, --metadata) raise it for text that is not JSON
        _exit_with_error(f"{e} (see mhmoe-eval run --help)")
    finally:
        sys.argv = saved_argv
    return parser, args


def _execute_other_command(parser, args, tasks_dir: Path | None) -> None:
    """`ls` / `validate`, with eval_tasks/ first on the include path."""
    if tasks_dir is not None and hasattr(args, "include_path"):
        user = args.include_path
        args.include_path = [str(tasks_dir), *([user] if user else [])]
    parser.execute(args)


def _prepare_run(args, tasks_dir: Path | None) -> bool:
    """`run`'s arguments completed in place (keeping a --config YAML's model, tasks and include_path): `--model mhmoe`
    by default, eval_tasks/ first on the include path. Returns whether every requested task is one of eval_tasks/."""
    yaml_cfg = {}
    if getattr(args, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        yaml_cfg = EvaluatorConfig.load_yaml_config(args.config)
    args.model = args.model or yaml_cfg.get("model") or "mhmoe"
    user = args.include_path or yaml_cfg.get("include_path")
    user = [] if user is None else user if isinstance(user, list) else [user]
    args.include_path = ([str(tasks_dir)] if tasks_dir else []) + [str(p) for p in user]
    requested = _requested_tasks(args.tasks or yaml_cfg.get("tasks"))
    ours = _suite_names(tasks_dir)
    return bool(requested) and all(name in ours for name in requested)


def _execute_run(parser, args, suites_only: bool) -> dict | None:
    """lm-eval's `run` with mhmoe's patches; its results (with the paper table rows), None if it produced none. A
    user's mistake or a machine's problem (offline data, a full disk, a failed save) ends the command with one line."""
    captured: list = []
    saving = _SaveFailure()
    tracker_log = logging.getLogger("lm_eval.loggers.evaluation_tracker")
    tracker_log.addFilter(saving)
    try:
        with _cli_patches(captured, suites_only, metadata_given=bool(args.metadata)):
            parser.execute(args)
        if saving.failed and saving.error() is None:
            print(
                f"mhmoe-eval: error: the results could not be saved to {args.output_path} ({saving.detail})",
                file=sys.stderr,
            )
            raise SystemExit(1)
        if saving.failed:
            raise saving.error()
    except ValueError as e:  # user mistakes lm-eval and the mhmoe_ppl tasks report as ValueError: one line, no trace
        from .._plumbing.trust import code_refusal

        pretrained = args.model_args.get("pretrained", "") if isinstance(args.model_args, dict) else ""
        refusal = code_refusal(e, pretrained, "model or tokenizer", "--model_args ...,trust_remote_code=True")
        if refusal is None and not str(e).startswith(_USER_ERRORS):
            raise
        _exit_with_error(refusal or str(e))
    except ConnectionError as e:  # a Hub dataset, offline or unreachable (the datasets library raises this)
        _exit_with_error(
            f"{e}: its data is neither in the datasets cache nor in a folder of that name here; run "
            "once online to cache it, or run from a folder holding a copy (eval_tasks/README.md, "
            "'Offline evaluation')"
        )
    except Exception as e:  # full disk, file size limit, read-only, permissions writing --output_path: one line
        from .._plumbing.checkpoint_files import write_error_message

        filename = getattr(e, "filename", None)  # the datasets cache, or --output_path
        where = os.path.dirname(filename) if isinstance(filename, str) else getattr(args, "output_path", None)
        message = write_error_message(e, where or "the results")
        if message is None:
            raise
        print(f"mhmoe-eval: error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        tracker_log.removeFilter(saving)
    return captured[-1] if captured else None


_USER_ERRORS = ("Tasks not found", "mhmoe_ppl_")  # lm-eval's unknown tasks; the ppl tasks' missing data


DESCRIPTION = (
    "Evaluate mhmoe checkpoints with lm-eval: lm-eval's command line with the `mhmoe` model (lm-eval's "
    "HFLM for every mhmoe model type, with routing statistics) as the default --model, mhmoe's suites "
    "(eval_tasks/) on the include path, and the papers' table rows and the routing statistics added to "
    "the results."
)
EXAMPLES = """examples:
  mhmoe-eval --model_args pretrained=DIR --tasks moh_llm_suite           MoH Table 4 (0-shot)
  mhmoe-eval --model_args pretrained=DIR --tasks moh_llama3_suite        MoH Table 5 / Table E
  mhmoe-eval --model_args pretrained=DIR,max_length=2048 --tasks mhmoe_ppl_wikipedia \\
      --metadata '{"wikipedia_path": "valid.jsonl"}'                     perplexity on a local file
  mhmoe-eval --model_args pretrained=BASE_DIR,peft=ADAPTER_DIR --tasks moh_llm_suite
  mhmoe-eval --model_args pretrained=DIR --tasks moh_llm_suite --limit 10 --output_path results/
  mhmoe-eval ls tasks                                                    lm-eval's tasks and mhmoe's suites
  mhmoe-eval --print_tasks_dir                                           eval_tasks/, for plain lm-eval

`run` is implied (mhmoe-eval --tasks ... = mhmoe-eval run --tasks ...); all its options: mhmoe-eval run --help.
DIR is a checkpoint folder (mhmoe-train's output or one of its checkpoint-N folders, mhmoe-convert's, an export);
code a folder names runs only with --model_args ...,trust_remote_code=True. Suites and data: eval_tasks/README.md."""
RUN_EXAMPLES = EXAMPLES.split("\n\n")[0]


def _name_the_parsers(cli) -> None:
    """lm-eval's parsers (the command's and each subcommand's) call themselves `lm-eval` and print their usage before
    an error: here they are `mhmoe-eval` with mhmoe's description and examples, and a usage error is one line,
    `mhmoe-eval: error: MESSAGE (see ... --help)`, exit status 2."""
    main_parser, subparsers = getattr(cli, "_parser", None), getattr(cli, "_subparsers", None)
    parsers = [("", main_parser), *((f" {n}", p) for n, p in getattr(subparsers, "choices", {}).items())]
    for suffix, parser in parsers:
        if parser is None:
            continue
        parser.prog = f"mhmoe-eval{suffix}"
        if isinstance(parser.usage, str):
            parser.usage = parser.usage.replace("lm-eval", "mhmoe-eval")
        if suffix in ("", " run"):  # lm-eval's text shows `lm-eval run --model hf ...`
            import argparse
            import textwrap

            parser.description = textwrap.fill(DESCRIPTION, 100)
            parser.epilog = EXAMPLES if suffix == "" else RUN_EXAMPLES
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
        elif isinstance(parser.epilog, str):
            parser.epilog = parser.epilog.replace("lm-eval", "mhmoe-eval")

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
    from .._plumbing.trust import links_out

    for key in ("pretrained", "peft"):  # nothing is read through a link out of a checkpoint folder
        path = model_args.get(key)
        found = links_out(path) if isinstance(path, str) and os.path.isdir(path) else []
        if found:
            return (
                f"{key}={path} holds symbolic links out of the folder ({', '.join(found[:3])}); nothing is read "
                "through them: copy the files into the folder if you mean to use them, or remove the links"
            )
    adapter = model_args.get("peft")
    if isinstance(adapter, str) and os.path.isdir(adapter):
        problem = _adapter_problem(adapter)
        if problem:
            return problem
    if isinstance(pretrained, str) and os.path.isdir(pretrained):
        has = {name: os.path.isfile(os.path.join(pretrained, name)) for name in ("config.json", "adapter_config.json")}
        if has["adapter_config.json"] and not has["config.json"]:
            return f"pretrained={pretrained} is a LoRA adapter folder: use pretrained=BASE_MODEL_DIR,peft={pretrained}"
        problem = _weights_problem("pretrained", pretrained, model_args)
        if problem:
            return problem
    key = "tokenizer" if model_args.get("tokenizer") else "pretrained"  # the tokenizer lm-eval will load
    problem = _tokenizer_problem(model_args.get(key), model_args)  # one line now, not a traceback later
    return f"{key}={model_args[key]}: {problem}" if problem else None


class _Refused(ValueError):
    pass


def _tokenizer_problem(path, model_args: dict) -> str | None:
    """Why the tokenizer of local folder `path` does not load (loaded here once, as lm-eval will load it), in words."""
    from .._plumbing.trust import load_tokenizer

    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    trust = str(model_args.get("trust_remote_code", "")).lower() in ("true", "1", "yes")
    try:
        load_tokenizer(path, _Refused, trust, "model or tokenizer", "--model_args ...,trust_remote_code=True")
    except _Refused as e:
        return str(e)
    return None


def _adapter_problem(path: str) -> str | None:
    """A PEFT adapter folder (`peft=`) holds its weights as safetensors: PEFT would unpickle adapter_model.bin, and
    pickles are never loaded here."""
    from .._plumbing.checkpoint_files import PICKLE_SUFFIXES

    names = os.listdir(path)
    if "adapter_model.safetensors" in names:
        return None
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        return (
            f"peft={path} holds its adapter only as a pickle ({', '.join(pickles[:3])}); pickles are never loaded here "
            "(loading one can run code): save the adapter as adapter_model.safetensors (PEFT's save_pretrained does "
            "by default)"
        )
    return None


def _run_arguments_problem(args) -> str | None:
    """--batch_size and --limit values lm-eval would only fail on after loading the model, in words."""
    batch_size = str(getattr(args, "batch_size", "") or "")
    if batch_size.lstrip("-").isdigit() and int(batch_size) < 1:
        return f"--batch_size {batch_size}: give a number >= 1, 'auto' or 'auto:N'"
    limit = getattr(args, "limit", None)
    if limit is not None and not (limit > 0 and math.isfinite(limit)):
        return f"--limit {limit:g}: give a number of examples per task (>= 1) or a fraction in (0, 1)"
    return _output_path_problem(getattr(args, "output_path", None))


def _output_path_problem(output_path: str | None) -> str | None:
    """--output_path can be written (checked before evaluating, not after): no file where a folder is needed. lm-eval
    takes a folder, or a `.json` file name whose folder gets the results."""
    if not output_path:
        return None
    path = os.path.abspath(output_path)
    folder = os.path.dirname(path) if path.endswith(".json") else path
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"--output_path {output_path}: {folder} is a file, not a folder; choose a path under a folder"
    return None


def _weights_problem(key: str, path: str, model_args: dict) -> str | None:
    """The weights of checkpoint folder `path` are safetensors that read back whole (pickles are never loaded), and
    --model_args max_length fits the model's positions."""
    from .._plumbing.checkpoint_files import CheckpointError, check_weight_files, read_model_type

    if not os.path.isfile(os.path.join(path, "config.json")):
        return None  # Transformers says what is missing
    try:
        check_weight_files(path, CheckpointError)
        model_type = read_model_type(os.path.join(path, "config.json"))
    except CheckpointError as e:
        return f"{key}={path}: {e}"
    if model_type in ("mhmoe", "moh_llama"):  # our configs' checks, in one line before lm-eval loads the model
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(path, trust_remote_code=False)  # mhmoe's own class: no folder code
        except Exception as e:  # ValueError/TypeError, huggingface_hub's StrictDataclass*Error (not ValueErrors)
            if not isinstance(e, (TypeError, ValueError)) and type(e).__module__.split(".")[0] != "huggingface_hub":
                raise
            message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            return f"{key}={path}: invalid config.json: {message}"
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        positions = json.load(f).get("max_position_embeddings")
    max_length = model_args.get("max_length")
    if (
        isinstance(positions, int)
        and max_length is not None
        and str(max_length).isdigit()
        and int(max_length) > positions
    ):
        return (
            f"max_length={max_length} is longer than the {positions} positions of {path} (a {model_type} "
            f"model): give max_length <= {positions}"
        )
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
