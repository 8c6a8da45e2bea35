"""The Kubernetes actuator: the exact scale-subresource requests it sends.

The official client runs unmodified down to urllib3; only its connection pool is replaced by a
recorder, so these tests see the method, URL, headers and body that would go on the wire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("kubernetes", reason="kubernetes client not installed (dev extra)")

import urllib3  # noqa: E402
from kubernetes import client  # noqa: E402

from router.autoscale.kubernetes import (  # noqa: E402
    KubernetesActuator,
    KubernetesActuatorConfig,
    KubernetesActuatorError,
    scale_request,
)
from router.autoscale.planner import Decision  # noqa: E402
from router.errors import ConfigError  # noqa: E402

HOST = "https://k8s.test:6443"
TOKEN = "t0ken"


@dataclass
class Sent:
    method: str
    url: str
    headers: dict[str, str]
    body: Any


@dataclass
class RecordingPool:
    """Stands in for urllib3's PoolManager: records each request, answers a Scale object."""

    status: int = 200
    replicas_reply: int | None = None
    sent: list[Sent] = field(default_factory=list)

    def request(self, method: str, url: str, body: Any = None, fields: Any = None,
                headers: dict[str, str] | None = None, **_: Any) -> urllib3.HTTPResponse:
        parsed = json.loads(body) if isinstance(body, str) else body
        # HTTP header names are case-insensitive; the client lower-cases some of them.
        self.sent.append(Sent(method, url, {k.lower(): v for k, v in (headers or {}).items()},
                              parsed))
        name = url.split("/deployments/")[1].split("/")[0]
        replicas = self.replicas_reply
        if replicas is None:
            replicas = parsed["spec"]["replicas"] if method == "PATCH" else 2
        reply: dict[str, Any] = {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": "pdserve"},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas},
        }
        if self.status >= 400:
            reply = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "reason": "Forbidden", "code": self.status}
        return urllib3.HTTPResponse(body=json.dumps(reply).encode(), status=self.status,
                                    reason="OK" if self.status < 400 else "Forbidden",
                                    headers={"Content-Type": "application/json"},
                                    preload_content=True)


def make_actuator(pool: RecordingPool,
                  config: KubernetesActuatorConfig | None = None) -> KubernetesActuator:
    cfg = client.Configuration(host=HOST, api_key={"authorization": TOKEN},
                               api_key_prefix={"authorization": "Bearer"})
    api_client = client.ApiClient(cfg)
    api_client.rest_client.pool_manager = pool  # type: ignore[assignment]
    return KubernetesActuator(config, client.AppsV1Api(api_client))


def decision(pool: str, current: int, desired: int) -> Decision:
    return Decision(pool=pool, current=current, desired=desired,  # type: ignore[arg-type]
                    reason="scale_up", load=1.0, capacity_per_instance=1.0)


@pytest.mark.parametrize(
    ("pool", "replicas", "url"),
    [
        ("decode", 3, f"{HOST}/apis/apps/v1/namespaces/pdserve/deployments/pdserve-decode/scale"
                      "?fieldManager=pdserve-autoscaler"),
        ("prefill", 1, f"{HOST}/apis/apps/v1/namespaces/pdserve/deployments/pdserve-prefill/scale"
                       "?fieldManager=pdserve-autoscaler"),
        ("decode", 0, f"{HOST}/apis/apps/v1/namespaces/pdserve/deployments/pdserve-decode/scale"
                      "?fieldManager=pdserve-autoscaler"),
    ],
)
def test_set_replicas_sends_exact_merge_patch(pool: str, replicas: int, url: str) -> None:
    rec = RecordingPool()
    accepted = make_actuator(rec).set_replicas(pool, replicas)  # type: ignore[arg-type]
    assert accepted == replicas
    assert len(rec.sent) == 1
    sent = rec.sent[0]
    assert sent.method == "PATCH"
    assert sent.url == url
    assert sent.headers["content-type"] == "application/merge-patch+json"
    assert sent.headers["authorization"] == f"Bearer {TOKEN}"
    assert sent.body == {"spec": {"replicas": replicas}}


def test_pure_request_matches_what_the_client_sends() -> None:
    cfg = KubernetesActuatorConfig(namespace="llm", decode_deployment="dec",
                                   field_manager="me")
    req = scale_request(cfg, "decode", 4)
    assert (req.method, req.path, req.query, req.content_type, req.body_json()) == (
        "PATCH", "/apis/apps/v1/namespaces/llm/deployments/dec/scale", (("fieldManager", "me"),),
        "application/merge-patch+json", '{"spec": {"replicas": 4}}')
    rec = RecordingPool()
    make_actuator(rec, cfg).set_replicas("decode", 4)
    sent = rec.sent[0]
    assert sent.url == f"{HOST}{req.path}?fieldManager=me"
    assert (sent.method, sent.headers["content-type"], sent.body) == (
        req.method, req.content_type, req.body)


def test_current_replicas_reads_scale_subresource() -> None:
    rec = RecordingPool()
    assert make_actuator(rec).current_replicas("prefill") == 2
    assert [(s.method, s.url, s.body) for s in rec.sent] == [
        ("GET", f"{HOST}/apis/apps/v1/namespaces/pdserve/deployments/pdserve-prefill/scale",
         None)]


def test_apply_patches_only_changed_pools() -> None:
    rec = RecordingPool()
    written = make_actuator(rec).apply([decision("prefill", 2, 2), decision("decode", 1, 3)])
    assert written == {"decode": 3}
    assert [(s.url.split("/deployments/")[1], s.body) for s in rec.sent] == [
        ("pdserve-decode/scale?fieldManager=pdserve-autoscaler", {"spec": {"replicas": 3}})]


def test_api_error_is_wrapped() -> None:
    rec = RecordingPool(status=403)
    with pytest.raises(KubernetesActuatorError, match="pdserve-decode to 2: 403") as info:
        make_actuator(rec).set_replicas("decode", 2)
    assert isinstance(info.value.__cause__, client.exceptions.ApiException)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": ""}, "namespace must not be empty"),
        ({"request_timeout_s": 0}, "request_timeout_s must be > 0"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KubernetesActuatorConfig(**kwargs)


def test_negative_replicas_and_unknown_pool_rejected() -> None:
    cfg = KubernetesActuatorConfig()
    with pytest.raises(ConfigError, match="replicas must be >= 0"):
        scale_request(cfg, "decode", -1)
    with pytest.raises(ConfigError, match="allowed: prefill, decode"):
        scale_request(cfg, "router", 1)  # type: ignore[arg-type]
