"""Where `pdserve up`'s children write their output: one log file each, or the terminal.

A quiet start keeps vLLM's own chatter (its INFO lines, progress bars, interpreter-exit dumps)
out of the terminal: every child (router, each worker, the autoscaler) writes its stdout and
stderr to ``<dir>/<name>.log``, and the terminal shows what `pdserve up` itself says. A child
that dies during start-up gets the end of its log printed before the one-line cause.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import IO

KEEP_RUNS = 20
"""Run directories kept under the default root; older ones are removed at the next start."""


def default_root() -> Path:
    """``$PDSERVE_LOG_ROOT``, else ``~/.cache/pdserve/logs``."""
    env = os.environ.get("PDSERVE_LOG_ROOT")
    return Path(env) if env else Path.home() / ".cache" / "pdserve" / "logs"


def new_run_dir(root: Path, port: int, keep: int = KEEP_RUNS) -> Path:
    """A fresh ``up-<UTC time>-<port>`` directory under ``root``; keeps the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    run = root / f"up-{stamp}-{port}"
    suffix = 1
    while run.exists():
        suffix += 1
        run = root / f"up-{stamp}-{port}-{suffix}"
    run.mkdir()
    runs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("up-")),
                  key=lambda p: p.stat().st_mtime)
    for old in runs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return run


class ChildLogs:
    """Output of each named child: a file under ``directory``, or the terminal when None."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path | None:
        """The log file of child ``name`` (None when children write to the terminal)."""
        return None if self.directory is None else self.directory / f"{name}.log"

    def open(self, name: str) -> IO[bytes] | None:
        """Child ``name``'s log opened for appending (a restarted child continues its file),
        for its stdout and stderr; None when children write to the terminal. The caller closes
        it once the child started (the child holds its own copy)."""
        path = self.path(name)
        return None if path is None else open(path, "ab")  # noqa: SIM115

    def tail(self, name: str, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of child ``name``'s log (empty without a file)."""
        path = self.path(name)
        if path is None or not path.exists():
            return []
        with open(path, "rb") as fh:
            return [raw.decode(errors="replace").rstrip("\r\n")
                    for raw in deque(fh, maxlen=lines)]
