"""mhmoe-eval's command line (src/mhmoe/evaluation/cli.py): lm-eval's parsers under mhmoe-eval's name."""

import pytest

pytest.importorskip("lm_eval")

from mhmoe.evaluation import cli as eval_cli  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus (see mhmoe-eval --help)"),
        (["run", "--tasks", "x", "--bogus", "1"], "unrecognized arguments: --bogus 1 (see mhmoe-eval --help)"),
        (["run", "--limit", "abc"], "argument --limit/-L: invalid float value: 'abc' (see mhmoe-eval run --help)"),
        (["frob"], "argument COMMAND: invalid choice: 'frob'"),
        (
            ["ls", "frob"],
            "invalid choice: 'frob' (choose from 'tasks', 'groups', 'subtasks', 'tags') (see mhmoe-eval ls --help)",
        ),
    ],
)
def test_usage_errors_are_one_line_under_mhmoe_eval(argv, message, capsys):
    """lm-eval's parsers name themselves `lm-eval` and print their usage first: mhmoe-eval's usage errors are one
    line, `mhmoe-eval: error: ...`, exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exit_info.value.code == 2 and captured.out == ""
    assert len(lines) == 1 and lines[0].startswith("mhmoe-eval: error: ") and message in lines[0], captured.err
    assert "lm-eval" not in captured.err


def test_help_names_mhmoe_eval(capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: mhmoe-eval run ")


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_help_is_mhmoe_evals_own(argv, capsys):
    """`mhmoe-eval --help` describes mhmoe-eval with mhmoe examples (not lm-eval's `--model hf` ones), exit 0; so does
    the epilog of `mhmoe-eval run --help`."""
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: mhmoe-eval ")
    assert "Evaluate mhmoe checkpoints with lm-eval" in out and "--model hf" not in out and "lm-eval run" not in out
    assert "mhmoe-eval --model_args pretrained=DIR --tasks moh_llm_suite" in out and "checkpoint-N" in out
    with pytest.raises(SystemExit):
        eval_cli.main(["run", "--help"])
    run_help = capsys.readouterr().out
    assert "--model hf" not in run_help and "mhmoe-eval --model_args pretrained=DIR --tasks moh_llm_suite" in run_help
