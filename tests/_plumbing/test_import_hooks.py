"""Post-import hooks (`mhmoe._plumbing.import_hooks`) against a throwaway package, each case in a fresh interpreter.

The package mimics the trap of Transformers: `fakepkg.model` imports `fakepkg.auto` before it defines its class, so a
hook on `fakepkg.auto` that needs `fakepkg.model` must wait for that import to finish (`after_imports_finish=True`)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PREAMBLE = """
import json, sys
from mhmoe._plumbing import import_hooks
import_hooks.TRACKED_PACKAGES = ("fakepkg",)
import_hooks._waiting.clear()  # start from no hooks: forget those `import mhmoe` asked for (Transformers, PEFT)
log = []
def needs_model(module):
    log.append(("needs_model", module.__name__, sys.modules["fakepkg.model"].Model.__name__))
def note(module):
    log.append(("note", module.__name__, "fakepkg.model" in sys.modules and hasattr(sys.modules["fakepkg.model"], "Model")))
finders = lambda: sum(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)
"""


@pytest.fixture
def run(tmp_path):
    package = tmp_path / "fakepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "auto.py").write_text("AUTO = True\n")
    (package / "model.py").write_text(
        "from . import auto  # mid-import, like transformers.modeling_layers\nclass Model:\n    pass\n"
    )

    def run(body: str) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)])}
        code = PREAMBLE + textwrap.dedent(body)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def test_hook_runs_after_the_module_is_first_imported_not_before(run):
    result = run("""
        import_hooks.when_imported("fakepkg.auto", note)
        before = list(log)
        import fakepkg.auto
        print(json.dumps(dict(before=before, after=log, finders=finders(), pending=import_hooks.pending())))
    """)
    assert result == dict(before=[], after=[["note", "fakepkg.auto", False]], finders=0, pending=[])


def test_hook_on_an_imported_module_runs_at_once(run):
    result = run("""
        import fakepkg.model
        import_hooks.when_imported("fakepkg.auto", needs_model, after_imports_finish=True)
        print(json.dumps(dict(log=log, finders=finders())))
    """)
    assert result == dict(log=[["needs_model", "fakepkg.auto", "Model"]], finders=0)


def test_after_imports_finish_waits_for_the_import_in_progress(run):
    """Without waiting the hook sees `fakepkg.model` half-executed (no Model yet); with waiting it runs once the
    import of `fakepkg.model` has finished, still inside the user's import statement."""
    result = run("""
        import_hooks.when_imported("fakepkg.auto", note)
        import_hooks.when_imported("fakepkg.auto", needs_model, after_imports_finish=True)
        import fakepkg.model
        print(json.dumps(dict(log=log, finders=finders())))
    """)
    assert result == dict(log=[["note", "fakepkg.auto", False], ["needs_model", "fakepkg.auto", "Model"]], finders=0)


def test_finder_stays_while_a_hook_waits_and_a_failed_import_keeps_the_hook(run, tmp_path):
    (tmp_path / "fakepkg" / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    result = run("""
        import_hooks.when_imported("fakepkg.broken", note)
        try:
            import fakepkg.broken
        except RuntimeError:
            pass
        print(json.dumps(dict(log=log, finders=finders(), pending=import_hooks.pending())))
    """)
    assert result == dict(log=[], finders=1, pending=["fakepkg.broken"])
