"""What the compose actuator creates and removes to resize a service (pure: no Docker I/O).

Compose identifies a service's replicas by labels (``com.docker.compose.project``,
``.service``, ``.container-number``, ``.oneoff``) and names them
``<project>_<service>_<n>`` (docker-compose 1.x) or ``<project>-<service>-<n>`` (Compose v2).
A scale-up adds replicas numbered after the highest number in use (stopped ones included, as
their names are taken); a scale-down removes the running replicas with the highest numbers,
as ``docker compose up --scale`` does. A service never goes below one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROJECT = "com.docker.compose.project"
SERVICE = "com.docker.compose.service"
NUMBER = "com.docker.compose.container-number"
ONEOFF = "com.docker.compose.oneoff"

# Config fields of a container inspection that belong to the one container, not its service.
_PER_CONTAINER = ("Hostname", "Domainname", "MacAddress")


@dataclass(frozen=True)
class Replica:
    """One container of a compose service."""

    id: str
    name: str
    number: int
    running: bool


@dataclass(frozen=True)
class ScalePlan:
    """Replicas to create (number, container name) and to remove (drained first)."""

    create: list[tuple[int, str]] = field(default_factory=list)
    remove: list[Replica] = field(default_factory=list)


def replicas_from(containers: list[dict[str, Any]], project: str, service: str) -> list[Replica]:
    """The service's replicas among container inspections (``docker inspect`` shape), by
    number; one-off containers (``compose run``) are not replicas."""
    out = []
    for c in containers:
        labels = c.get("Config", {}).get("Labels") or {}
        if (labels.get(PROJECT) != project or labels.get(SERVICE) != service
                or labels.get(ONEOFF, "False") == "True" or NUMBER not in labels):
            continue
        out.append(Replica(id=c["Id"], name=c.get("Name", "").lstrip("/"),
                           number=int(labels[NUMBER]),
                           running=bool(c.get("State", {}).get("Running"))))
    return sorted(out, key=lambda r: r.number)


def container_name(project: str, service: str, number: int, like: str = "") -> str:
    """The name compose gives replica ``number``: in the style of the existing name ``like``
    (``_`` for docker-compose 1.x, ``-`` for Compose v2; v2 when there is none)."""
    sep = "_" if like.startswith(f"{project}_{service}_") else "-"
    return f"{project}{sep}{service}{sep}{number}"


def plan_scale(project: str, service: str, replicas: list[Replica], desired: int) -> ScalePlan:
    """Creations and removals that leave ``max(desired, 1)`` running replicas."""
    want = max(desired, 1)
    running = [r for r in replicas if r.running]
    if want > len(running):
        top = max((r.number for r in replicas), default=0)
        like = replicas[0].name if replicas else ""
        return ScalePlan(create=[(n, container_name(project, service, n, like))
                                 for n in range(top + 1, top + 1 + want - len(running))])
    if want < len(running):
        return ScalePlan(remove=sorted(running, key=lambda r: -r.number)[:len(running) - want])
    return ScalePlan()


def clone_config(template: dict[str, Any], service: str, number: int, name: str
                 ) -> dict[str, Any]:
    """The ``POST /containers/create`` body of a new replica, cloned from the inspection of an
    existing one: same image, command, environment, healthcheck and host config; the new
    container number; on the template's primary network (its ``NetworkMode``), with the
    service name as alias (DNS and Prometheus' DNS discovery find the replica under it) and
    its own name. Other networks: :func:`other_networks` (an engine before API 1.44 takes one
    network at create)."""
    config = {k: v for k, v in template["Config"].items() if k not in _PER_CONTAINER}
    config["Labels"] = {**(config.get("Labels") or {}), NUMBER: str(number)}
    config["HostConfig"] = dict(template["HostConfig"])
    primary = template["HostConfig"].get("NetworkMode", "")
    if primary in (template.get("NetworkSettings", {}).get("Networks") or {}):
        config["NetworkingConfig"] = {"EndpointsConfig": {primary: aliases(service, name)}}
    return config


def aliases(service: str, name: str) -> dict[str, list[str]]:
    """Endpoint config of a replica on a compose network."""
    return {"Aliases": [service, name]}


def other_networks(template: dict[str, Any]) -> list[str]:
    """The template's networks besides its primary one (joined after create)."""
    primary = template["HostConfig"].get("NetworkMode", "")
    return [n for n in template.get("NetworkSettings", {}).get("Networks") or {} if n != primary]
