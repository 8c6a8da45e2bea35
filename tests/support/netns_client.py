"""HTTP client run inside a network namespace (`ip netns exec NS python -m ...`).

The test process cannot reach a namespace's addresses, so it runs this module there: the JSON
spec on stdin names the router, the worker URLs whose /metrics to read, and the prompts; the
JSON on stdout holds each completion and the metrics text before and after.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

import httpx

from router.samples import parse_samples, total


def _wait_ready(router: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{router}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"router at {router} not ready within {timeout_s} s")


def _refused(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) != 0


def _settled(before: dict[str, str], now: dict[str, str],
             settle: dict[str, dict[str, float]]) -> bool:
    """Every counter in ``settle`` ({url: {sample: delta}}) grew by at least its delta."""
    return all(total(parse_samples(now[url]), name) - total(parse_samples(before[url]), name)
               >= want for url, wants in settle.items() for name, want in wants.items())


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Wait for the router, read metrics, send the prompts one by one, read metrics again.

    A worker's transfer counters reach its /metrics with the engine step that follows the event,
    in the API server's own time (a lease release lands after the prefill's answer was sent), so
    the second read waits up to ``settle_timeout_s`` for the counters ``settle`` names to grow
    by what they should; the test then checks exact values."""
    out: dict[str, Any] = {}
    if "probe" in spec:  # reachability checks only
        return {"refused": [_refused(h, p) for h, p in spec["probe"]]}
    router = spec["router"]
    _wait_ready(router, spec.get("ready_timeout_s", 600))
    with httpx.Client(timeout=120, trust_env=False) as client:
        def metrics() -> dict[str, str]:
            return {url: client.get(f"{url}/metrics").text for url in spec["metrics"]}

        out["before"] = metrics()
        out["completions"] = []
        for prompt in spec["prompts"]:
            body = {"model": spec["model"], "prompt": prompt, "max_tokens": spec["max_tokens"],
                    "temperature": 0}
            resp = client.post(f"{router}/v1/completions", json=body)
            out["completions"].append({"status": resp.status_code, "body": resp.json()})
        out["after"] = metrics()
        deadline = time.monotonic() + spec.get("settle_timeout_s", 60)
        while not _settled(out["before"], out["after"], spec.get("settle", {})) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            out["after"] = metrics()
    return out


if __name__ == "__main__":
    json.dump(run(json.load(sys.stdin)), sys.stdout)
