"""Every ``lightning-ft`` failure a user can act on is one line on stderr with a documented exit code, no traceback."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_ft.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line(err: str, expected: str) -> None:
    assert err == expected + "\n"
    assert "Traceback" not in err


def _write_events(folder) -> None:
    """A one-attempt run in the event-log format of docs/strategy.md, written where read_events looks for it."""
    folder.mkdir(parents=True)
    lines = [
        {
            "time": 100.0,
            "run_id": "r",
            "attempt": 0,
            "rank": 0,
            "event": "attempt_start",
            "step": None,
            "world_size": 1,
        },
        {"time": 101.0, "run_id": "r", "attempt": 0, "rank": 0, "event": "first_step", "step": 1},
        {"time": 110.0, "run_id": "r", "attempt": 0, "rank": 0, "event": "progress", "step": 10, "productive_s": 8.0},
    ]
    (folder / "rank0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_inspect_of_a_missing_path_says_there_is_no_such_checkpoint(tmp_path, capsys):
    missing = tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"
    code, out, err = _run(capsys, "inspect", str(missing))
    assert code == 2
    assert out == ""  # no "checksums FAILED" table for a path that is not there
    _assert_one_line(err, f"lightning-ft inspect: error: no such checkpoint: {missing}")


def test_export_of_a_missing_path_or_into_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    code, out, err = _run(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "plain.ckpt"))
    assert (code, out) == (2, "")
    _assert_one_line(err, f"lightning-ft export: error: no such checkpoint: {tmp_path / 'nope'}")

    (tmp_path / "ckpt").mkdir()
    code, out, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "missing" / "plain.ckpt"))
    assert (code, out) == (2, "")
    _assert_one_line(err, f"lightning-ft export: error: no such folder for OUT: {tmp_path / 'missing'}")


def test_export_of_a_folder_that_is_not_a_committed_checkpoint_exits_1_with_the_reason(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    code, out, err = _run(capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "plain.ckpt"))
    assert (code, out) == (1, "")
    assert err.startswith(f"lightning-ft export: error: cannot export: checkpoint {tmp_path / 'ckpt'}")
    assert "commit" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "plain.ckpt").exists()


def test_report_of_a_folder_without_event_logs_says_where_they_were_expected(tmp_path, capsys):
    code, out, err = _run(capsys, "report", str(tmp_path))
    assert (code, out) == (2, "")
    assert err.startswith(f"lightning-ft report: error: no event logs under {tmp_path} (expected {tmp_path}")
    assert "/events/rank*.jsonl; pass the trainer's default_root_dir)" in err
    # why a plain run has none
    assert err.endswith("add GoodputMonitor() or set LIGHTNING_FT_EVENT_LOG=always to keep it from the start\n")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_report_of_a_missing_folder_says_so(tmp_path, capsys):
    code, out, err = _run(capsys, "report", str(tmp_path / "nope"))
    assert (code, out) == (2, "")
    _assert_one_line(err, f"lightning-ft report: error: no such folder: {tmp_path / 'nope'}")


def test_report_png_without_matplotlib_names_the_extra_to_install_before_printing_anything(
    tmp_path, capsys, monkeypatch
):
    _write_events(tmp_path / "events")
    assert main(["report", str(tmp_path / "events")]) == 0  # the log itself is fine
    assert "1 attempt(s)" in capsys.readouterr().out

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    code, out, err = _run(capsys, "report", str(tmp_path / "events"), "--png", str(tmp_path / "timeline.png"))
    assert (code, out) == (2, "")
    _assert_one_line(err, "lightning-ft report: error: --png needs matplotlib: pip install 'lightning-ft[plot]'")
    assert not (tmp_path / "timeline.png").exists()


def test_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out
    for line in ("  0  done", "  1  done, and the answer is no", "  2  could not run as asked"):
        assert line in out
