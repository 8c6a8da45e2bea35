"""`pdserve up`'s children write to one log file each (``serve.child_logs``), or the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve.child_logs import ChildLogs, new_run_dir
from serve.cli import _parser
from serve.supervisor import settings_from_args


def _log_dir(argv: list[str]) -> str | None:
    return settings_from_args(_parser().parse_args(["up", *argv])).log_dir


@pytest.mark.parametrize(("argv", "env", "expected"), [
    ([], {}, "auto"),
    (["--log-dir", "-"], {}, None),
    (["--log-dir", "/x/logs"], {}, "/x/logs"),
    ([], {"PDSERVE_LOG_DIR": "/y"}, "/y"),
    (["--log-level", "DEBUG"], {}, None),
    (["--log-level", "DEBUG", "--log-dir", "/x"], {}, "/x"),
])
def test_where_the_children_write(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                  env: dict[str, str], expected: str | None) -> None:
    for name in ("PDSERVE_LOG_DIR", "PDSERVE_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _log_dir(argv) == expected


def test_a_child_writes_both_streams_to_its_file_and_a_restart_appends(tmp_path: Path) -> None:
    logs = ChildLogs(tmp_path / "run")
    for word in ("first", "second"):
        log = logs.open("decode-1234")
        assert log is not None
        with log:
            subprocess.run([sys.executable, "-c", f"import sys; print('{word} out'); "
                            f"print('{word} err', file=sys.stderr)"],
                           stdout=log, stderr=subprocess.STDOUT, check=True)
    text = (tmp_path / "run" / "decode-1234.log").read_text()
    assert text.split() == ["first", "out", "first", "err", "second", "out", "second", "err"]
    assert logs.tail("decode-1234", 2) == ["second out", "second err"]
    assert logs.tail("router") == []  # no such file yet


def test_without_a_directory_children_write_to_the_terminal() -> None:
    logs = ChildLogs(None)
    assert logs.open("router") is None and logs.path("router") is None
    assert logs.tail("router") == []


def test_run_directories_are_new_each_start_and_the_oldest_are_removed(tmp_path: Path) -> None:
    runs = [new_run_dir(tmp_path, 8000, keep=10) for _ in range(5)]
    assert len(set(runs)) == 5
    for i, run in enumerate(runs):  # distinct mtimes, oldest first
        os.utime(run, (1_000_000 + i, 1_000_000 + i))
    newest = new_run_dir(tmp_path, 8000, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in [*runs[3:], newest])
