"""The installed `pdserve` console script runs the commands bench registers (entry points)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PDSERVE = Path(sys.executable).with_name("pdserve")


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PDSERVE), *args], capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize(("command", "usage"), [
    ("bench", "usage: pdserve bench [-h] [-v] {replay,"),
    ("sim", "usage: pdserve sim [-h] --trace TRACE"),
])
def test_registered_command_help_through_the_console_script(command: str, usage: str) -> None:
    assert PDSERVE.exists(), f"{PDSERVE}: the package is not installed (make setup)"
    proc = pdserve(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(usage)
    listed = pdserve("-h")
    assert listed.returncode == 0 and f"\n    {command} " in listed.stdout


def test_unknown_command_is_refused() -> None:
    """Negative control: a name no package registers is an argparse error, not a silent 0."""
    proc = pdserve("nosuchcommand", "--help")
    assert proc.returncode == 2
    assert "invalid choice: 'nosuchcommand'" in proc.stderr


def test_every_bench_module_the_readme_names_calls_itself_by_its_python_m_name() -> None:
    """`usage: python -m bench.X`, not `usage: X.py`: the usage line is a command to copy."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    modules = sorted(set(re.findall(r"python -m (bench\.[a-z_]+)", readme)))
    assert len(modules) >= 10, modules
    for module in modules:
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0, (module, proc.stderr)
        assert proc.stdout.startswith(f"usage: python -m {module} "), (module, proc.stdout[:80])
