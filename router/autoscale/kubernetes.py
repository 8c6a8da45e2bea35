"""Kubernetes actuator: desired replica counts -> the scale subresource of the worker Deployments.

The planner decides; this module only writes ``spec.replicas`` of the prefill or decode
Deployment with one request::

    PATCH /apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale?fieldManager=...
    Content-Type: application/merge-patch+json
    {"spec": {"replicas": N}}

and reads the current count with ``GET .../scale``. That is all the autoscaler's RBAC grants
(``get``/``patch`` on ``deployments/scale`` of the two named Deployments, see
``deploy/k8s/base/autoscaler.yaml``). A merge patch of the Scale object names no other field,
so it never fights a GitOps tool or ``kubectl apply`` over anything but the replica count.

Parameters (defaults) are the fields of :class:`KubernetesActuatorConfig`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.autoscale.planner import Decision, Pool
from router.errors import ConfigError, RouterError

if TYPE_CHECKING:
    from kubernetes.client import AppsV1Api

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
SCALE_PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"


class KubernetesActuatorError(RouterError):
    """The API server refused or failed a scale read/write (wraps the client's exception)."""


@dataclass(frozen=True)
class KubernetesActuatorConfig:
    """Where the two worker pools live; names match ``deploy/k8s/base``."""

    namespace: str = "pdserve"
    """Namespace of the worker Deployments."""
    prefill_deployment: str = "pdserve-prefill"
    """Deployment of the prefill pool."""
    decode_deployment: str = "pdserve-decode"
    """Deployment of the decode pool."""
    field_manager: str = "pdserve-autoscaler"
    """``fieldManager`` recorded by the API server for the replica field."""
    request_timeout_s: float = 10.0
    """Timeout of each API call."""
    conflict_retries: int = 2
    """Times a PATCH answered 409 Conflict is sent again before giving up."""

    def __post_init__(self) -> None:
        for name in ("namespace", "prefill_deployment", "decode_deployment", "field_manager"):
            if not getattr(self, name):
                raise ConfigError(f"{name} must not be empty")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.conflict_retries < 0:
            raise ConfigError(f"conflict_retries must be >= 0, got {self.conflict_retries}")

    def deployment(self, pool: Pool) -> str:
        """The Deployment that runs ``pool``."""
        if pool == "prefill":
            return self.prefill_deployment
        if pool == "decode":
            return self.decode_deployment
        raise ConfigError(f"unknown pool {pool!r}; allowed: prefill, decode")


@dataclass(frozen=True)
class ScaleRequest:
    """The exact HTTP request that sets one pool's replica count (pure description)."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    content_type: str
    body: dict[str, Any]

    def body_json(self) -> str:
        return json.dumps(self.body)


def scale_request(config: KubernetesActuatorConfig, pool: Pool, replicas: int) -> ScaleRequest:
    """Build the scale-subresource PATCH that sets ``pool`` to ``replicas``."""
    if replicas < 0:
        raise ConfigError(f"replicas must be >= 0, got {replicas}")
    return ScaleRequest(
        method="PATCH",
        path=SCALE_PATH.format(namespace=config.namespace, name=config.deployment(pool)),
        query=(("fieldManager", config.field_manager),),
        content_type=MERGE_PATCH,
        body={"spec": {"replicas": int(replicas)}},
    )


def load_apps_api() -> AppsV1Api:
    """An ``AppsV1Api`` from the pod's service account, else from the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise KubernetesActuatorError(
                "no in-cluster service account and no usable kubeconfig") from exc
    return client.AppsV1Api()


class KubernetesActuator:
    """Applies planner decisions to the two worker Deployments through their scale subresource."""

    def __init__(self, config: KubernetesActuatorConfig | None = None,
                 api: AppsV1Api | None = None) -> None:
        self.config = config or KubernetesActuatorConfig()
        self._api = api

    @property
    def api(self) -> AppsV1Api:
        if self._api is None:
            self._api = load_apps_api()
        return self._api

    def current_replicas(self, pool: Pool) -> int:
        """``spec.replicas`` of the pool's Deployment, read through ``GET .../scale``."""
        from kubernetes.client.exceptions import ApiException

        try:
            scale = self.api.read_namespaced_deployment_scale(
                self.config.deployment(pool), self.config.namespace,
                _request_timeout=self.config.request_timeout_s)
        except ApiException as exc:
            raise KubernetesActuatorError(
                f"reading scale of {self.config.deployment(pool)}: {exc.status} {exc.reason}"
            ) from exc
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def set_replicas(self, pool: Pool, replicas: int) -> int:
        """Send the PATCH of :func:`scale_request`; returns the replicas the server accepted."""
        from kubernetes.client.exceptions import ApiException

        req = scale_request(self.config, pool, replicas)
        attempt = 0
        while True:
            try:
                scale = self.api.patch_namespaced_deployment_scale(
                    self.config.deployment(pool), self.config.namespace, req.body,
                    field_manager=self.config.field_manager,
                    # The client would otherwise pick json-patch (its first JSON type) and then
                    # rewrite an object body to strategic-merge; say what we send.
                    _content_type=req.content_type,
                    _request_timeout=self.config.request_timeout_s)
                break
            except ApiException as exc:
                # A merge patch names no resourceVersion, so a 409 is another writer's update
                # landing at the same moment: the same absolute count is safe to send again.
                if exc.status == 409 and attempt < self.config.conflict_retries:
                    attempt += 1
                    logger.warning("conflict scaling %s; retry %d", self.config.deployment(pool),
                                   attempt)
                    continue
                hint = (" (RBAC: the autoscaler's Role must allow patch on deployments/scale "
                        "of this Deployment)" if exc.status == 403 else "")
                raise KubernetesActuatorError(
                    f"scaling {self.config.deployment(pool)} to {replicas}: "
                    f"{exc.status} {exc.reason}{hint}") from exc
        accepted = int(scale.spec.replicas or 0) if scale.spec else 0
        logger.info("scaled %s/%s to %d replicas", self.config.namespace,
                    self.config.deployment(pool), accepted)
        return accepted

    def apply(self, decisions: Iterable[Decision]) -> dict[str, int]:
        """Patch every pool whose desired count differs from its current one.

        Returns the replica counts written, by pool; unchanged pools send nothing.
        """
        written: dict[str, int] = {}
        for decision in decisions:
            if decision.desired == decision.current:
                continue
            written[decision.pool] = self.set_replicas(decision.pool, decision.desired)
        return written
