"""mhmoe._plumbing.extras: the optional extras and the error naming the one to install. (That a console script prints it
instead of a traceback is checked where the extras really are missing: tests/test_installed_package.py.)"""

from pathlib import Path

import pytest

from mhmoe._plumbing.extras import EXTRAS, MissingExtraError, extra_of, require

ROOT = Path(__file__).resolve().parents[2]


def test_require_names_the_extra():
    require("train")  # the dev install has every extra
    expected = r'^mhmoe-eval needs not_installed_xyz, which is not installed: pip install "mhmoe\[eval\]"$'
    with pytest.raises(MissingExtraError, match=expected):
        require("eval", "not_installed_xyz", feature="mhmoe-eval")
    with pytest.raises(ValueError, match="unknown extra 'gpu'"):
        require("gpu")
    assert extra_of("lm_eval.tasks") == "eval" and extra_of("peft") == "train" and extra_of("torch") is None


def test_extras_match_pyproject():
    """mhmoe._plumbing.extras.EXTRAS lists, per extra, the modules of the distributions pyproject.toml's extra installs."""
    import tomllib
    from packaging.requirements import Requirement

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = {Requirement(requirement).name for requirement in declared[extra]}
        assert names == set(modules.values()), (extra, names)
