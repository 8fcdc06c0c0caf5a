from __future__ import annotations

from posttrain.cli.main import main


def test_doctor_passes_on_this_machine(tmp_path, capsys):
    assert main(["doctor", "--storage", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS  python" in out and "PASS  torch" in out and "PASS  storage writable" in out


def test_doctor_fails_on_storage_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["doctor", "--storage", str(blocker / "store")]) == 1
    assert "FAIL  storage writable" in capsys.readouterr().out


def test_doctor_fails_cleanly_on_unreachable_server(tmp_path, capsys):
    # Port 9 on loopback (discard) is closed here: the connection is refused at once.
    assert main(["doctor", "--storage", str(tmp_path), "--server", "http://127.0.0.1:9", "--timeout", "1"]) == 1
    assert "unreachable" in capsys.readouterr().out
