"""One real router in its own process, for tests that need several replicas.

``python -m tests.support.router_process SETTINGS_JSON`` serves ``router.api.app.create_app``
under uvicorn with ``RouterSettings(**SETTINGS_JSON)`` (field names, as the in-process
``start_router`` fixture takes them). :class:`RouterProcess` starts one, waits for ``/health``
and stops it by its process handle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from serve.process import child_setup
from serve.redis_server import free_port
from tests.support.router import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


class RouterProcess:
    """A router process on a free loopback port."""

    def __init__(self, **settings: Any) -> None:
        self.port = free_port()
        self.settings = {"host": "127.0.0.1", "port": self.port, "log_level": "WARNING",
                         **settings}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> RouterProcess:
        # child_setup: the router dies with the test process even if the test is killed
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.router_process", json.dumps(self.settings)],
            cwd=ROOT, preexec_fn=child_setup())
        try:
            wait_healthy(self.url, timeout_s=timeout_s, proc=self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    from router.config import RouterSettings
    from router.main import configure_logging, serve

    settings = RouterSettings(**json.loads(argv[0]))
    configure_logging(settings.log_level)
    serve(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
