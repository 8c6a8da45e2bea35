"""Start a real ``redis-server`` on a free loopback port when none is reachable."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    RedisError,
    ResponseError,
)

from router.state.registry import redacted_url
from serve.process import child_setup

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port the OS considers free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    """True when a Redis answers at ``url`` (``redis://``, ``rediss://`` with TLS options in
    the query, ``unix://``; a password in the URL is used). A server that refuses our
    credentials counts as reachable: it is there, and starting another would hide the mistake."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (AuthenticationError, AuthenticationWrongNumberOfArgsError, ResponseError) as exc:
        logger.warning("Redis at %s refused us: %s", redacted_url(url), exc)
        return True
    except (RedisError, OSError):
        return False
    finally:
        client.close()


@dataclass
class RedisServer:
    """A ``redis-server`` child process bound to loopback; stop() ends it."""

    port: int
    process: subprocess.Popen[bytes]
    workdir: tempfile.TemporaryDirectory[str] = field(repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.workdir.cleanup()


def start_redis(port: int | None = None, ready_timeout_s: float = 10.0) -> RedisServer:
    """Start ``redis-server`` (no persistence) and wait until it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found; run `make setup` "
                           "(it installs Debian's redis-server)")
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", workdir.name, "--protected-mode", "no"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=child_setup())
    server = RedisServer(port=port, process=process, workdir=workdir)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"redis-server exited with code {process.returncode} on port {port}")
        if redis_reachable(server.url):
            logger.info("started redis-server on port %d", port)
            return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not answer on port {port} within {ready_timeout_s} s")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def startable_port(url: str) -> int | None:
    """The port of ``url`` when a Redis we start (plain, loopback, no password) can serve it."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in LOOPBACK_HOSTS or parts.password \
            or parts.username:
        return None
    return parts.port or 6379


def ensure_redis(url: str) -> tuple[RedisServer | None, str]:
    """The Redis at ``url`` when one answers (None, ``url``); otherwise a ``redis-server`` we
    start, on ``url``'s own port when ``url`` is a plain loopback URL whose port is free (the URL
    is then unchanged), else on a free port: (server, the URL to use instead)."""
    from serve.preflight import port_free

    if redis_reachable(url):
        return None, url
    port = startable_port(url)
    if port is not None and port_free("127.0.0.1", port):
        server = start_redis(port)
        logger.info("no Redis at %s: started one there", redacted_url(url))
        return server, url
    server = start_redis()
    parts = urlsplit(url)
    db = parts.path if parts.scheme in ("redis", "rediss") and len(parts.path) > 1 else "/0"
    actual = f"redis://127.0.0.1:{server.port}{db}"
    why = "its port is taken" if port is not None else "pdserve cannot start a Redis for it"
    logger.warning("no Redis answers at %s and %s: started one at %s; give other commands "
                   "(pdserve worker, pdserve autoscale status) --redis-url %s",
                   redacted_url(url), why, actual, actual)
    return server, actual
