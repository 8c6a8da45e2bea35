"""deploy/k8s renders with kustomize and every object validates offline.

Built-in kinds go through ``kubernetes-validate --strict`` (the Kubernetes OpenAPI schemas it
ships). The Prometheus Operator kinds (PodMonitor, ServiceMonitor) are CRDs it has no schema
for: they are checked structurally instead (their selectors must pick pods/Services the same
render defines, on ports those declare).
"""

from __future__ import annotations

import functools
import json
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
OVERLAYS = ("cpu", "cuda", "adaptive")
K8S_VERSION = "1.33.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}
PD_WORKERS = ("pdserve-prefill", "pdserve-decode")
# The worker Deployments of each overlay: adaptive runs flex workers instead of the two pools,
# and no autoscaler (it sizes only those two).
WORKERS = {"cpu": PD_WORKERS, "cuda": PD_WORKERS, "adaptive": ("pdserve-flex",)}
AUTOSCALED = frozenset({"cpu", "cuda"})
CPU_IMAGE = frozenset({"cpu", "adaptive"})  # the image of deploy/Dockerfile, the tiny model


def _autoscaler(overlay: str) -> tuple[str, ...]:
    return ("pdserve-autoscaler",) if overlay in AUTOSCALED else ()


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
    kinds = {"Namespace", "Deployment", "Service", "StatefulSet", "PodDisruptionBudget",
             "NetworkPolicy", "ConfigMap"}
    if overlay in AUTOSCALED:
        kinds |= {"ServiceAccount", "Role", "RoleBinding"}
    assert {o["kind"] for o in builtin} >= kinds
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
        *(("PodMonitor", name) for name in _autoscaler(overlay))}
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
    for name in WORKERS[overlay]:
        dep = _by(objs, "Deployment", name)
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] == ["pdserve", "worker"]
        assert "--advertise-host=$(POD_IP)" in c["args"]
        env = {e["name"]: e for e in c["env"]}
        # one entry per name: server-side apply refuses duplicates (an overlay must merge)
        assert len(env) == len(c["env"]), sorted(e["name"] for e in c["env"])
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
            assert env["PDSERVE_WORKER_KV_CACHE_GIB"]["value"] == "8"
            # NIXL's reads of GPU KV on one node ride CUDA IPC only with this (README, GPU check)
            assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"]["value"] == "y"
        else:
            assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in env  # unused there: UCX would warn
            # pods share the cluster network: the sealed tcp wire, not UCX's software RMA
            assert env["PDSERVE_KV_TRANSPORT"]["value"] == "tcp"
            assert "nvidia.com/gpu" not in limits
            assert c["image"] == "pdserve:cpu"
            assert env["VLLM_CPU_KVCACHE_SPACE"]["value"] == "1"
            assert env["UCX_TLS"]["value"] == "tcp"


def test_autoscaler_rbac_is_only_the_two_scale_subresources(
        rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    if overlay not in AUTOSCALED:
        pytest.skip(f"{overlay} has no autoscaler (test_adaptive_runs_flex_workers_only)")
    role = _by(objs, "Role", "pdserve-autoscaler")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": list(PD_WORKERS), "verbs": ["get", "patch"]}]
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
    assert (cfg.namespace, cfg.prefill_deployment, cfg.decode_deployment) == (
        "pdserve", *PD_WORKERS)


def test_adaptive_runs_flex_workers_only() -> None:
    """overlays/adaptive: one pool of 2 flex workers, no prefill or decode Deployment and
    nothing left that names one (the autoscaler is gone with them); apart from its name, role
    and replicas, the flex pod is the cpu overlay's prefill pod (same secrets, probes, drain)."""
    objs, cpu = _kustomize("adaptive"), _kustomize("cpu")
    workers = [o for o in objs if o["kind"] == "Deployment"
               and o["metadata"]["labels"].get("app.kubernetes.io/name") == "pdserve-worker"]
    assert [w["metadata"]["name"] for w in workers] == ["pdserve-flex"]
    (flex,) = workers
    assert flex["spec"]["replicas"] == 2
    labels = flex["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "flex"
    assert flex["spec"]["selector"]["matchLabels"] == labels
    (c,) = flex["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["PDSERVE_WORKER_ROLE"] == {"name": "PDSERVE_WORKER_ROLE", "value": "flex"}
    assert _by(objs, "PodDisruptionBudget", "pdserve-flex")["spec"]["selector"] == {
        "matchLabels": labels}
    text = json.dumps(objs)
    assert "pdserve-prefill" not in text and "pdserve-decode" not in text
    # (the NetworkPolicies still admit the autoscaler's label: no pod here carries it)
    assert not [o for o in objs if o["metadata"]["name"] == "pdserve-autoscaler"]
    # control: the cpu overlay, which it builds on, has both pools and the autoscaler
    for name in (*PD_WORKERS, "pdserve-autoscaler"):
        _by(cpu, "Deployment", name)

    def pod(dep: dict[str, Any]) -> dict[str, Any]:
        spec = json.loads(json.dumps(dep["spec"]["template"]["spec"]))
        (box,) = spec["containers"]
        box["env"] = sorted((e for e in box["env"] if e["name"] != "PDSERVE_WORKER_ROLE"),
                            key=lambda e: e["name"])
        return spec

    assert pod(flex) == pod(_by(cpu, "Deployment", "pdserve-prefill"))


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


# --- hardening: disruption budgets, network policies, non-root read-only pods, replicas -------

PDSERVE_UID = 10001  # the image's pdserve user (deploy/Dockerfile, deploy/Dockerfile.cuda)
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pdserve.json"
MODEL_JOB = ROOT / "deploy" / "k8s" / "base" / "model-download.yaml"


def _model_job(kind: str) -> dict[str, Any]:
    """The one object of ``kind`` in model-download.yaml (the Job and its NetworkPolicy)."""
    (obj,) = [d for d in yaml.safe_load_all(MODEL_JOB.read_text()) if d and d["kind"] == kind]
    return obj


def _workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _labels_selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and In/NotIn/Exists matchExpressions) against labels."""
    if not _matches(selector.get("matchLabels", {}), labels):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


NAMESPACE = "pdserve"
MONITORING = "monitoring"  # the namespace networkpolicy.yaml expects Prometheus in


def _ingress_allows(objs: list[dict[str, Any]], target: dict[str, str], source: dict[str, str],
                    namespace: str, port: str | None = None) -> bool:
    """Whether the render's NetworkPolicies let a pod labelled ``source`` in ``namespace`` reach
    one labelled ``target`` in ``pdserve`` (on the named ``port``; None = any). Unselected pods
    allow everything. A namespace carries only the label Kubernetes sets on every namespace,
    ``kubernetes.io/metadata.name``."""
    policies = [p for p in objs if p["kind"] == "NetworkPolicy"
                and _labels_selected(p["spec"]["podSelector"], target)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = {p.get("port") for p in rule.get("ports", [])}
            if rule.get("ports") and port not in ports:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                assert "ipBlock" not in peer, "ipBlock peers would bypass the label rules"
                if _peer_selects(peer, source, namespace):
                    return True
    return False


def _peer_selects(peer: dict[str, Any], labels: dict[str, str], namespace: str) -> bool:
    """Whether a NetworkPolicy peer's selectors pick a pod labelled ``labels`` in ``namespace``
    (which carries only the label Kubernetes sets on every namespace); a peer without a
    namespaceSelector picks pods of the policy's own namespace only."""
    if "namespaceSelector" in peer:  # {} = any namespace
        if not _labels_selected(peer["namespaceSelector"],
                                {"kubernetes.io/metadata.name": namespace}):
            return False
    elif namespace != NAMESPACE:
        return False
    return _labels_selected(peer.get("podSelector", {}), labels)


def test_every_workload_has_a_disruption_budget_selecting_exactly_it(
        rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {
        "pdserve-router", *WORKERS[overlay], *_autoscaler(overlay)}
    for dep in deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pdbs if _labels_selected(p["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{overlay}: {dep['metadata']['name']} has {len(mine)} PDBs"
        (pdb,) = mine
        # it selects this Deployment's pods and no other workload's
        others = [w for w in _workloads(objs) if w is not dep and _labels_selected(
            pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert others == [], f"{pdb['metadata']['name']} also selects {others}"
        # a budget that allows no eviction at all would block every node drain
        replicas = dep["spec"].get("replicas", 1)
        if "minAvailable" in pdb["spec"]:
            assert pdb["spec"]["minAvailable"] < replicas
        else:
            assert pdb["spec"]["maxUnavailable"] >= 1
    router_pdb = _by(objs, "PodDisruptionBudget", "pdserve-router")
    assert router_pdb["spec"] == {"minAvailable": 1, "selector": {
        "matchLabels": {"app.kubernetes.io/name": "pdserve-router"}}}


def test_two_router_replicas(rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    assert _by(objs, "Deployment", "pdserve-router")["spec"]["replicas"] == 2


ROUTER = {"app.kubernetes.io/name": "pdserve-router"}
AUTOSCALER = {"app.kubernetes.io/name": "pdserve-autoscaler"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
REDIS = {"app.kubernetes.io/name": "pdserve-redis"}
CLIENT = {"app": "curl"}


def test_workers_are_reachable_only_from_router_autoscaler_prometheus_and_workers(
        rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    roles = [_by(objs, "Deployment", name)["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/component"] for name in WORKERS[overlay]]
    for name in WORKERS[overlay]:
        pod = _by(objs, "Deployment", name)["spec"]["template"]
        labels = pod["metadata"]["labels"]
        covering = [p for p in objs if p["kind"] == "NetworkPolicy"
                    and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                    and _labels_selected(p["spec"]["podSelector"], labels)]
        assert covering, f"{overlay}: no NetworkPolicy covers {name}"
        for pol in covering:
            for rule in pol["spec"]["ingress"]:
                assert rule.get("from"), "a rule without `from` admits every pod"
                for peer in rule["from"]:
                    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] in {
                        "pdserve-router", "pdserve-autoscaler", "prometheus",
                        "pdserve-worker"}
        # allowed: the router and autoscaler (this namespace), Prometheus (the monitoring
        # namespace), on the HTTP port; other workers on any port (decode pulls KV over UCX)
        assert _ingress_allows(objs, labels, ROUTER, NAMESPACE, "http")
        assert _ingress_allows(objs, labels, AUTOSCALER, NAMESPACE, "http")
        assert _ingress_allows(objs, labels, PROMETHEUS, MONITORING, "http")
        for role in roles:
            peer = {"app.kubernetes.io/name": "pdserve-worker", "app.kubernetes.io/component": role}
            assert _ingress_allows(objs, labels, peer, NAMESPACE, None)
        # negative controls: anything else, the router on another port or namespace, and a
        # tenant's pod labelled like Prometheus outside the monitoring namespace (or in ours)
        for source, ns in ((CLIENT, NAMESPACE), (CLIENT, "tenant-a"), (REDIS, NAMESPACE),
                           (ROUTER, "tenant-a"), (AUTOSCALER, "tenant-a"),
                           ({"app.kubernetes.io/name": "grafana"}, MONITORING),
                           (PROMETHEUS, "tenant-a"), (PROMETHEUS, NAMESPACE),
                           (CLIENT, MONITORING)):
            assert not _ingress_allows(objs, labels, source, ns, "http"), (source, ns)
        assert not _ingress_allows(objs, labels, ROUTER, NAMESPACE, None)


def test_every_namespace_selector_is_pinned_to_a_named_namespace(
        rendered: tuple[str, list[dict]]) -> None:
    """A peer entry with a namespaceSelector also names the namespace and selects pods in the
    same entry (an empty selector, or the two in separate entries, admits any namespace)."""
    overlay, objs = rendered
    peers = [peer for p in objs if p["kind"] == "NetworkPolicy"
             for rule in p["spec"].get("ingress", []) for peer in rule.get("from", [])
             if "namespaceSelector" in peer]
    assert peers, f"{overlay}: Prometheus needs a peer outside this namespace"
    for peer in peers:
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": MONITORING}}, peer
        assert peer["podSelector"]["matchLabels"] == PROMETHEUS, peer


def test_redis_is_reachable_only_from_pdserve_pods(rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    for source in (ROUTER, AUTOSCALER, {"app.kubernetes.io/name": "pdserve-worker",
                                        "app.kubernetes.io/component": "decode"}):
        assert _ingress_allows(objs, REDIS, source, NAMESPACE, "redis"), source
    for source, ns in ((CLIENT, NAMESPACE), (PROMETHEUS, MONITORING), (ROUTER, "tenant-a")):
        assert not _ingress_allows(objs, REDIS, source, ns, "redis"), source


# --- secrets: required cluster secret, Redis password, no API token where none is needed ------

CLUSTER_SECRET = "pdserve-cluster"


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of an env value (a name defined earlier in the list)."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    assert "$(" not in value, f"unexpanded reference in {value!r}"
    return value


def test_cluster_secret_is_required_by_router_and_workers(
        rendered: tuple[str, list[dict]]) -> None:
    """Router, prefill and decode read the cluster secret from a file of a Secret that must
    exist (``optional: false``): a missing Secret keeps the pod from starting rather than
    starting it unsigned; no pdserve-cluster reference is optional but the client API keys."""
    overlay, objs = rendered
    for name in ("pdserve-router", *WORKERS[overlay]):
        pod = _by(objs, "Deployment", name)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert "PDSERVE_CLUSTER_SECRET" not in env  # the file wins; one source only
        path = Path(env["PDSERVE_CLUSTER_SECRET_FILE"]["value"])
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert mount["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == CLUSTER_SECRET
        assert secret["optional"] is False, (overlay, name)
        assert secret["items"] == [{"key": "secret", "path": path.name}]
        assert secret["defaultMode"] & 0o077 == 0o040  # the pdserve group (fsGroup) reads it
    for _, pod in _pod_specs(objs):
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] == CLUSTER_SECRET and ref["key"] != "api-keys":
                    assert ref.get("optional") is False, (overlay, c["name"], e["name"])


def test_redis_requires_the_password_every_client_sends(
        rendered: tuple[str, list[dict]]) -> None:
    """Redis starts with requirepass from the Secret (its probe authenticates too); router,
    workers and autoscaler build PDSERVE_REDIS_URL from the same key by ``$(VAR)`` expansion,
    and no command line overrides it with a URL without the password."""
    redis_connection = pytest.importorskip("redis.connection")
    overlay, objs = rendered
    pod = _by(objs, "StatefulSet", "pdserve-redis")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    script = " ".join(c.get("command", []) + c.get("args", []))
    assert "requirepass" in script and "protected-mode no" not in script
    env = {e["name"]: e for e in c["env"]}
    # redis-cli (the readiness probe) authenticates with REDISCLI_AUTH
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {
        "name": CLUSTER_SECRET, "key": "redis-password", "optional": False}
    assert "redis-cli" in " ".join(c["readinessProbe"]["exec"]["command"])
    password = "0123abcd" * 8  # what `openssl rand -hex 32` gives: URL-safe
    for name in ("pdserve-router", *_autoscaler(overlay), *WORKERS[overlay]):
        (c,) = _by(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        resolved: dict[str, str] = {}
        for e in c["env"]:  # in order: $(VAR) sees only the names defined before it
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref == {"name": CLUSTER_SECRET, "key": "redis-password", "optional": False}:
                resolved[e["name"]] = password
            elif "value" in e:
                resolved[e["name"]] = _expand(e["value"], resolved)
        url = redis_connection.parse_url(resolved["PDSERVE_REDIS_URL"])
        assert (url["host"], url["port"], url["password"]) == ("pdserve-redis", 6379, password)
        lines = [c.get("command", []), c.get("args", []),
                 c.get("readinessProbe", {}).get("exec", {}).get("command", []),
                 c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])]
        assert not [a for line in lines for a in line if "redis" in a and "://" in a], name


def test_only_the_autoscaler_mounts_a_service_account_token(
        rendered: tuple[str, list[dict]]) -> None:
    """Every pod but the autoscaler (which patches the scale subresource) opts out of the
    automounted token: a compromised worker, router or Redis gets no API credential."""
    overlay, objs = rendered
    pods = dict(_pod_specs(objs))
    assert set(pods) == {"pdserve-router", *WORKERS[overlay], *_autoscaler(overlay),
                         "pdserve-redis"}
    for name, pod in pods.items():
        if name == "pdserve-autoscaler":
            assert pod.get("automountServiceAccountToken", True) is True
            assert pod["serviceAccountName"] == "pdserve-autoscaler"
        else:
            assert pod.get("automountServiceAccountToken") is False, (overlay, name)
            assert "serviceAccountName" not in pod, name
    job = _model_job("Job")
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def _pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objs
            if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def _assert_hardened(name: str, pod: dict[str, Any]) -> None:
    sec = pod["securityContext"]
    assert sec["runAsNonRoot"] is True, name
    assert isinstance(sec["runAsUser"], int) and sec["runAsUser"] > 0, name
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}, name
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod.get("initContainers", []) + pod["containers"]:
        csec = c["securityContext"]
        assert csec["allowPrivilegeEscalation"] is False, (name, c["name"])
        assert csec["readOnlyRootFilesystem"] is True, (name, c["name"])
        assert csec["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
        if c["image"].startswith("pdserve"):
            assert sec["runAsUser"] == PDSERVE_UID, name
            # the read-only root needs a writable /tmp (drain marker, handshake, caches)
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]["name"]], name
            assert not mounts["/tmp"].get("readOnly", False)


def test_every_pod_runs_non_root_with_a_read_only_root(rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    pods = _pod_specs(objs)
    # router, the workers, the autoscaler where there is one, redis
    assert len(pods) == 2 + len(WORKERS[overlay]) + len(_autoscaler(overlay))
    for name, pod in pods:
        _assert_hardened(name, pod)
    # the workers' caches (HF, vLLM, torch) go to HOME, an emptyDir
    for name in WORKERS[overlay]:
        pod = _by(objs, "Deployment", name)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts[env["HOME"]]]
        assert env["HF_HOME"].startswith(env["HOME"] + "/")


def test_the_image_has_the_uid_the_pods_run_as() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        assert f"useradd --system --uid {PDSERVE_UID} " in text, dockerfile


def test_model_comes_from_the_volume_and_hf_token_from_a_secret(
        rendered: tuple[str, list[dict]]) -> None:
    overlay, objs = rendered
    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    for name in WORKERS[overlay]:
        (c,) = _by(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "pdserve-hf", "key": "token", "optional": True}
        model = env["PDSERVE_WORKER_MODEL"]["value"]
        if overlay in CPU_IMAGE:  # the tiny model built into the image; no claim to bind
            assert model == "/models/tiny"
            assert env["PDSERVE_WORKER_SERVED_MODEL_NAME"]["value"] == "tiny-llama"
            continue
        assert model.startswith("/mnt/models/")
    if overlay in CPU_IMAGE:
        assert claims == set()
        assert not [v for _, pod in _pod_specs(objs) for v in pod.get("volumes", [])
                    if "persistentVolumeClaim" in v]
        return
    assert claims == {"pdserve-models"}
    # workers load the model and routers tokenize with it: the same claim at the same path
    for name in (*WORKERS[overlay], "pdserve-router"):
        pod = _by(objs, "Deployment", name)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/mnt/models"]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["persistentVolumeClaim"] == {
            "claimName": "pdserve-models", "readOnly": True}


def test_model_download_job_validates_and_is_hardened() -> None:
    job = _model_job("Job")
    kv.validate(job, K8S_VERSION, strict=True)
    _assert_hardened(job["metadata"]["name"], job["spec"]["template"]["spec"])
    (vol,) = job["spec"]["template"]["spec"]["volumes"][:1]
    assert vol["persistentVolumeClaim"]["claimName"] == "pdserve-models"


def _datasources(node: Any) -> list[Any]:
    if isinstance(node, dict):
        found = [node["datasource"]] if "datasource" in node else []
        return found + [d for v in node.values() for d in _datasources(v)]
    if isinstance(node, list):
        return [d for v in node for d in _datasources(v)]
    return []


def test_grafana_dashboard_configmap_uses_a_datasource_variable(
        rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    cm = _by(objs, "ConfigMap", "pdserve-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["pdserve.json"] == DASHBOARD.read_text()
    dash = json.loads(cm["data"]["pdserve.json"])
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    uses = _datasources(dash["panels"])
    assert len(uses) >= len(dash["panels"])  # every panel names its data source ...
    assert {json.dumps(d, sort_keys=True) for d in uses} == {  # ... and only the variable
        json.dumps({"type": "prometheus", "uid": "${datasource}"}, sort_keys=True)}
    assert "pdserve-prometheus" not in cm["data"]["pdserve.json"]


# --- Pod Security Admission `restricted`, egress (security review finding 22) -------------------

RESTRICTED = {f"pod-security.kubernetes.io/{mode}": "restricted"
              for mode in ("enforce", "audit", "warn")}
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in ``pod`` (a pod spec) the Pod Security Standards' ``restricted`` profile refuses,
    baseline's rules included, as the Kubernetes 1.33 page lists them; [] = admitted. (No API
    server here to ask: kubectl is a client only.)"""
    out: list[str] = []
    psc = pod.get("securityContext", {})
    out += [key for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    out += [f"sysctl {x['name']}" for x in psc.get("sysctls", []) if x["name"] not in SAFE_SYSCTLS]
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    containers = [*pod.get("initContainers", []), *pod["containers"],
                  *pod.get("ephemeralContainers", [])]
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        for ctx, where in ((psc, "pod"), (sc, name)):
            if ctx.get("windowsOptions", {}).get("hostProcess"):
                out.append(f"{where}: hostProcess")
            selinux = ctx.get("seLinuxOptions", {})
            if selinux.get("type", "") not in SELINUX_TYPES or "user" in selinux \
                    or "role" in selinux:
                out.append(f"{where}: seLinuxOptions {selinux}")
            if ctx.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in (
                    "RuntimeDefault", "Localhost"):
                out.append(f"{where}: appArmorProfile")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added {caps['add']}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile") or psc.get("seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp.get('type')}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


def test_the_namespace_enforces_the_restricted_pod_security_profile(
        rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    labels = _by(objs, "Namespace", NAMESPACE)["metadata"].get("labels", {})
    assert {k: v for k, v in labels.items() if k.startswith("pod-security.")} == RESTRICTED


def test_every_pod_meets_the_restricted_pod_security_profile(
        rendered: tuple[str, list[dict]]) -> None:
    """Every pod of the render, and the model download Job (applied into the same namespace),
    would be admitted under ``enforce: restricted``."""
    overlay, objs = rendered
    pods = [*_pod_specs(objs), ("pdserve-model-download",
                                _model_job("Job")["spec"]["template"]["spec"])]
    assert len(pods) == 3 + len(WORKERS[overlay]) + len(_autoscaler(overlay))
    for name, pod in pods:
        assert _restricted_violations(pod) == [], (overlay, name)


@functools.cache
def _router_pod_json() -> str:
    return json.dumps(_by(_kustomize("cpu"), "Deployment", "pdserve-router")
                      ["spec"]["template"]["spec"])


@pytest.mark.parametrize(("change", "expected"), [
    (lambda p: p["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    (lambda p: p["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile"),
    (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_PTRACE"]),
     "capabilities added"),
    (lambda p: p["containers"][0]["securityContext"].update(capabilities={}),
     "capabilities not dropped"),
    (lambda p: p["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "hostPath"),
    (lambda p: p.update(hostNetwork=True), "hostNetwork"),
    (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    (lambda p: p["containers"][0]["securityContext"].update(runAsUser=0), "runAsUser 0"),
    (lambda p: p["containers"][0]["ports"].append({"containerPort": 80, "hostPort": 80}),
     "hostPort"),
])
def test_control_the_profile_check_refuses_what_restricted_refuses(change: Any,
                                                                   expected: str) -> None:
    """Negative controls of the check above: the router's pod with one thing `restricted`
    refuses is refused, naming it."""
    pod = json.loads(_router_pod_json())
    assert _restricted_violations(pod) == []
    change(pod)
    assert any(expected in v for v in _restricted_violations(pod)), _restricted_violations(pod)


METADATA_IP = "169.254.169.254"
PUBLIC_IP = "93.184.215.14"
API_SERVER_IPS = ("10.96.0.1", "172.18.0.2", "192.168.49.2")  # Service VIP, kind, minikube
KUBE_DNS = {"k8s-app": "kube-dns"}
WORKER_PORTS = {"http": 8100}
POD_PORTS = {"pdserve-router": {"http": 8000}, "pdserve-worker": WORKER_PORTS,
             "pdserve-redis": {"redis": 6379}, "pdserve-autoscaler": {"metrics": 9400}}


def _egress_policies(objs: list[dict[str, Any]], source: dict[str, str]) -> list[dict[str, Any]]:
    return [p for p in objs if p["kind"] == "NetworkPolicy"
            and "Egress" in p["spec"].get("policyTypes", [])
            and _labels_selected(p["spec"]["podSelector"], source)]


def _port_matches(rule: dict[str, Any], port: int, protocol: str,
                  named: dict[str, int]) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None or want == port or named.get(str(want)) == port:
            return True
    return False


def _in_block(ip: str, block: dict[str, Any]) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    if addr not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(addr in ipaddress.ip_network(e) for e in block.get("except", []))


def _egress_allows(objs: list[dict[str, Any]], source: dict[str, str], port: int,
                   protocol: str = "TCP", *, to_pod: dict[str, str] | None = None,
                   namespace: str = NAMESPACE, to_ip: str | None = None) -> bool:
    """Whether the NetworkPolicies in ``objs`` let a pod labelled ``source`` (in ``pdserve``)
    open ``protocol``/``port`` to a pod labelled ``to_pod`` in ``namespace`` (its named ports:
    :data:`POD_PORTS`) or to the address ``to_ip`` (not a pod). An ipBlock is matched against
    addresses only, pod selectors against pods only. Unselected pods allow everything."""
    policies = _egress_policies(objs, source)
    if not policies:
        return True
    named = POD_PORTS.get((to_pod or {}).get("app.kubernetes.io/name", ""), {})
    for pol in policies:
        for rule in pol["spec"].get("egress", []):
            if not _port_matches(rule, port, protocol, named):
                continue
            if "to" not in rule:
                return True
            for peer in rule["to"]:
                if "ipBlock" in peer:
                    if to_ip is not None and _in_block(to_ip, peer["ipBlock"]):
                        return True
                    continue
                if to_pod is not None and _peer_selects(peer, to_pod, namespace):
                    return True
    return False


def test_egress_is_denied_by_default_and_allowed_where_each_component_connects(
        rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    deny = _by(objs, "NetworkPolicy", "pdserve-default-deny-egress")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Egress"]}
    worker = {"app.kubernetes.io/name": "pdserve-worker"}
    prefill, decode = ({**worker, "app.kubernetes.io/component": r} for r in ("prefill", "decode"))
    sources = {"router": ROUTER, "prefill": prefill, "decode": decode, "redis": REDIS,
               "autoscaler": AUTOSCALER}
    for name, source in sources.items():
        # every pod resolves names, on the cluster DNS only
        for proto in ("UDP", "TCP"):
            assert _egress_allows(objs, source, 53, proto, to_pod=KUBE_DNS,
                                  namespace="kube-system"), name
        assert not _egress_allows(objs, source, 53, "UDP", to_pod=KUBE_DNS,
                                  namespace="tenant-a"), name
        assert not _egress_allows(objs, source, 53, "UDP", to_ip="8.8.8.8"), name
        # nothing reaches the cloud metadata endpoint or the internet
        for port in (80, 443):
            assert not _egress_allows(objs, source, port, to_ip=METADATA_IP), name
            assert not _egress_allows(objs, source, port, to_ip=PUBLIC_IP), name
        assert not _egress_allows(objs, source, 8000, to_pod=CLIENT), name
    allowed = [
        (ROUTER, REDIS, 6379), (ROUTER, prefill, 8100), (ROUTER, decode, 8100),
        (prefill, REDIS, 6379), (decode, REDIS, 6379),
        (decode, prefill, 41234), (prefill, decode, 41234), (decode, prefill, 8100),
        (AUTOSCALER, REDIS, 6379), (AUTOSCALER, ROUTER, 8000), (AUTOSCALER, prefill, 8100),
        (AUTOSCALER, decode, 8100),
    ]
    for source, dest, port in allowed:
        assert _egress_allows(objs, source, port, to_pod=dest), (source, dest, port)
    refused = [
        (ROUTER, prefill, 41234), (ROUTER, AUTOSCALER, 9400), (ROUTER, ROUTER, 8000),
        (prefill, ROUTER, 8000), (decode, AUTOSCALER, 9400), (REDIS, prefill, 8100),
        (REDIS, REDIS, 6379), (AUTOSCALER, prefill, 41234),
        (ROUTER, REDIS, 6379, "tenant-a"), (prefill, prefill, 8100, "tenant-a"),
    ]
    for source, dest, port, *ns in refused:
        assert not _egress_allows(objs, source, port, to_pod=dest,
                                  namespace=ns[0] if ns else NAMESPACE), (source, dest, port, ns)
    # the API server (an address, not a pod): the autoscaler only
    for ip in API_SERVER_IPS:
        for port in (443, 6443):
            assert _egress_allows(objs, AUTOSCALER, port, to_ip=ip), ip
        for source in (ROUTER, prefill, decode, REDIS):
            assert not _egress_allows(objs, source, 443, to_ip=ip), (source, ip)


def test_no_egress_rule_opens_everywhere_or_the_metadata_endpoint(
        rendered: tuple[str, list[dict]]) -> None:
    """No rule without a destination, no /0 block, and no block that holds 169.254.169.254
    (unless excepted)."""
    import ipaddress

    _, objs = rendered
    rules = [r for p in objs if p["kind"] == "NetworkPolicy"
             for r in p["spec"].get("egress", [])]
    assert rules
    for rule in rules:
        assert rule.get("to"), f"an egress rule without `to` reaches every address: {rule}"
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None:
                continue
            assert ipaddress.ip_network(block["cidr"]).prefixlen > 0, block
            assert not _in_block(METADATA_IP, block), block
            assert not _in_block("fd00:ec2::254", block), block  # AWS's IPv6 metadata


def test_the_model_download_job_reaches_public_https_only() -> None:
    """Its own policy (in its file, applied with it) opens HTTPS on public addresses to the
    Job's pods only: never the metadata endpoints, private ranges or other ports."""
    pol = _model_job("NetworkPolicy")
    kv.validate(pol, K8S_VERSION, strict=True)
    job_pod = _model_job("Job")["spec"]["template"]["metadata"]["labels"]
    assert _labels_selected(pol["spec"]["podSelector"], job_pod)
    for other in (ROUTER, REDIS, AUTOSCALER, {"app.kubernetes.io/name": "pdserve-worker"}):
        assert not _labels_selected(pol["spec"]["podSelector"], other)
    assert _egress_allows([pol], job_pod, 443, to_ip=PUBLIC_IP)
    assert not _egress_allows([pol], job_pod, 80, to_ip=PUBLIC_IP)
    for ip in (METADATA_IP, "100.100.100.200", "10.0.0.1", "172.16.5.4", "192.168.1.1",
               "127.0.0.1"):
        assert not _egress_allows([pol], job_pod, 443, to_ip=ip), ip
