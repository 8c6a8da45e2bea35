"""deploy/k8s renders with kustomize and every object validates offline.

Built-in kinds go through ``kubernetes-validate --strict`` (the Kubernetes OpenAPI schemas it
ships). The Prometheus Operator kinds (PodMonitor, ServiceMonitor) are CRDs it has no schema
for: they are checked structurally instead (their selectors must pick pods/Services the same
render defines, on ports those declare).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
kv = pytest.importorskip("kubernetes_validate",
                         reason="kubernetes-validate not installed (dev extra)")

from router.autoscale.drain import main as drain_main  # noqa: E402
from router.autoscale.kubernetes import KubernetesActuatorConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "cuda")
K8S_VERSION = "1.33.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}
WORKERS = ("pdserve-prefill", "pdserve-decode")


def _kustomize(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    path = ROOT / "deploy" / "k8s" / "overlays" / overlay
    if kubectl:
        cmd = [kubectl, "kustomize", str(path)]
    elif shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(path)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, _kustomize(request.param)


def _by(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def test_every_builtin_object_validates_strictly(rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    builtin = [o for o in objs if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    assert {o["kind"] for o in builtin} >= {"Namespace", "Deployment", "Service", "StatefulSet",
                                            "ServiceAccount", "Role", "RoleBinding"}
    for obj in builtin:
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} "
                        f"at {list(exc.path)}")


def test_kubernetes_validate_cli_accepts_render(rendered: tuple[str, list[dict]],
                                                tmp_path: Path) -> None:
    overlay, objs = rendered
    cli = shutil.which("kubernetes-validate") or str(Path(kv.__file__).parents[3].parent
                                                     / "bin" / "kubernetes-validate")
    if not Path(cli).exists():
        pytest.skip("kubernetes-validate console script not found")
    builtin = [o for o in objs if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    proc = subprocess.run([cli, "--strict", "--quiet", "-k", K8S_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _pods(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_monitors_select_real_pods_and_ports(rendered: tuple[str, list[dict]]) -> None:
    """CRDs have no schema in kubernetes-validate: check them against the render instead."""
    overlay, objs = rendered
    monitors = [o for o in objs if (o["apiVersion"], o["kind"]) in CRD_KINDS]
    assert {(o["kind"], o["metadata"]["name"]) for o in monitors} == {
        ("PodMonitor", "pdserve-workers"), ("ServiceMonitor", "pdserve-router"),
        ("PodMonitor", "pdserve-autoscaler")}
    for mon in monitors:
        assert mon["metadata"]["namespace"] == "pdserve"
        selector = mon["spec"]["selector"]["matchLabels"]
        if mon["kind"] == "PodMonitor":
            endpoints = mon["spec"]["podMetricsEndpoints"]
            pods = [p for p in _pods(objs) if _matches(selector, p["metadata"]["labels"])]
            assert pods, f"{overlay}: {mon['metadata']['name']} selects no pod"
            for pod in pods:
                ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
                assert {e["port"] for e in endpoints} <= ports
        else:
            endpoints = mon["spec"]["endpoints"]
            services = [s for s in objs if s["kind"] == "Service"
                        and _matches(selector, s["metadata"].get("labels", {}))]
            assert services, f"{overlay}: {mon['metadata']['name']} selects no Service"
            for svc in services:
                assert {e["port"] for e in endpoints} <= {p["name"] for p in svc["spec"]["ports"]}
        assert all(e["path"] == "/metrics" for e in endpoints)


def test_workers_probe_health_drain_and_advertise_pod_ip(
        rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    for name in WORKERS:
        dep = _by(objs, "Deployment", name)
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] == ["pdserve", "worker"]
        assert "--advertise-host=$(POD_IP)" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["PDSERVE_WORKER_ROLE"]["value"] == name.removeprefix("pdserve-")
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        # ready = healthy and not draining; the preStop deregisters from routing, then drains
        ready_cmd = c["readinessProbe"]["exec"]["command"]
        assert ready_cmd == ["python3", "-m", "router.autoscale.drain", "ready", "--port=8100"]
        prestop_cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert prestop_cmd[:4] == ["python3", "-m", "router.autoscale.drain", "prestop"]
        timeout = float(next(a for a in prestop_cmd if a.startswith("--timeout-s=")
                             ).split("=")[1])
        assert timeout < pod["terminationGracePeriodSeconds"]
        # both command lines parse (a typo would only show in a cluster): nothing listens on
        # port 1, so `ready` answers not-ready
        assert drain_main([*ready_cmd[3:-1], "--port=1"]) == 1
        assert pod["terminationGracePeriodSeconds"] >= 150
        limits = c["resources"].get("limits", {})
        if overlay == "cuda":
            assert limits["nvidia.com/gpu"] == "1"
            assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
            assert c["image"] == "pdserve:cuda"
            assert "VLLM_CPU_KVCACHE_SPACE" not in env
            # GPU pods move KV with NIXL (its UCX has cuda/verbs/efa); see the overlay's note
            assert env["PDSERVE_KV_TRANSPORT"]["value"] == "nixl"
        else:
            assert "PDSERVE_KV_TRANSPORT" not in env  # the default: our UCX engine
            assert "nvidia.com/gpu" not in limits
            assert c["image"] == "pdserve:cpu"
            assert env["VLLM_CPU_KVCACHE_SPACE"]["value"] == "1"
            assert env["UCX_TLS"]["value"] == "tcp"


def test_autoscaler_rbac_is_only_the_two_scale_subresources(
        rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    role = _by(objs, "Role", "pdserve-autoscaler")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": list(WORKERS), "verbs": ["get", "patch"]}]
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = _by(objs, "RoleBinding", "pdserve-autoscaler")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "pdserve-autoscaler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve-autoscaler",
                                    "namespace": "pdserve"}]
    dep = _by(objs, "Deployment", "pdserve-autoscaler")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "pdserve-autoscaler"
    # The actuator's defaults name exactly what the manifests deploy and the Role allows.
    cfg = KubernetesActuatorConfig()
    assert (cfg.namespace, cfg.prefill_deployment, cfg.decode_deployment) == ("pdserve", *WORKERS)


def test_router_service_and_redis(rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    svc = _by(objs, "Service", "pdserve-router")
    router = _by(objs, "Deployment", "pdserve-router")
    assert _matches(svc["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    redis = _by(objs, "StatefulSet", "pdserve-redis")
    assert redis["spec"]["serviceName"] == "pdserve-redis"
    _by(objs, "Service", "pdserve-redis")
    assert all(o["metadata"].get("namespace", "pdserve") == "pdserve" for o in objs)
