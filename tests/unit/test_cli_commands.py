"""`pdserve` finds the commands of other packages through entry points; serve imports no bench."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from serve.commands import GROUP, UNAVAILABLE, plugin_commands, run, summary

ROOT = Path(__file__).resolve().parents[2]


def bench_imports(source: str) -> list[str]:
    """Every module of the bench package that ``source`` imports, anywhere (lazy imports in
    function bodies too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "bench"]
        elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
              and node.module.split(".")[0] == "bench"):
            found.append(node.module)
    return found


def test_serve_imports_no_bench_module() -> None:
    files = sorted((ROOT / "serve").rglob("*.py"))
    assert len(files) > 5 and ROOT / "serve" / "cli.py" in files
    offenders = {str(f.relative_to(ROOT)): bench_imports(f.read_text()) for f in files}
    assert {f: m for f, m in offenders.items() if m} == {}


@pytest.mark.parametrize(("source", "expected"), [
    ("def main():\n    from bench.cli import main\n", ["bench.cli"]),  # the old lazy import
    ("import bench.sim.cli as sim\n", ["bench.sim.cli"]),
    ("if True:\n    import os, bench\n", ["bench"]),
    ("from benchmarks import x\nimport benchy\nfrom . import bench\n", []),
])
def test_the_guard_sees_every_form_of_import(source: str, expected: list[str]) -> None:
    """Negative control: the walk above would catch the import serve/cli.py used to have."""
    assert bench_imports(source) == expected


def test_bench_and_sim_are_registered_and_installed() -> None:
    """pyproject names the commands, and the installed metadata agrees (a stale install, made
    before the entry points, would lose `pdserve bench`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][GROUP]
    assert declared == {"bench": "bench.cli:main", "sim": "bench.sim.cli:main"}
    installed = {name: ep.value for name, ep in plugin_commands().items()}
    assert installed == declared


def test_help_line_is_the_module_docstring_read_without_importing() -> None:
    commands = plugin_commands()
    assert summary(commands["bench"]) == ("replay, synth, sweep, compare, profile "
                                          "(see `pdserve bench -h`)")
    ghost = EntryPoint(name="ghost", value="no_such_package.cli:main", group=GROUP)
    assert summary(ghost) == "see `pdserve ghost -h` (not importable here)"


def test_a_command_whose_package_is_missing_fails_clearly(
        capsys: pytest.CaptureFixture[str]) -> None:
    ghost = EntryPoint(name="ghost", value="no_such_package.cli:main", group=GROUP)
    assert run(ghost, ["--help"]) == UNAVAILABLE
    err = capsys.readouterr().err
    assert "pdserve ghost: unavailable, cannot import no_such_package.cli:main" in err
    assert "No module named 'no_such_package'" in err
