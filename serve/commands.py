"""`pdserve` subcommands that other packages add, found through package entry points.

A distribution registers ``NAME = "module:function"`` in the ``pdserve.commands`` group (ours:
``bench`` and ``sim`` from the bench package, see pyproject.toml). ``function(argv)`` takes the
arguments after NAME and returns the exit code. serve imports none of these packages: the
dispatcher loads a command's module only when that command runs, so a package that is not
installed costs nothing until its command is asked for, and then fails with a clear error.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

GROUP = "pdserve.commands"
UNAVAILABLE = 2
"""Exit code when a registered command's package cannot be imported (as argparse errors)."""


def plugin_commands() -> dict[str, EntryPoint]:
    """Name -> entry point of every command registered in :data:`GROUP` (first one wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def summary(ep: EntryPoint) -> str:
    """One line for `pdserve -h`: the first line of the command module's docstring, read from
    its source without importing it (``pdserve up`` builds the same parser)."""
    fallback = f"see `pdserve {ep.name} -h`"
    try:
        spec = importlib.util.find_spec(ep.module)
    except ImportError:
        return f"{fallback} (not importable here)"
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return fallback
    try:
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (OSError, SyntaxError, ValueError):
        return fallback
    line = doc.split("\n", 1)[0].strip().rstrip(".")
    # "`pdserve bench`: replay, synth, ..." -> "replay, synth, ..."
    head, sep, tail = line.partition(": ")
    text = tail if sep and f"pdserve {ep.name}" in head else line
    return f"{text} (see `pdserve {ep.name} -h`)" if text else fallback


def run(ep: EntryPoint, argv: list[str]) -> int:
    """Load the command and run it on ``argv``; a clear error if its package is missing."""
    try:
        command: Callable[[list[str]], int] = ep.load()
    except ImportError as exc:
        dist = ep.dist.name if ep.dist is not None else "the package that registers it"
        print(f"pdserve {ep.name}: unavailable, cannot import {ep.value} ({exc}); install "
              f"{dist} with its dependencies", file=sys.stderr)
        return UNAVAILABLE
    return command(argv)
