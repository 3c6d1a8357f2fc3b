"""mhmoe._plumbing.resources.data_dir from a checkout, and $MHMOE_EVAL_TASKS over it (the installed wheel's copy:
tests/test_installed_package.py)."""

from pathlib import Path

import pytest

from mhmoe._plumbing.resources import data_dir

ROOT = Path(__file__).resolve().parents[2]


def test_data_dir_from_the_checkout():
    assert data_dir("eval_tasks") == ROOT / "eval_tasks"
    assert data_dir("no_such_folder") is None
    with pytest.raises(ValueError, match="top-level folder name"):
        data_dir("../eval_tasks")


def test_eval_tasks_dir_override(tmp_path, monkeypatch):
    from mhmoe.evaluation.suites import EVAL_TASKS_ENV, eval_tasks_dir

    monkeypatch.delenv(EVAL_TASKS_ENV, raising=False)
    assert eval_tasks_dir() == ROOT / "eval_tasks"
    monkeypatch.setenv(EVAL_TASKS_ENV, str(tmp_path))
    assert eval_tasks_dir() == tmp_path


def test_data_dirs_puts_the_environment_folder_first(tmp_path, monkeypatch):
    from mhmoe._plumbing.resources import data_dir, data_dirs

    monkeypatch.delenv("MHMOE_TEST_DIR", raising=False)
    assert data_dirs("eval_tasks", "MHMOE_TEST_DIR") == [data_dir("eval_tasks")]
    monkeypatch.setenv("MHMOE_TEST_DIR", str(tmp_path))
    assert data_dirs("eval_tasks", "MHMOE_TEST_DIR") == [tmp_path, data_dir("eval_tasks")]
    assert data_dirs("no_such_folder", "MHMOE_TEST_DIR") == [tmp_path]
