"""The Kubernetes actuator over real HTTP against a local scale-subresource server.

No real API server can run here (no cluster); ``tests.fakes.k8s_scale_api`` implements the
Deployment scale subresource with the API server's authentication, RBAC, content-type,
validation and conflict answers, and records each request. The official client runs
unmodified, so these tests see the bytes the autoscaler would send to a cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("kubernetes", reason="kubernetes client not installed (the k8s extra)")

from kubernetes import client  # noqa: E402

from router.autoscale.kubernetes import (  # noqa: E402
    KubernetesActuator,
    KubernetesActuatorConfig,
    KubernetesActuatorError,
)
from router.autoscale.planner import Decision  # noqa: E402
from tests.fakes.k8s_scale_api import FakeScaleApi  # noqa: E402

TOKEN = "sa-t0ken"
SCALE = "/apis/apps/v1/namespaces/pdserve/deployments/{}/scale"


@pytest.fixture()
def api() -> Iterator[FakeScaleApi]:
    server = FakeScaleApi(TOKEN).start()
    yield server
    server.stop()


def actuator(api: FakeScaleApi, token: str = TOKEN, **cfg: object) -> KubernetesActuator:
    conf = client.Configuration(host=api.url, api_key={"authorization": token},
                                api_key_prefix={"authorization": "Bearer"})
    return KubernetesActuator(KubernetesActuatorConfig(**cfg),  # type: ignore[arg-type]
                              client.AppsV1Api(client.ApiClient(conf)))


def decision(pool: str, current: int, desired: int) -> Decision:
    return Decision(pool, current, desired, "scale_up", 1.0, 1.0)  # type: ignore[arg-type]


def test_scale_write_is_one_exact_merge_patch(api: FakeScaleApi) -> None:
    assert actuator(api).set_replicas("decode", 3) == 3
    assert api.replicas == {"pdserve-prefill": 1, "pdserve-decode": 3}
    (seen,) = api.seen
    assert (seen.method, seen.path, seen.query, seen.status) == (
        "PATCH", SCALE.format("pdserve-decode"), {"fieldManager": "pdserve-autoscaler"}, 200)
    assert seen.headers["content-type"] == "application/merge-patch+json"
    assert seen.headers["authorization"] == f"Bearer {TOKEN}"
    assert seen.body == {"spec": {"replicas": 3}}


def test_read_and_apply_touch_only_changed_pools(api: FakeScaleApi) -> None:
    act = actuator(api)
    api.replicas["pdserve-prefill"] = 4
    assert act.current_replicas("prefill") == 4
    assert act.apply([decision("prefill", 4, 4), decision("decode", 1, 2)]) == {"decode": 2}
    assert [(s.method, s.path, s.status) for s in api.seen] == [
        ("GET", SCALE.format("pdserve-prefill"), 200),
        ("PATCH", SCALE.format("pdserve-decode"), 200)]
    assert api.replicas == {"pdserve-prefill": 4, "pdserve-decode": 2}


def test_a_conflict_is_retried_with_the_same_count(api: FakeScaleApi) -> None:
    api.conflicts = 2
    assert actuator(api).set_replicas("prefill", 5) == 5
    assert [(s.status, s.body) for s in api.seen] == [
        (409, {"spec": {"replicas": 5}}), (409, {"spec": {"replicas": 5}}),
        (200, {"spec": {"replicas": 5}})]
    assert api.replicas["pdserve-prefill"] == 5


def test_persistent_conflict_is_an_error_and_changes_nothing(api: FakeScaleApi) -> None:
    api.conflicts = 10
    with pytest.raises(KubernetesActuatorError, match="pdserve-prefill to 5: 409"):
        actuator(api, conflict_retries=2).set_replicas("prefill", 5)
    assert [s.status for s in api.seen] == [409, 409, 409]
    assert api.replicas["pdserve-prefill"] == 1
    # negative control: without retries the first conflict already fails
    api.seen.clear()
    with pytest.raises(KubernetesActuatorError, match="409"):
        actuator(api, conflict_retries=0).set_replicas("prefill", 5)
    assert len(api.seen) == 1


def test_rbac_forbids_other_deployments_and_verbs(api: FakeScaleApi) -> None:
    api.replicas["pdserve-router"] = 2
    with pytest.raises(KubernetesActuatorError, match="403 Forbidden.*RBAC") as info:
        actuator(api, decode_deployment="pdserve-router").set_replicas("decode", 5)
    assert isinstance(info.value.__cause__, client.exceptions.ApiException)
    assert api.replicas["pdserve-router"] == 2
    # read-only rights: the read works, the write is refused and not retried
    api.allowed = {("get", "pdserve-decode")}
    act = actuator(api)
    assert act.current_replicas("decode") == 1
    with pytest.raises(KubernetesActuatorError, match="403"):
        act.set_replicas("decode", 2)
    assert [s.status for s in api.seen[-2:]] == [200, 403]
    assert api.replicas["pdserve-decode"] == 1


def test_wrong_token_is_unauthorized(api: FakeScaleApi) -> None:
    with pytest.raises(KubernetesActuatorError, match="401"):
        actuator(api, token="stale").current_replicas("decode")
    assert [s.status for s in api.seen] == [401]


def test_server_rejects_what_the_actuator_must_not_send(api: FakeScaleApi) -> None:
    """Negative control for the fake itself: a strategic-merge or malformed patch is refused,
    so the tests above would catch an actuator that sent one."""
    conf = client.Configuration(host=api.url, api_key={"authorization": TOKEN},
                                api_key_prefix={"authorization": "Bearer"})
    apps = client.AppsV1Api(client.ApiClient(conf))
    with pytest.raises(client.exceptions.ApiException) as info:
        apps.patch_namespaced_deployment_scale(
            "pdserve-decode", "pdserve", {"spec": {"replicas": 2}},
            _content_type="application/strategic-merge-patch+json")
    assert info.value.status == 415
    with pytest.raises(client.exceptions.ApiException) as info:
        apps.patch_namespaced_deployment_scale(
            "pdserve-decode", "pdserve", {"spec": {"replicas": -1}},
            _content_type="application/merge-patch+json")
    assert info.value.status == 422
    assert api.replicas["pdserve-decode"] == 1
