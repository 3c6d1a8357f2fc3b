"""The GPU window's plan on CPU: what travels (payload), what comes back (layout, provenance), and that a fresh
machine's rerun is seeded from what came back (scripts/gpu_run.sh, scripts/gpu_pack.py, benchmarks/_provenance.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))

import _provenance  # noqa: E402
import gpu_pack  # noqa: E402

MIB = 2**20


def _window_calls() -> list[dict]:
    """The two tool calls benchmarks/README.md gives for one window: command, carry list, timeout."""
    text = (REPO / "benchmarks" / "README.md").read_text()
    section = text[text.index("### One GPU window") :]
    calls = re.findall(r"^call (\d): command `([^`]+)`, carry (\[[^\]]*\]), timeout_s (\d+)", section, re.M)
    return [{"command": c, "carry": json.loads(carry), "timeout_s": int(t)} for _, c, carry, t in calls]


def test_the_two_calls_fit_the_window_and_carry_only_what_the_image_lacks():
    calls = _window_calls()
    assert [c["command"] for c in calls] == [
        "bash scripts/gpu_run.sh setup probe bench",
        "bash scripts/gpu_run.sh reproduce",
    ]
    assert [c["timeout_s"] for c in calls] == [360, 240]  # <= 6 and <= 4 minutes: >= 3 of the 15 left for starts
    assert all(c["carry"] == list(gpu_pack.CARRY) for c in calls)
    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    assert 'PACKAGES="${GPU_WHEELS_PACKAGES:-transformers}"' in script  # the one package the image lacks
    assert gpu_pack.CORPUS_SPLITS == ("train", "validation")  # the test split stays home


def test_payload_is_under_48_mib_counted_as_the_transfer_counts_it():
    """Tracked + untracked-not-ignored files + each carried path at its budget (or its real size where it exists
    here, which must be within the budget): at most 48 MiB of the tool's 64."""
    sizes = gpu_pack.payload_bytes(list(gpu_pack.CARRY))
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert sizes["tree"] == sum((REPO / n).lstat().st_size for n in listed if os.path.lexists(REPO / n))
    total = sizes["tree"]
    for name in gpu_pack.CARRY:
        budget = gpu_pack.CARRY_BUDGET_MIB[name] * MIB
        assert sizes[name] <= budget, f"{name} holds {sizes[name] / MIB:.1f} MiB, over its budget"
        total += budget
    assert total <= gpu_pack.PAYLOAD_LIMIT_MIB * MIB == 48 * MIB, f"{total / MIB:.1f} MiB"
    assert ".gpu_site" not in {Path(n).parts[0] for n in listed}  # scratch paths never travel


def test_every_scratch_path_is_git_ignored(tmp_path):
    scratch = [
        ".gpu_site/x",
        ".gpu_pack/provenance.json",
        ".gpu_wheels/a.whl",
        ".gpu_wheels.ab12/a.whl",
        "outputs/gpu_run/gpu_moe.json",
        "outputs/gpu_reproduce/cache/x",
        "data/corpus/train.jsonl",
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *scratch], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert ignored == scratch


def _tiny_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split, count in (("train", 40), ("validation", 8), ("test", 4)):
        lines = [json.dumps({"text": f"{split} document {i} " + "some words " * 20}) for i in range(count)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "manifest.json").write_text('{"source": "tiny"}\n')
    return folder


def test_pack_carries_train_and_validation_compressed_and_unpacks_them_byte_for_byte(tmp_path, monkeypatch):
    corpus = _tiny_corpus(tmp_path / "corpus")
    pack = gpu_pack.pack(corpus, tmp_path / "pack")
    assert sorted(p.name for p in (pack / "corpus").iterdir()) == [
        "manifest.json",
        "train.jsonl.xz",
        "validation.jsonl.xz",
    ]
    assert json.loads((pack / "provenance.json").read_text())["commit"] == _provenance.local_git_state()["commit"]
    assert gpu_pack.unpack(pack, tmp_path / "restored")
    for split in ("train", "validation"):
        assert (tmp_path / "restored" / f"{split}.jsonl").read_bytes() == (corpus / f"{split}.jsonl").read_bytes()
    monkeypatch.setitem(gpu_pack.CARRY_BUDGET_MIB, ".gpu_pack", 0)
    with pytest.raises(SystemExit, match="over its budget"):
        gpu_pack.pack(corpus, tmp_path / "pack")


def test_a_packed_commit_is_checked_against_the_files(tmp_path, monkeypatch):
    good, bad = "pyproject.toml", "README.md"
    record = {
        "format": _provenance.PACK_FORMAT,
        "commit": "abc1234",
        "dirty": False,
        "packed_utc": "t",
        "files": {good: _provenance.blob_hash(REPO / good), bad: "0" * 40},
    }
    path = tmp_path / "provenance.json"
    path.write_text(json.dumps(record))
    monkeypatch.setenv(_provenance.PACK_ENV, str(path))
    state = _provenance.git_state()
    assert state["commit"] == "abc1234" and state["dirty"] is True and state["tree_verified"] is False
    assert state["changed_files"] == [bad]
    record["files"].pop(bad)
    path.write_text(json.dumps(record))
    assert _provenance.git_state()["tree_verified"] is True and _provenance.git_state()["dirty"] is False
    blob = subprocess.run(["git", "hash-object", good], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert _provenance.blob_hash(REPO / good) == blob  # git's own hash, computed without git


def _device_copy(root: Path, corpus: Path) -> Path:
    """What the device tool sends: the travelling files, and the carried .gpu_pack (no .git)."""
    for name in _provenance.travelling_files():
        source = REPO / name
        if source.is_file():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    gpu_pack.pack(corpus, root / ".gpu_pack")
    return root


def _environment(**env) -> dict:
    environment = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": "", **env}
    environment.pop(_provenance.PACK_ENV, None)
    return environment


@pytest.fixture
def device_python(tmp_path):
    """The interpreter the calls run (GPU_RUN_PYTHON): a warm launcher (tests/fixtures/warm.py) whose server imported
    the device copy's mhmoe (tmp_path/device/src) under the environment gpu_run.sh exports: its dozen Python commands
    start in ~0.2 s each instead of ~10 s. A command it cannot take runs a fresh interpreter."""
    from tests.fixtures.warm import WarmServer

    device = tmp_path / "device"
    exported = {"PYTHONPATH": f"{device}/.gpu_site:{device}/src", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    server = WarmServer(_environment(**exported))
    (tmp_path / "bin").mkdir()
    yield server.executable(tmp_path / "bin")
    server.close()


def _call(root: Path, out: Path, stages: str, python: Path, **env) -> subprocess.CompletedProcess:
    environment = _environment(GPU_RUN_DRY="1", OUT=str(out), GPU_RUN_PYTHON=str(python), **env)
    return subprocess.run(
        ["bash", str(root / "scripts" / "gpu_run.sh"), *stages.split()],
        cwd=root,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _returned(out: Path) -> list[str]:
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(len(Path(f).parts) <= 2 for f in files), files  # what the tool returns
    return files


def test_dry_run_of_both_calls_returns_everything_flat_with_provenance_and_seeds_a_fresh_machine(
    tmp_path, device_python
):
    corpus = _tiny_corpus(tmp_path / "corpus")
    device = _device_copy(tmp_path / "device", corpus)
    packed = json.loads((device / ".gpu_pack" / "provenance.json").read_text())

    first = _call(
        device, tmp_path / "out1", "setup probe bench", device_python, BENCH_SECTIONS="routing", PROBE_STEPS="1"
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _returned(tmp_path / "out1") == ["gpu_moe.json", "gpu_run.log", "probe_mhmoe_table1_quick.json"]
    log = (tmp_path / "out1" / "gpu_run.log").read_text()
    assert '"tree_verified": true' in log and "gpu_pack: data/corpus from the pack" in log
    assert str(tmp_path) not in log and "$OUT/gpu_moe.json" in log  # committed as it comes: no path of the machine
    bench = json.loads((tmp_path / "out1" / "gpu_moe.json").read_text())
    probe = json.loads((tmp_path / "out1" / "probe_mhmoe_table1_quick.json").read_text())
    for record in (bench, probe):
        assert record["commit"] == packed["commit"] and record["tree_verified"] is True
        assert {"dirty", "device", "env"} <= set(record)
    assert {"torch", "transformers", "triton", "precision", "routing_backend", "kernel_fallbacks"} <= set(bench)
    assert {"versions", "mixed_precision", "routing_backend", "kernel_fallbacks"} <= set(probe)

    # call 2: seed 0 of both cells, in the order given; the bundle is the one file with the runs
    second = _call(device, tmp_path / "out2", "reproduce", device_python, CELLS="mhmoe_h3 smoe", SEEDS="0")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert _returned(tmp_path / "out2") == ["gpu_run.log", "runs_mhmoe_table1_quick.json"]
    bundle = json.loads((tmp_path / "out2" / "runs_mhmoe_table1_quick.json").read_text())
    assert sorted(r["cell"] for r in bundle["runs"]) == ["MH-MoE h=3", "SMoE"]
    log = (tmp_path / "out2" / "gpu_run.log").read_text()
    assert log.index("MH-MoE h=3 | seed 0: ppl") < log.index("SMoE | seed 0: ppl")  # the priority given
    for record in bundle["runs"]:
        prov = record["run"]["provenance"]
        assert prov["commit"] == packed["commit"] and prov["tree_verified"] is True and prov["dirty"] == packed["dirty"]
        assert {"device", "precision", "routing_backend", "kernel_fallback", "versions", "corpus", "env"} <= set(prov)

    # a fresh machine (no outputs/ left): the returned bundle, carried in .gpu_pack/seed/, is not trained again
    # (which runs a deadline starts next, seed 1 after every seed 0, test_reproduce.py checks in-process)
    # (at the same path, as a fresh machine's checkout would be: the warm server's PYTHONPATH names it)
    device.rename(tmp_path / "used")
    fresh = _device_copy(tmp_path / "device", corpus)
    assert not (fresh / "outputs").exists()
    (fresh / ".gpu_pack" / "seed").mkdir()
    shutil.copy(tmp_path / "out2" / "runs_mhmoe_table1_quick.json", fresh / ".gpu_pack" / "seed")
    third = _call(fresh, tmp_path / "out3", "reproduce", device_python, CELLS="smoe mhmoe_h3", SEEDS="0")
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    log = (tmp_path / "out3" / "gpu_run.log").read_text()
    assert "SMoE | seed 0: already in" in log and "MH-MoE h=3 | seed 0: already in" in log and "ppl" not in log
    assert str(tmp_path) not in log and "<checkout>/outputs/gpu_reproduce/runs/" in log
    again = json.loads((tmp_path / "out3" / "runs_mhmoe_table1_quick.json").read_text())
    assert sorted(json.dumps(r, sort_keys=True) for r in again["runs"]) == sorted(
        json.dumps(r, sort_keys=True) for r in bundle["runs"]
    )  # the same runs, returned again whole
