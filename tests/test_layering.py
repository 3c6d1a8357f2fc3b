"""The house's arrows go down: no module of src/mhmoe imports one from a layer above its own, the import graph has no
cycle, and every module imports on its own in a fresh interpreter.

Layers, bottom up (mhmoe/__init__.py says the same): `_plumbing` (imports nothing of mhmoe), `models` (the model layer),
`hub`, `evaluation`, `training`, `convert`, and the top (`mhmoe` itself, `mhmoe.demo` and `mhmoe.recovery_demo`,
which use the jobs). Every `import` statement counts, deferred ones inside functions and `if TYPE_CHECKING:` ones
included: a reader meets them all.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = ["_plumbing", "models", "hub", "evaluation", "training", "convert"]  # bottom up; anything else is the top


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the mhmoe package (a package is named by its __init__)."""
    found = {}
    for path in sorted((SRC / "mhmoe").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mhmoe modules that `name` imports (each `from x import y` counts as x.y when that is a module, else x)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{target}.{alias.name}" for alias in node.names] + [target]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
                break
    return found


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else None
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read_right():
    """The reader sees the arrows that exist (relative, absolute, deferred), so the checks below can fail."""
    graph = _graph()
    assert "mhmoe.training.loop" in graph["mhmoe.training.cli"]  # from .loop import train
    assert (
        "mhmoe._plumbing.checkpoint_files" in graph["mhmoe.training.arguments"]
    )  # from .._plumbing.checkpoint_files import
    assert "mhmoe.training.peft" in graph["mhmoe.training.prepare"]  # deferred, inside build_model
    assert "mhmoe._plumbing.lazy" in graph["mhmoe.models.mhmoe"]  # a package's __init__
    assert _layer("mhmoe.models.ops.backends") < _layer("mhmoe.hub.export") < _layer("mhmoe.demo") == len(LAYERS)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_layer_above_it():
    graph = _graph()
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(source)
    )
    assert upward == [], "imports that go up a layer:\n" + "\n".join(upward)


def test_model_layer_imports_only_itself_and_plumbing():
    """The model layer (exported for trust_remote_code as it is) reaches nothing of the tool layer."""
    graph = _graph()
    outside = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if source.startswith("mhmoe.models")
        for target in targets
        if not target.startswith(("mhmoe.models", "mhmoe._plumbing"))
    )
    assert outside == []
    plumbing = sorted(
        t
        for s, ts in graph.items()
        if s.startswith("mhmoe._plumbing")
        for t in ts
        if not t.startswith("mhmoe._plumbing")
    )
    assert plumbing == [], "mhmoe._plumbing imports nothing else of mhmoe (it names the modules above as strings)"


def _defined_names(path: Path) -> set[str]:
    """Names a module defines at its top level (also inside `if` / `try` blocks, not inside functions or classes)."""
    defined = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            pending += [h for h in getattr(node, "handlers", [])]
        elif isinstance(node, ast.ExceptHandler):
            pending += node.body
    return defined


def test_every_import_of_mhmoe_names_a_module_that_exists():
    """`from .x import y` inside a function runs only when called: after a module moves (issue #30), a stale one
    fails at run time only (checkpoint_files.py's `from .trust import ...` broke every conversion). Each `from`
    import of mhmoe names an existing module, and `y` is a module or a name defined there."""
    modules = _modules()
    stale = []
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("mhmoe")):
                continue
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target not in modules:
                stale.append(f"{name}:{node.lineno} from {target}")
                continue
            defined = _defined_names(modules[target])
            lazy = "__getattr__" in defined  # a package exporting its names lazily (PEP 562)
            for alias in node.names:
                if alias.name != "*" and alias.name not in defined and f"{target}.{alias.name}" not in modules:
                    if not lazy:
                        stale.append(f"{name}:{node.lineno} from {target} import {alias.name}")
    assert stale == [], "imports of what does not exist:\n" + "\n".join(stale)


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


# Every module in a fresh interpreter: one parent imports the third-party packages once (torch, transformers, ...),
# then forks a child per module, so that each mhmoe module is the first one imported in its process.
_FORK_EACH = r"""
import importlib, json, os, sys, traceback
import torch, transformers, transformers.modeling_utils, safetensors, accelerate, peft, lm_eval, matplotlib  # noqa
torch.set_num_threads(1)
assert not [m for m in sys.modules if m == "mhmoe" or m.startswith("mhmoe.")]
failures = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = ""
        except BaseException:
            message = traceback.format_exc(limit=3)
        os.write(write, message.encode()[-4000:])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    if message:
        failures[name] = message
print(json.dumps(failures))
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    names = [name for name in _modules() if not name.endswith("__main__")]  # those run a command
    env = {
        "PYTHONPATH": str(SRC),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRITON_INTERPRET": "1",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, json.dumps(names)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n\n".join(f"{name}:\n{message}" for name, message in failures.items())
    assert len(names) > 60  # every module was tried, not a subset
