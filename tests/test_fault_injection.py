"""tests/fault_injection.py (the fault-injection script, not a test file) keeps working: every class has probes and
one --quick probe, its classifier and judge read outcomes right, and its --quick mode runs a real probe end to end."""

import json
import os
import shutil
from collections import Counter

import pytest

from tests import fault_injection as fi


def test_every_class_has_probes_and_one_quick_probe():
    table = fi.probes()
    counts = Counter(p.cls for p in table)
    assert set(counts) == set(fi.CLASSES) and all(n >= 3 for n in counts.values()), counts
    assert Counter(p.cls for p in table if p.quick) == Counter(fi.CLASSES)  # --quick: one of each
    assert 50 <= len(table) <= 90, len(table)  # the full run fits in 15 minutes on 2 cores
    assert len({(p.cls, p.name, p.command) for p in table}) == len(table)
    assert {p.command for p in table} <= set(fi.COMMANDS)
    for p in table:
        assert os.path.basename(fi.script(p.command)) == p.command


def test_classifier_and_judge():
    command = "mhmoe-export"
    refusal = "Writing model shards: 100%\nmhmoe-export: error: source x holds symbolic links out of the folder\n"
    facts = fi.classify(command, 2, refusal)
    assert facts.one_line and facts.kind == "error" and not facts.traceback
    assert fi.judge(command, fi.REFUSED, fi.Outcome([command], 2, stderr=refusal))[0]

    traceback = "Traceback (most recent call last):\n  File ...\nValueError: bad\n"
    facts = fi.classify(command, 1, traceback)
    assert facts.traceback and not facts.own_lines and not facts.one_line
    ok, observed = fi.judge(command, fi.REFUSED_1_OR_2, fi.Outcome([command], 1, stderr=traceback))
    assert not ok and "traceback" in observed and "ValueError: bad" in observed

    two = refusal + "mhmoe-export: error: again\n"
    assert not fi.judge(command, fi.REFUSED, fi.Outcome([command], 2, stderr=two))[0]
    assert not fi.judge(command, fi.REFUSED, fi.Outcome([command], 1, stderr=refusal))[0]  # another status
    hidden = fi.Outcome([command], 2, stderr=refusal, leftovers=[".out.tmp-x"])
    assert not fi.judge(command, fi.REFUSED, hidden)[0]
    leaked = fi.Outcome([command], 2, stderr=refusal, secret_in=["tokenizer.json"])
    assert not fi.judge(command, fi.REFUSED, leaked)[0]
    assert not fi.judge(command, fi.REFUSED, fi.Outcome([command], None, stderr=refusal))[0]  # timed out

    interrupted = "\nmhmoe-export: interrupted; nothing was written to out: run the same command again\n"
    assert fi.classify(command, 130, interrupted).kind == "interrupted"
    assert fi.judge(command, fi.INTERRUPTED, fi.Outcome([command], 130, stderr=interrupted))[0]
    assert fi.judge(command, fi.INTERRUPTED, fi.Outcome([command], 0))[0]  # finished before the signal
    assert not fi.judge(command, fi.INTERRUPTED, fi.Outcome([command], 130, stderr=traceback))[0]

    full = "mhmoe-export: error: not enough disk space to write out (No space left on device)\n"
    assert fi.judge(command, fi.DISK_FULL, fi.Outcome([command], 1, stderr=full))[0]
    assert not fi.judge(command, fi.FILE_TOO_BIG, fi.Outcome([command], 1, stderr=full))[0]  # other words


def test_leftovers_and_secret(tmp_path):
    work = tmp_path / "p00"
    out = work / "out"
    (out / "moh").mkdir(parents=True)
    (out / "moh" / "results_1.json").write_text('{"results": {')  # cut short
    assert fi.leftovers("mhmoe-eval", out, work) == ["out/moh/results_1.json not JSON"]
    (out / "moh" / "results_1.json").write_text("{}")
    assert fi.leftovers("mhmoe-eval", out, work) == []

    (work / ".out.tmp-1234").mkdir()
    assert fi.leftovers("mhmoe-export", out, work)[0] == ".out.tmp-1234"
    assert "incomplete" in fi.leftovers("mhmoe-export", out, work)[1]  # no config, no weights

    shutil.rmtree(work)
    out.mkdir(parents=True)
    (out / ".mhmoe-train.lock").write_text("1")
    (out / ".checkpoint-1.tmp").mkdir()
    (out / "checkpoint-2").mkdir()
    assert fi.leftovers("mhmoe-train", out, work) == ["out/.checkpoint-1.tmp", "out/checkpoint-2 without manifest.json"]
    assert fi.leftovers("mhmoe-train", out, work, before={".checkpoint-1.tmp", "checkpoint-2"}) == []

    (out / "tokenizer.json").write_text(json.dumps({"vocab": {fi.SECRET: 3}}))
    outcome = fi.Outcome(["mhmoe-train"], 0, stderr=f"read {fi.SECRET}")
    assert fi.secret_places(outcome, [work]) == ["stderr", "tokenizer.json"]


@pytest.mark.skipif(not os.path.isfile(fi.script("mhmoe-export")), reason="the console scripts are not installed")
def test_quick_mode_runs_a_real_probe(tmp_path, capsys):
    """--quick restricted to the links class: the inputs are built, the installed mhmoe-export refuses a tokenizer.json
    linking to a secret, and the report is written with its summary."""
    report = tmp_path / "report.md"
    status = fi.main(["--quick", "--only", "links", "--jobs", "1", "--out", str(report)])
    printed = capsys.readouterr().out
    text = report.read_text()
    assert "| links | 1 | 1 |" in printed and "| **all** | 1 | 1 |" in printed, (printed, text)
    assert status == 0, text
    assert text.startswith("# Fault injection") and "- commit: `" in text and "## links" in text
    assert "tokenizer.json to a secret file" in text and "| pass |" in text
