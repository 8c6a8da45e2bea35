"""Redis with a password and TLS (``rediss://``): registry, router and autoscaler lock use it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from router.autoscale.service import hold_leadership, leader_lock
from router.state.registry import WorkerRegistry
from serve.redis_server import free_port, redis_reachable
from tests.fakes.fake_worker import FakeWorker, ServerThread, build_tiny_tokenizer
from tests.support.router import register
from tests.support.waiting import eventually

PASSWORD = "s3cret-redis-pw"


def _certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.crt", "srv.key", "srv.csr",
                                                   "srv.crt"))
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pdserve-ca",
        "-keyout", str(ca_key), "-out", str(ca))
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key),
        "-out", str(csr))
    ext = tmp / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    tmp = tmp_path_factory.mktemp("redis-tls")
    ca, cert, key = _certs(tmp)
    port = free_port()
    binary = shutil.which("redis-server")
    assert binary, "redis-server is installed by make setup"
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
         "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    deadline = time.monotonic() + 10
    while not redis_reachable(url):
        assert proc.poll() is None and time.monotonic() < deadline, "TLS redis did not start"
        time.sleep(0.05)
    yield port, ca
    proc.terminate()
    proc.wait(timeout=10)


def test_plain_and_unauthenticated_clients_are_turned_away(tls_redis: tuple[int, Path]) -> None:
    """Negative control: the server really demands TLS and the password."""
    port, ca = tls_redis

    async def go() -> None:
        for url in (f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
                    f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}",
                    f"rediss://:wrong-password@127.0.0.1:{port}/0?ssl_ca_certs={ca}"):
            reg = WorkerRegistry(url, prefix="tlstest")
            with pytest.raises(Exception):  # noqa: B017 - connection, auth or TLS error
                await reg.list()
            await reg.close()

    asyncio.run(go())


def test_registry_router_and_lock_over_tls_with_password(tls_redis: tuple[int, Path],
                                                        tmp_path: Path) -> None:
    from router.api.app import create_app
    from router.config import RouterSettings

    port, ca = tls_redis
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    tok = str(build_tiny_tokenizer(tmp_path / "tok"))
    workers = [FakeWorker(wid, role, model_path=tok).start()  # type: ignore[arg-type]
               for wid, role in (("p0", "prefill"), ("d0", "decode"))]
    try:
        register(url, [w.record() for w in workers], prefix="tlstest")
        router = ServerThread(create_app(RouterSettings(
            redis_url=url, redis_prefix="tlstest", refresh_interval_s=0.1))).start()
        try:
            # ready once the model's tokenizer has loaded ("warming" until then)
            health = eventually(lambda: httpx.get(router.url + "/health", timeout=10).json(),
                                lambda h: h["status"] != "warming", timeout_s=60)
            assert health == {"status": "ok", "prefill_workers": 1, "decode_workers": 1,
                              "aggregated_workers": 0, "flex_workers": 0, "redis": "ok"}
            resp = httpx.post(router.url + "/v1/completions", timeout=10,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
        finally:
            router.stop()
    finally:
        for w in workers:
            w.stop()

    async def lock() -> None:
        client = aioredis.from_url(url)
        try:
            assert await hold_leadership(leader_lock(client, "tlstest:lock", 1.0))
        finally:
            await client.aclose()

    asyncio.run(lock())
