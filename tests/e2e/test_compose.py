"""deploy/docker-compose.yml, for real: from nothing to a serving cluster and back to nothing.

Builds what is missing (Docker engine, base image by debootstrap, images; see
tests/support/compose.py), brings the cluster up with docker-compose 1.29, streams a completion
through the published router port with the OpenAI SDK, checks from the workers' own metrics that
the prompt's KV was pulled from prefill to decode, that Prometheus scrapes the router and the
workers, that ``--scale decode=2`` makes both decode containers serve, and that ``down -v``
leaves no container, network or volume of the project.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import compose as c
from tests.support.waiting import eventually

pytestmark = [pytest.mark.compose, pytest.mark.timeout(5400)]

PROJECT = "pdservetest"
SERVED = "tiny-llama"
UP_TIMEOUT_S = 900.0
PROMPT = "The compose cluster streams this completion through the router. " * 3


@pytest.fixture(scope="module")
def tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: installs Debian's docker.io/docker-compose and starts dockerd")
    c.ensure_tools()
    c.ensure_engine()


def _port(preferred: int) -> int:
    """``preferred`` when nothing listens there, else a free port from the OS."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            pass
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    env: dict[str, str]
    router_url: str
    prometheus_url: str

    def compose(self, *args: str, timeout_s: float = 600,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return c.run([*c.compose_cmd(), "-p", PROJECT, "-f", str(c.DEPLOY / "docker-compose.yml"),
                      *args], timeout_s=timeout_s, env=self.env, check=check)

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def metrics(self, container: str, port: int = 8100) -> dict[str, float]:
        """Samples of a container's /metrics, read from inside it, summed over labels."""
        code = (f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/metrics',"
                " timeout=10).read().decode())")
        text = c.run([c.docker_cli(), "exec", container, "python3", "-c", code],
                     timeout_s=60).stdout
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def router_health(self) -> dict:
        try:
            resp = httpx.get(f"{self.router_url}/health", timeout=5)
            return {"status_code": resp.status_code, **resp.json()}
        except (httpx.HTTPError, ValueError) as exc:
            return {"error": repr(exc)}

    def all_healthy(self) -> dict[str, str]:
        ids = self.compose("ps", "-q").stdout.split()
        return {cid[:12]: c.container_health(cid) for cid in ids}


@pytest.fixture(scope="module")
def images(tools: None) -> c.Images:
    return c.ensure_images()


@pytest.fixture(scope="module")
def cluster(images: c.Images) -> Iterator[Cluster]:
    router_port, prom_port = _port(8000), _port(9090)
    env = dict(os.environ, PDSERVE_IMAGE=images.pdserve, REDIS_IMAGE=images.redis,
               PROMETHEUS_IMAGE=images.prometheus, PDSERVE_PORT=str(router_port),
               PROMETHEUS_PORT=str(prom_port))
    cl = Cluster(env, f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{prom_port}")
    cl.compose("down", "-v", "--remove-orphans", "--timeout", "10")  # a previous run's leftovers
    started = time.monotonic()
    try:
        # docker-compose waits for service_healthy dependencies: returns once the router is.
        cl.compose("up", "-d", "--no-build", timeout_s=UP_TIMEOUT_S)
        eventually(cl.all_healthy, lambda h: bool(h) and set(h.values()) == {"healthy"},
                   timeout_s=120, interval_s=1)
        print(f"compose up: {time.monotonic() - started:.0f} s; image steps {images.timings_s}")
        yield cl
    except Exception:
        print(cl.compose("logs", "--tail=80", check=False).stdout[-20000:])
        raise
    finally:
        cl.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False)


def test_compose_file_validates(tools: None) -> None:
    proc = c.run([*c.compose_cmd(), "-f", str(c.DEPLOY / "docker-compose.yml"), "config", "-q"],
                 timeout_s=60)
    assert proc.returncode == 0
    for profile in ("autoscale", "grafana", "gpu"):
        c.run([*c.compose_cmd(), "-f", str(c.DEPLOY / "docker-compose.yml"),
               "--profile", profile, "config", "-q"], timeout_s=60)


def test_prometheus_and_grafana_provisioning_parse() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    prom = yaml.safe_load((c.DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["pdserve-router"]["static_configs"] == [{"targets": ["router:8000"]}]
    assert jobs["pdserve-workers"]["dns_sd_configs"][0]["names"] == ["prefill", "decode"]
    ds = yaml.safe_load((c.DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    # the panels name the dashboard's `datasource` variable, which defaults to the default
    # Prometheus data source: the one provisioned here
    assert (source["type"], source["isDefault"]) == ("prometheus", True)
    dash = json.loads((c.DEPLOY / "grafana/dashboards/pdserve.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource", "prometheus")
    titles = {p["title"] for p in dash["panels"]}
    assert {"TTFT (router, streams)", "TPOT (decode workers)", "Request rate by status",
            "Routing decisions by reason", "KV pull bandwidth", "KV pulls and failures",
            "Pool sizes"} <= titles
    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert all(t["expr"] for t in panel["targets"])


def test_gpu_profile_reserves_nvidia_gpus_with_the_cuda_image() -> None:
    """Structure only: no GPU on this project's machines (README: GPU quick start)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    compose = yaml.safe_load((c.DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    gpu = {name for name, svc in services.items() if "gpu" in svc.get("profiles", [])}
    assert gpu == {"prefill-gpu", "decode-gpu"}
    for name in gpu:
        svc = services[name]
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert "hf-cache:/root/.cache/huggingface" in svc["volumes"]
        env = svc["environment"]
        assert env["HF_TOKEN"] == "${HF_TOKEN:-}"  # from the caller's environment only
        assert env["PDSERVE_WORKER_ROLE"] == name.removesuffix("-gpu")
        # --kv-cache-gib sizes the KV cache on GPU too (serve.worker.kv_cache_options)
        assert "PDSERVE_WORKER_KV_CACHE_GIB" in env
        assert not {k for k in env if k.startswith("VLLM_CPU_")}
    # the CPU workers stay in the default (profile-less) set
    assert not services["prefill"].get("profiles") and not services["decode"].get("profiles")
    assert "hf-cache" in compose["volumes"]


def _stream(cluster: Cluster, prompt: str, max_tokens: int = 16) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", timeout=120)
    chunks = [ch.choices[0].text for ch in client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True)
        if ch.choices]
    assert len(chunks) > 1, "expected a stream of several chunks"
    return "".join(chunks)


def test_stream_goes_prefill_pull_decode(cluster: Cluster) -> None:
    (prefill,) = cluster.containers("prefill")
    (decode,) = cluster.containers("decode")
    before_d, before_p = cluster.metrics(decode), cluster.metrics(prefill)
    text = _stream(cluster, PROMPT)
    assert text.strip()
    after_d = eventually(lambda: cluster.metrics(decode),
                         lambda m: m.get("pdserve_kv_pulls_total", 0)
                         > before_d.get("pdserve_kv_pulls_total", 0), timeout_s=30)
    assert after_d.get("pdserve_kv_pull_failures_total", 0) == \
        before_d.get("pdserve_kv_pull_failures_total", 0)
    assert after_d["pdserve_kv_pulled_bytes_total"] > before_d.get("pdserve_kv_pulled_bytes_total",
                                                                  0)
    # The prefill worker's lease ended by decode's release: the pulled blocks were valid.
    eventually(lambda: cluster.metrics(prefill),
               lambda m: m.get("pdserve_kv_leases_released_total", 0)
               > before_p.get("pdserve_kv_leases_released_total", 0), timeout_s=30)


def _prom(cluster: Cluster, query: str) -> list[dict]:
    resp = httpx.get(f"{cluster.prometheus_url}/api/v1/query", params={"query": query},
                     timeout=10)
    resp.raise_for_status()
    return list(resp.json()["data"]["result"])


def test_prometheus_scrapes_router_and_workers(cluster: Cluster) -> None:
    def up_targets() -> set[str]:
        resp = httpx.get(f"{cluster.prometheus_url}/api/v1/targets", timeout=10).json()
        return {f"{t['labels']['job']}/{t['labels'].get('role', '')}"
                for t in resp["data"]["activeTargets"] if t["health"] == "up"}

    eventually(up_targets, lambda s: {"pdserve-router/", "pdserve-workers/prefill",
                                      "pdserve-workers/decode"} <= s, timeout_s=60, interval_s=1)
    # Real series from each kind of target reached the TSDB.
    eventually(lambda: _prom(cluster, "pdserve_router_workers"), lambda r: len(r) >= 2,
               timeout_s=60, interval_s=1)
    eventually(lambda: _prom(cluster, 'vllm:num_requests_running{job="pdserve-workers"}'),
               lambda r: {x["metric"].get("role") for x in r} >= {"prefill", "decode"},
               timeout_s=60, interval_s=1)


def test_scale_decode_to_two_both_serve(cluster: Cluster) -> None:
    cluster.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "decode=2",
                    timeout_s=UP_TIMEOUT_S)
    eventually(cluster.router_health, lambda h: h.get("decode_workers") == 2, timeout_s=600,
               interval_s=1)
    decodes = cluster.containers("decode")
    assert len(decodes) == 2
    before = {d: cluster.metrics(d).get("pdserve_kv_pulls_total", 0.0) for d in decodes}

    def served() -> dict[str, float]:
        return {d: cluster.metrics(d).get("pdserve_kv_pulls_total", 0.0) - before[d]
                for d in decodes}

    # Concurrent streams: the least-loaded decode choice spreads them over both replicas.
    deadline = time.monotonic() + 180
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        while not all(v > 0 for v in served().values()):
            assert time.monotonic() < deadline, f"not every decode replica served: {served()}"
            futures = [pool.submit(_stream, cluster, f"{i} {PROMPT}", 24) for i in range(6)]
            for fut in futures:
                assert fut.result().strip()
    # Prometheus found the new replica by DNS service discovery.
    eventually(lambda: _prom(cluster, 'up{job="pdserve-workers",role="decode"} == 1'),
               lambda r: len(r) == 2, timeout_s=60, interval_s=1)


def test_down_leaves_nothing(cluster: Cluster) -> None:
    cluster.compose("down", "-v", "--remove-orphans", "--timeout", "20")
    left = c.project_resources(PROJECT)
    assert left == {"containers": [], "networks": [], "volumes": []}, json.dumps(left)
