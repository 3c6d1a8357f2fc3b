"""mhmoe-convert --probe_file pointing at a binary file: one line naming the file, status 2, no traceback."""

import pytest

from mhmoe.convert.cli import main


def test_binary_probe_file_is_one_line(tmp_path, capsys):
    probe = tmp_path / "probe.bin"
    probe.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary")
    with pytest.raises(SystemExit) as exit_info:
        main(["--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out"), "--probe_file", str(probe)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.endswith(
        f": error: --probe_file {probe} is not UTF-8 text (invalid start byte at byte 0); give a text file"
    )
    assert not (tmp_path / "out").exists()
