"""Fault injection: the classes of hostile or careless input replayed against the installed console scripts.

    python -m tests.fault_injection [--quick] [--only CLASS ...] [-k TEXT] [--jobs N] [--keep]
                                    [--out benchmarks/results/fault_injection.md]

Not a pytest file (tests/test_fault_injection.py keeps it from rotting). It builds its inputs in a temporary folder as
the tests do (a tiny dense Llama with the tests' BPE tokenizer, its MoH conversion, a 2-step training run with a
checkpoint at each step), then runs each probe as a real console script (`mhmoe-train`, `mhmoe-convert`,
`mhmoe-export`, `mhmoe-eval` next to this interpreter) in a subprocess and classifies what came out: the exit status,
a Python traceback on stderr or not, the command's own lines on stderr (exactly one, `COMMAND: error: ...` or
`COMMAND: interrupted; ...`, is what a refusal should be), anything partial left behind (a hidden temporary folder
next to the output or inside a training run, an output folder that is not complete), a secret's bytes in any output,
and for damaged checkpoints whether the run fell back to the older checkpoint or refused the one it was given.

Classes:
  links         tokenizer.json as a link out of the input folder (to a secret file, to a Hub-cache
                lookalike `models--evil--repo/blobs/abcd`, another repo's blob in the cache): refused in one line,
                status 2, the secret nowhere; a real Hub-cache snapshot (HF_HUB_CACHE) is read.
  damage        the newest checkpoint of a stopped run damaged (a flipped byte, truncated or empty weights, no
                manifest, a bad state file, no or a hostile RNG pickle): `latest` falls back to the older checkpoint,
                naming the one it skipped, and finishes; named explicitly it is refused in one line.
  broken files  tokenizer.json truncated, binary, `{}`, empty, nested 100000 deep, of another shape; no tokenizer.json
                beside tokenizer_config.json; rope_scaling with factor 0: one line, status 2 (or 1), no traceback.
  interrupts    SIGINT inside `import torch`, after 2 s, after 6 s: status 130 and one line `COMMAND: interrupted;
                ...` (or status 0 when the command finished first), nothing half-written.
  disk full     a small tmpfs (a private mount namespace, `unshare -rm`) and `ulimit -f`: status 1, one line (`not
                enough disk space` / `a file grew past the largest file allowed`), nothing half-written.

The exit status is 0 only when every probe behaved as expected.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tests._plumbing.test_trust import _hub_snapshot  # the Hub cache's layout, as the link tests build it
from tests.fixtures.warm import NO_BYTECODE_UNDER_FSIZE
from tests.test_cli_faults import BROKEN_TOKENIZERS, _maps_torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("mhmoe-train", "mhmoe-convert", "mhmoe-export", "mhmoe-eval")
CLASSES = ("links", "damage", "broken files", "interrupts", "disk full")
SECRET = "SECRET_fault_injection_7c41e9"  # planted in every file a link points at; must reach no output
TIMEOUT_S = 300
HOW = {  # a sentence under each class's table in the report
    "links": "Each input is a copy of the tiny MoH conversion (the dense Llama for mhmoe-convert) whose tokenizer.json "
    "is a link; the files linked to hold the secret (the blobs: a tokenizer.json that loads, the secret among its tokens), "
    "searched for in stdout, stderr and every file written. The cache probes set HF_HUB_CACHE to a cache built in $T.",
    "damage": "Each run is a copy of a finished 2-step run (checkpoint-1, checkpoint-2) stopped before its final save "
    "(train_summary.json and model.safetensors removed), checkpoint-2 damaged; the same command resumed with "
    "`--resume_from_checkpoint latest` or the damaged checkpoint named. The hostile pickle would create a marker file.",
    "broken files": "Each input is a copy of the tiny MoH conversion with the one file broken.",
    "interrupts": "SIGINT from outside (the child with SIGINT at its default), at the moment named; `inside import "
    "torch`: as soon as /proc/PID/maps shows libtorch. mhmoe-train runs with --max_steps 100000.",
    "disk full": "tmpfs: the command writes $MNT/out on a tmpfs in a private mount namespace (`unshare -rm`), with "
    "part of it taken by a filler file while it runs; what is left there is copied out and inspected. ulimit: "
    "RLIMIT_FSIZE set in the child.",
}


def script(command: str) -> str:
    """The installed console script (the one `pip install` puts next to the interpreter)."""
    return os.path.join(os.path.dirname(sys.executable), command)


# ------------------------------------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """What a probe's command did."""

    argv: list[str]
    status: int | None  # None: timed out (killed)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    leftovers: list[str] = field(default_factory=list)  # partial outputs left behind
    secret_in: list[str] = field(default_factory=list)  # where the secret's bytes were found
    notes: list[str] = field(default_factory=list)  # facts a probe adds (a checkpoint it fell back to, ...)
    skipped: str = ""  # why the probe could not run here


@dataclass
class Facts:
    """An outcome classified."""

    status: int | None
    traceback: bool
    own_lines: list[str]  # stderr lines starting with `COMMAND: `
    kind: str  # "error", "interrupted", "" (no single own line of either kind)

    @property
    def one_line(self) -> bool:
        return len(self.own_lines) == 1 and self.kind != ""


def classify(command: str, status: int | None, stderr: str) -> Facts:
    """The exit status, a Python traceback on stderr or not, and the command's own lines (`COMMAND: ...`; other lines,
    such as a library's progress bar, are not the command's words)."""
    own = [line for line in stderr.splitlines() if line.startswith(f"{command}: ")]
    kind = ""
    if len(own) == 1:
        if own[0].startswith(f"{command}: error: "):
            kind = "error"
        elif own[0].startswith(f"{command}: interrupted; "):
            kind = "interrupted"
    return Facts(status, "Traceback (most recent call last)" in stderr, own, kind)


@dataclass
class Expect:
    """What a probe should end with. `status`: the accepted exit statuses; `line`: the one own line's kind ("error",
    "interrupted") with `words` in it, or "" when the command succeeds; `stderr_has`: texts stderr must hold."""

    label: str
    status: tuple[int, ...]
    line: str = ""
    words: tuple[str, ...] = ()
    stderr_has: tuple[str, ...] = ()
    finished_ok: bool = False  # (interrupts) status 0, the command finished before the signal: accepted


REFUSED = Expect("refused: status 2, one line", (2,), "error")
REFUSED_1_OR_2 = Expect("refused: status 2 (or 1), one line", (2, 1), "error")
SUCCEEDS = Expect("succeeds: status 0", (0,))
INTERRUPTED = Expect("status 130, one line `interrupted;`", (130,), "interrupted", finished_ok=True)
DISK_FULL = Expect("status 1, one line: not enough disk space", (1,), "error", ("not enough disk space",))
FILE_TOO_BIG = Expect(
    "status 1, one line: a file grew past the largest file allowed",
    (1,),
    "error",
    ("a file grew past the largest file allowed",),
)


def _short(line: str, most: int = 400) -> str:
    return line if len(line) <= most else line[: most - 3] + "..."


def judge(command: str, expect: Expect, outcome: Outcome) -> tuple[bool, str]:
    """(as expected, what was observed in words)."""
    if outcome.skipped:
        return True, f"skipped: {outcome.skipped}"
    facts = classify(command, outcome.status, outcome.stderr)
    problems = []
    if outcome.status is None:
        problems.append(f"timed out after {TIMEOUT_S} s")
    finished_first = expect.finished_ok and facts.status == 0
    if not finished_first and facts.status not in expect.status:
        problems.append(f"status {facts.status}")
    if facts.traceback:
        problems.append("traceback")
    if expect.line and not finished_first:
        if not facts.one_line or facts.kind != expect.line:
            problems.append(f"{len(facts.own_lines)} own lines" if len(facts.own_lines) != 1 else "not that line")
        elif not all(w in facts.own_lines[0] for w in expect.words):
            problems.append("other words")
    if expect.label.startswith("succeeds") or finished_first:
        errors = [line for line in facts.own_lines if ": error: " in line]
        if errors:
            problems.append("an error line")
    for text in expect.stderr_has:
        if text not in outcome.stderr:
            problems.append(f"stderr lacks {text!r}")
    if outcome.leftovers:
        problems.append("partial output: " + ", ".join(outcome.leftovers[:3]))
    if outcome.secret_in:
        problems.append("secret in " + ", ".join(outcome.secret_in[:3]))
    said = facts.own_lines[0] if len(facts.own_lines) == 1 else ""
    if len(facts.own_lines) > 1:
        said = f"{len(facts.own_lines)} lines: " + " / ".join(_short(line) for line in facts.own_lines)
    if not facts.own_lines and facts.traceback:
        said = "last stderr line: " + (outcome.stderr.strip().splitlines() or [""])[-1]
    observed = f"status {facts.status}" + (" (finished before the signal)" if finished_first else "")
    observed += "; traceback" if facts.traceback else ""
    observed += f"; {said}" if said else ""
    observed += "".join(f"; {note}" for note in outcome.notes)
    if problems:
        observed += " — **" + "; ".join(problems) + "**"
    observed += f" ({outcome.seconds:.0f} s)"
    return not problems, observed


# ---------------------------------------------------------------------------------------------- partial outputs


def leftovers(command: str, out: Path, work: Path, before: set[str] | None = None) -> list[str]:
    """What is half-written after a command that wrote (or would have written) `out`, inside the probe's own folder
    `work`: a hidden entry next to `out` (a temporary folder), and by command: a conversion or export folder without
    a config and weights that read; a training run's hidden `.checkpoint-N.tmp` or new checkpoint without a manifest;
    an evaluation's results file that is not JSON. `before`: the training run's entries that were there already."""
    found = [p.name for p in sorted(work.iterdir()) if p.name.startswith(".")]
    if not out.is_dir():
        return found
    if command in ("mhmoe-convert", "mhmoe-export"):
        if not _complete_model_folder(out):
            found.append(f"{out.name}/ incomplete ({', '.join(sorted(os.listdir(out))[:6])})")
    elif command == "mhmoe-train":
        for entry in sorted(out.iterdir()):
            if entry.name in (before or set()):
                continue
            if entry.name.startswith(".") and entry.name != ".mhmoe-train.lock":
                found.append(f"{out.name}/{entry.name}")
            elif entry.name.startswith("checkpoint-") and not (entry / "manifest.json").is_file():
                found.append(f"{out.name}/{entry.name} without manifest.json")
    elif command == "mhmoe-eval":
        for path in sorted(out.rglob("*")):
            if path.name.startswith("."):
                found.append(str(path.relative_to(work)))
            elif path.suffix == ".json":
                try:
                    json.loads(path.read_text())
                except (ValueError, UnicodeDecodeError):
                    found.append(f"{path.relative_to(work)} not JSON")
    return found


def _complete_model_folder(folder: Path) -> bool:
    from safetensors import safe_open

    try:
        json.loads((folder / "config.json").read_text())
        weights = sorted(folder.glob("*.safetensors"))
        for path in weights:
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        return bool(weights)
    except Exception:
        return False


def secret_places(outcome: Outcome, roots: list[Path]) -> list[str]:
    """Where SECRET's bytes are: the command's stdout or stderr, or any file under `roots` (a link not followed)."""
    places = [name for name, text in (("stdout", outcome.stdout), ("stderr", outcome.stderr)) if SECRET in text]
    needle = SECRET.encode()
    for root in roots:
        if not root.exists():
            continue
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    if needle in path.read_bytes():
                        places.append(str(path.name))
                except OSError:
                    pass
    return places


# ------------------------------------------------------------------------------------------------------- inputs


def subprocess_env(**extra: str) -> dict:
    from tests.convert.test_outputs import _env

    return _env(PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", **extra)


def run_command(
    command: str,
    argv: list[str],
    env: dict | None = None,
    fsize: int | None = None,
    interrupt: Callable[[subprocess.Popen], None] | None = None,
) -> Outcome:
    """Run the console script `command` (SIGINT at its default in the child: an ignored SIGINT is inherited through
    exec); `fsize`: RLIMIT_FSIZE (`ulimit -f`) in bytes; `interrupt(proc)` is called once it has started."""

    def preexec():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    full = [script(command), *argv]
    start = time.monotonic()
    proc = subprocess.Popen(
        full,
        env={**(env or subprocess_env()), **(NO_BYTECODE_UNDER_FSIZE if fsize is not None else {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        preexec_fn=preexec,
    )
    if interrupt is not None:
        threading.Thread(target=interrupt, args=(proc,), daemon=True).start()
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        status = None
    return Outcome(full, status, stdout, stderr, time.monotonic() - start)


def _write_jsonl(path: Path, texts: list[str]) -> str:
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


class Inputs:
    """The probes' shared inputs, built on first use under `root`: the corpus and tokenizer (as tests/fixtures/
    training.py builds them), a tiny dense Llama (tests/convert/test_convert.py's `_llama_dir`), its MoH conversion,
    and a finished 2-step training run with checkpoint-1 and checkpoint-2."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.RLock()
        self._built: dict[str, object] = {}

    def _once(self, name: str, build: Callable[[], object]):
        with self._lock:
            if name not in self._built:
                self._built[name] = build()
            return self._built[name]

    @property
    def corpus(self) -> dict:
        def build():
            from tests.fixtures.training import _topics

            folder = self.root / "corpus"
            folder.mkdir()
            texts = [t[:600] for t in _topics()[:40]]
            (folder / "train.txt").write_text("\n".join(texts[:10]))
            return {
                "val": _write_jsonl(folder / "val.jsonl", texts[30:33]),
                "tokenizer_text": _write_jsonl(folder / "tok.jsonl", texts),
                "txt": str(folder / "train.txt"),
            }

        return self._once("corpus", build)

    @property
    def tokenizer(self) -> Path:
        def build():
            from mhmoe.training.data import read_files, train_tokenizer
            from tests.fixtures.training import CONFIG

            folder = self.root / "tokenizer"
            tokenizer = train_tokenizer(
                read_files([self.corpus["tokenizer_text"]]), 300, CONFIG["max_position_embeddings"]
            )
            tokenizer.save_pretrained(folder)
            return folder

        return self._once("tokenizer", build)

    @property
    def llama(self) -> Path:
        def build():
            from tests.convert.test_convert import _llama_dir

            return _llama_dir(self.root / "llama", str(self.tokenizer))

        return self._once("llama", build)

    @property
    def moh(self) -> Path:
        def build():
            from mhmoe.convert import convert

            convert(str(self.llama), str(self.root / "moh"), verify_logits=False, progress=False, recipe="paper")
            return self.root / "moh"

        return self._once("moh", build)

    @property
    def run(self) -> Path:
        """A finished mhmoe-train run: checkpoint-1, checkpoint-2 and the final model."""

        def build():
            out = self.root / "run"
            outcome = run_command("mhmoe-train", self.train_argv(self.moh, out))
            if outcome.status != 0 or not (out / "checkpoint-2" / "manifest.json").is_file():
                raise RuntimeError(f"the training run for the damage probes failed:\n{outcome.stderr[-3000:]}")
            return out

        return self._once("run", build)

    def train_argv(self, model: Path, out: Path, max_steps: int = 2) -> list[str]:
        return [
            "--model_name_or_path",
            str(model),
            "--train_file",
            self.corpus["txt"],
            "--output_dir",
            str(out),
            "--max_steps",
            str(max_steps),
            "--save_steps",
            "1",
            "--block_size",
            "16",
            "--seed",
            "0",
            "--disable_tqdm",
            "--no_plot",
        ]

    def argv(self, command: str, model: Path, out: Path | str) -> list[str]:
        """`command` reading the model folder `model` and writing `out` (mhmoe-eval: its results)."""
        if command == "mhmoe-train":
            return self.train_argv(model, Path(out))
        if command == "mhmoe-convert":
            argv = ["--input_dir", str(model), "--output_dir", str(out), "--skip_logit_check", "--recipe", "paper"]
            return [*argv, "--disable_tqdm"]
        if command == "mhmoe-export":
            return [str(model), str(out)]
        return [
            "--model_args",
            f"pretrained={model}",
            "--tasks",
            "mhmoe_ppl_wikipedia",
            "--metadata",
            json.dumps({"wikipedia_path": self.corpus["val"]}),
            "--limit",
            "1",
            "--output_path",
            str(out),
        ]

    def source(self, command: str) -> Path:
        """The folder `command` reads: the dense Llama for mhmoe-convert, the MoH conversion otherwise."""
        return self.llama if command == "mhmoe-convert" else self.moh


# -------------------------------------------------------------------------------------------------------- probes


@dataclass
class Probe:
    cls: str
    name: str
    command: str
    expect: Expect
    act: Callable[[Inputs, Path, str], Outcome]  # (inputs, the probe's own empty folder, command) -> outcome
    quick: bool = False  # run in --quick mode (one per class)


def _copy_input(inputs: Inputs, command: str, work: Path) -> Path:
    folder = work.parent / f"{work.name}-in"  # beside the probe's folder: `work` holds only what the command writes
    shutil.copytree(inputs.source(command), folder)
    return folder


def _ordinary(inputs: Inputs, command: str, model: Path, work: Path, env: dict | None = None) -> Outcome:
    """Run `command` on `model` writing work/out; the leftovers and the secret's places filled in."""
    out = work / "out"
    outcome = run_command(command, inputs.argv(command, model, out), env=env)
    outcome.leftovers = leftovers(command, out, work)
    outcome.secret_in = secret_places(outcome, [work])
    if outcome.status == 0 and command != "mhmoe-eval" and not _complete_model_folder(out):
        outcome.leftovers.append("out/ not a complete model folder")
    if outcome.status == 0 and command == "mhmoe-eval" and not list(out.rglob("results*.json")):
        outcome.leftovers.append("no results file")
    return outcome


# links ----------------------------------------------------------------------------------------------------------


def _loadable_secret(tokenizer_json: Path) -> bytes:
    """A tokenizer.json that loads, with SECRET among its tokens: were it followed, the secret reaches the output."""
    data = json.loads(tokenizer_json.read_text())
    data["model"]["vocab"][SECRET] = len(data["model"]["vocab"])
    return json.dumps(data).encode()


def _link_probe(kind: str):
    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        env = None
        outside = work.parent / f"{work.name}-outside"
        outside.mkdir()
        if kind == "legit cache snapshot":
            cache = outside / "hub"
            model = _hub_snapshot(cache, "models--o--n", inputs.source(command))
            env = subprocess_env(HF_HUB_CACHE=str(cache))
            outcome = _ordinary(inputs, command, model, work, env)
            vocab = json.loads((inputs.source(command) / "tokenizer.json").read_text())["model"]["vocab"]
            if outcome.status == 0 and command != "mhmoe-eval":
                got = json.loads((work / "out" / "tokenizer.json").read_text())["model"]["vocab"]
                outcome.notes.append("tokenizer copied as it is" if got == vocab else "tokenizer changed")
            return outcome
        if kind == "another repo's blob in the cache":
            cache = outside / "hub"
            model = _hub_snapshot(cache, "models--o--n", inputs.source(command))
            env = subprocess_env(HF_HUB_CACHE=str(cache))
            target = cache / "models--evil--repo" / "blobs" / "abcd"
            link = model / "tokenizer.json"
        else:
            model = _copy_input(inputs, command, work)
            link = model / "tokenizer.json"
            if kind == "lookalike models--evil--repo/blobs":
                target = outside / "models--evil--repo" / "blobs" / "abcd"
            else:
                target = outside / "etc" / "hostname"
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.name == "abcd":
            target.write_bytes(_loadable_secret(inputs.source(command) / "tokenizer.json"))
        else:
            target.write_text(f"{SECRET}\n")
        link.unlink(missing_ok=True)
        os.symlink(target, link)
        return _ordinary(inputs, command, model, work, env)

    return act


LINK_KINDS = (  # (another repo's blob: export and train only, for time)
    "tokenizer.json to a secret file",
    "lookalike models--evil--repo/blobs",
    "another repo's blob in the cache",
    "legit cache snapshot",
)


# damage ---------------------------------------------------------------------------------------------------------


class _RunsOsSystem:
    """Unpickled, runs `os.system(touch MARKER)`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def _flip(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES: dict[str, Callable[[Path, Path], None]] = {  # (checkpoint, marker) -> damage done to it
    "flipped byte in model.safetensors": lambda c, m: _flip(c / "model.safetensors"),
    "truncated model.safetensors": lambda c, m: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:999]
    ),
    "empty model.safetensors": lambda c, m: (c / "model.safetensors").write_bytes(b""),
    "manifest.json deleted": lambda c, m: (c / "manifest.json").unlink(),
    "manifest.json deleted + flipped byte": lambda c, m: (
        (c / "manifest.json").unlink(),
        _flip(c / "model.safetensors"),
    ),
    "train_state.json corrupt": lambda c, m: (c / "train_state.json").write_text('{"step": 2, "epoch'),
    "random_states_0.pkl deleted": lambda c, m: (c / "random_states_0.pkl").unlink(),
    "random_states_0.pkl a pickle running os.system": lambda c, m: (c / "random_states_0.pkl").write_bytes(
        pickle.dumps(_RunsOsSystem(m))
    ),
}


def _damage_probe(damage: str, how: str):
    """`how`: "latest" (falls back to checkpoint-1 and finishes), "named" (refused), "all damaged, latest" (both
    checkpoints damaged: refused)."""

    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        out = work / "out"
        shutil.copytree(inputs.run, out)
        (out / "train_summary.json").unlink()  # stopped after its last checkpoint, before the final save
        (out / "model.safetensors").unlink()
        marker = work.parent / f"{work.name}-PICKLE_RAN"
        DAMAGES[damage](out / "checkpoint-2", marker)
        if how.startswith("all damaged"):
            DAMAGES[damage](out / "checkpoint-1", marker)
        before = {p.name for p in out.iterdir()}
        resume = str(out / "checkpoint-2") if how == "named" else "latest"
        argv = [*inputs.train_argv(inputs.moh, out), "--resume_from_checkpoint", resume]
        outcome = run_command("mhmoe-train", argv)
        rewritten = {"checkpoint-2"} if how == "latest" else set()  # saved again by a run that fell back
        outcome.leftovers = leftovers("mhmoe-train", out, work, before - rewritten)
        if marker.exists():
            outcome.notes.append("THE PICKLE RAN")
            outcome.leftovers.append("the pickle's marker file")
        skipped = f"skipping {out / 'checkpoint-2'}" in outcome.stderr
        fell_back = f"resuming from {out / 'checkpoint-1'}" in outcome.stderr
        if how == "latest":
            outcome.notes.append("named the skipped checkpoint-2" if skipped else "did not name checkpoint-2")
            outcome.notes.append("resumed from checkpoint-1" if fell_back else "did not resume from checkpoint-1")
            finished = (out / "train_summary.json").is_file() and _complete_model_folder(out)
            outcome.notes.append("finished" if finished else "not finished")
            if not (skipped and fell_back and finished):
                outcome.leftovers.append("no fallback to checkpoint-1")
        elif outcome.status == 0 or fell_back:
            outcome.leftovers.append("trained on the damaged checkpoint")
        return outcome

    return act


FALLS_BACK = Expect("falls back to checkpoint-1, names checkpoint-2, finishes (status 0)", (0,))
REFUSED_BY_NAME = Expect("refused: status 2, one line", (2,), "error", ("checkpoint-2",))


# broken files ---------------------------------------------------------------------------------------------------


def _set_rope_factor_zero(folder: Path) -> None:
    """config.json as a Llama-2-era file says it: rope_theta at the top, rope_scaling {"rope_type": "linear",
    "factor": 0}."""
    config = json.loads((folder / "config.json").read_text())
    parameters = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_scaling"] = {"rope_type": "linear", "factor": 0}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# the tokenizer cases of tests/test_cli_faults.py (one table for both), and a RoPE factor that trains to NaN
BROKEN: dict[str, Callable[[Path], None]] = {
    **{f"tokenizer {name}": breaks for name, breaks in BROKEN_TOKENIZERS.items()},
    "rope_scaling linear, factor 0": _set_rope_factor_zero,
}


def _broken_probe(broken: str):
    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        model = _copy_input(inputs, command, work)
        BROKEN[broken](model)
        return _ordinary(inputs, command, model, work)

    return act


# interrupts -----------------------------------------------------------------------------------------------------


def _interrupt_probe(moment: str):
    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        out = work / "out"
        argv = inputs.argv(command, inputs.source(command), out)
        if command == "mhmoe-train":
            argv[argv.index("--max_steps") + 1] = "100000"  # still training when the signal comes
        sent: list[str] = []

        def interrupt(proc: subprocess.Popen) -> None:
            start = time.monotonic()
            if moment == "inside import torch":
                while not _maps_torch(proc.pid) and proc.poll() is None and time.monotonic() - start < 120:
                    time.sleep(0.002)
            elif moment == "after the first checkpoint":
                while not list(out.glob("checkpoint-*")) and proc.poll() is None and time.monotonic() - start < 240:
                    time.sleep(0.01)
            else:
                time.sleep(float(moment.split()[1]))
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                sent.append(f"SIGINT at {time.monotonic() - start:.1f} s")

        outcome = run_command(command, argv, interrupt=interrupt)
        outcome.notes.extend(sent or ["no signal sent"])
        outcome.leftovers = leftovers(command, out, work)
        return outcome

    return act


INTERRUPT_MOMENTS = ("inside import torch", "after 2 s", "after 6 s")  # (and mhmoe-train after its first checkpoint)


# disk full ------------------------------------------------------------------------------------------------------


def _namespaces() -> str:
    """ "" when `unshare -rm` can mount a tmpfs here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare"
    mnt = tempfile.mkdtemp(prefix="fault-ns-")
    try:
        probe = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{mnt}"']
        if subprocess.run(probe, capture_output=True).returncode != 0:
            return "unshare -rm cannot mount a tmpfs here (no unprivileged user/mount namespaces)"
    finally:
        os.rmdir(mnt)
    return ""


_NAMESPACES: list[str] = []


def _tmpfs_probe(size: str, filler: int):
    """The command writing $MNT/out on a tmpfs of `size`, `filler` bytes of it taken while it runs; what is on the
    tmpfs afterwards is copied out to be inspected."""

    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        from tests.convert.test_outputs import _in_private_mount

        if not _NAMESPACES:
            _NAMESPACES.append(_namespaces())
        if _NAMESPACES[0]:
            return Outcome([command], None, skipped=_NAMESPACES[0])
        argv = inputs.argv(command, inputs.source(command), "MNT_OUT")
        words = " ".join(shlex.quote(a).replace("MNT_OUT", '"$MNT/out"') for a in argv)
        copy = work.parent / f"{work.name}-mnt"
        copy.mkdir()
        shell = (
            (f'head -c {filler} /dev/zero > "$MNT/filler"; ' if filler else "")
            + f'start=$(date +%s.%N); {shlex.quote(script(command))} {words} > "{copy}.out" 2> "{copy}.err"; '
            + 'echo "status $?"; echo "start $start"; echo "end $(date +%s.%N)"; '
            + f'rm -f "$MNT/filler"; cp -a "$MNT"/. "{copy}/"'
        )
        proc = _in_private_mount(shell, work.parent / f"{work.name}-ns", size, read_only=False)
        said = dict(
            line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0] in ("status", "start", "end")
        )
        outcome = Outcome(
            [script(command), *[a.replace("MNT_OUT", f"$MNT/out (tmpfs {size})") for a in argv]],
            int(said["status"]) if "status" in said else None,
            Path(f"{copy}.out").read_text(errors="replace") if Path(f"{copy}.out").exists() else "",
            Path(f"{copy}.err").read_text(errors="replace") if Path(f"{copy}.err").exists() else proc.stderr,
            float(said["end"]) - float(said["start"]) if "end" in said else 0.0,
        )
        outcome.leftovers = leftovers(command, copy / "out", copy)
        return outcome

    return act


def _fsize_probe(limit: int):
    def act(inputs: Inputs, work: Path, command: str) -> Outcome:
        out = work / "out"
        outcome = run_command(command, inputs.argv(command, inputs.source(command), out), fsize=limit)
        outcome.leftovers = leftovers(command, out, work)
        return outcome

    return act


def probes() -> list[Probe]:
    """Every probe, in the order of CLASSES; one of each class is marked for --quick."""
    table = []
    for kind in LINK_KINDS:
        for command in ("mhmoe-export", "mhmoe-train", "mhmoe-convert", "mhmoe-eval")[: 2 if "another" in kind else 4]:
            expect = SUCCEEDS if kind == "legit cache snapshot" else REFUSED
            quick = (kind, command) == ("tokenizer.json to a secret file", "mhmoe-export")
            table.append(Probe("links", kind, command, expect, _link_probe(kind), quick))
    for damage in DAMAGES:
        for how in ("latest", "named"):
            expect = FALLS_BACK if how == "latest" else REFUSED_BY_NAME
            quick = (damage, how) == ("flipped byte in model.safetensors", "named")
            table.append(Probe("damage", f"{damage}, {how}", "mhmoe-train", expect, _damage_probe(damage, how), quick))
    table.append(
        Probe(
            "damage",
            "flipped byte in both checkpoints, latest",
            "mhmoe-train",
            Expect("refused: status 2, one line (no checkpoint verifies)", (2,), "error", ("no complete checkpoint",)),
            _damage_probe("flipped byte in model.safetensors", "all damaged, latest"),
        )
    )
    for broken in BROKEN:
        for command in ("mhmoe-export", "mhmoe-eval", "mhmoe-train"):
            quick = (broken, command) == ("tokenizer truncated", "mhmoe-export")
            table.append(Probe("broken files", broken, command, REFUSED_1_OR_2, _broken_probe(broken), quick))
    for moment in INTERRUPT_MOMENTS:
        for command in COMMANDS:
            quick = (moment, command) == ("inside import torch", "mhmoe-export")
            table.append(Probe("interrupts", f"SIGINT {moment}", command, INTERRUPTED, _interrupt_probe(moment), quick))
    resume = Expect(
        "status 130, one line `interrupted;` naming `--resume_from_checkpoint latest`",
        (130,),
        "interrupted",
        ("--resume_from_checkpoint latest",),
    )
    moment = "after the first checkpoint"
    table.append(Probe("interrupts", f"SIGINT {moment}", "mhmoe-train", resume, _interrupt_probe(moment)))
    for command in COMMANDS:
        table.append(Probe("disk full", "tmpfs 16k, 12k taken", command, DISK_FULL, _tmpfs_probe("16k", 12288)))
        size, filler = ("16k", 8192) if command == "mhmoe-eval" else ("96k", 0)  # (its results: 11 KB)
        name = f"tmpfs {size}" + (f", {filler // 1024}k taken" if filler else "") + ": part of the output fits"
        table.append(Probe("disk full", name, command, DISK_FULL, _tmpfs_probe(size, filler)))
        quick = command == "mhmoe-export"
        table.append(Probe("disk full", "ulimit -f 2 KB", command, FILE_TOO_BIG, _fsize_probe(2048), quick))
    return table


# ------------------------------------------------------------------------------------------------------- running


@dataclass
class Result:
    probe: Probe
    outcome: Outcome
    ok: bool
    observed: str


def run_probe(probe: Probe, inputs: Inputs, index: int) -> Result:
    work = inputs.root / f"p{index:02d}"  # (its input copy: p{index}-in, the files links point at: p{index}-outside)
    work.mkdir()
    try:
        outcome = probe.act(inputs, work, probe.command)
    except Exception as e:  # the probe's own setup failed: a failure of this script, reported as such
        outcome = Outcome([probe.command], None, stderr=f"probe setup failed: {type(e).__name__}: {e}")
        return Result(probe, outcome, False, f"**the probe itself failed: {type(e).__name__}: {e}**")
    ok, observed = judge(probe.command, probe.expect, outcome)
    return Result(probe, outcome, ok, observed.replace(str(inputs.root), "$T"))


def _shown(argv: list[str], root: Path) -> str:
    words = [os.path.basename(argv[0]), *argv[1:]]
    return " ".join(shlex.quote(w) for w in words).replace(str(root), "$T").replace(str(REPO), ".")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def report(results: list[Result], root: Path, argv: list[str], seconds: float) -> tuple[str, str]:
    """(the whole markdown report, the summary table)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no").splitlines()
    untracked = _git("status", "--porcelain").count("?? ")
    tree = f"dirty: {len(changed)} tracked files changed, {untracked} untracked" if changed or untracked else "clean"
    summary = ["| class | probes | as expected |", "|---|---:|---:|"]
    for cls in CLASSES:
        mine = [r for r in results if r.probe.cls == cls]
        if mine:
            summary.append(f"| {cls} | {len(mine)} | {sum(r.ok for r in mine)} |")
    summary.append(f"| **all** | {len(results)} | {sum(r.ok for r in results)} |")
    lines = [
        "# Fault injection: hostile and careless input against the console scripts",
        "",
        f"- command: `{' '.join(['python', '-m', 'tests.fault_injection', *map(shlex.quote, argv)])}`",
        f"- commit: `{commit}` ({tree})",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- wall time: {seconds / 60:.1f} min; `$T` is the run's temporary folder",
        "",
        "## Summary",
        "",
        *summary,
        "",
    ]
    failed = [f"- FAIL: {r.probe.cls} / {_cell(r.probe.name)} / {r.probe.command}" for r in results if not r.ok]
    lines += [*failed, ""] if failed else []
    for cls in CLASSES:
        mine = [r for r in results if r.probe.cls == cls]
        if not mine:
            continue
        lines += [f"## {cls}", "", "| probe | command | expected | observed | pass |", "|---|---|---|---|---|"]
        for r in mine:
            command = _shown(r.outcome.argv, root)
            lines.append(
                f"| {_cell(r.probe.name)} | `{_cell(command)}` | {_cell(r.probe.expect.label)} | "
                f"{_cell(r.observed)} | {'pass' if r.ok else '**FAIL**'} |"
            )
        lines += ["", HOW[cls], ""]
    return "\n".join(lines), "\n".join(summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_injection", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one probe per class")
    parser.add_argument("--only", nargs="+", choices=CLASSES, metavar="CLASS", help=f"these classes: {CLASSES}")
    parser.add_argument("-k", dest="match", help="only the probes whose `class / name / command` holds this text")
    parser.add_argument("--jobs", type=int, default=2, help="probes run at once (default 2)")
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv

    selected = [
        p
        for p in probes()
        if (p.quick or not args.quick)
        and (not args.only or p.cls in args.only)
        and (not args.match or args.match in f"{p.cls} / {p.name} / {p.command}")
    ]
    root = Path(tempfile.mkdtemp(prefix="mhmoe-faults-")).resolve()
    inputs = Inputs(root)
    start = time.monotonic()
    print(f"{len(selected)} probes; inputs under {root}", file=sys.stderr, flush=True)
    try:
        inputs.moh  # noqa: B018 (built before the probes run at once)
        if any(p.cls == "damage" for p in selected):
            inputs.run  # noqa: B018
        print(f"inputs built in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        results: list[Result | None] = [None] * len(selected)

        def one(i: int) -> None:
            results[i] = run_probe(selected[i], inputs, i)
            r = results[i]
            print(
                f"[{sum(x is not None for x in results)}/{len(selected)}] {'pass' if r.ok else 'FAIL'} "
                f"{r.probe.cls} / {r.probe.name} / {r.probe.command}: {r.observed}",
                file=sys.stderr,
                flush=True,
            )

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            list(pool.map(one, range(len(selected))))
        done = [r for r in results if r is not None]
        text, summary = report(done, root, given, time.monotonic() - start)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
        print(summary)
        failed = [r for r in done if not r.ok]
        for r in failed:
            print(f"FAIL {r.probe.cls} / {r.probe.name} / {r.probe.command}: {r.observed}")
        return 0 if not failed and len(done) == len(selected) else 1
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
