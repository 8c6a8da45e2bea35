"""A local stand-in for the Kubernetes API server, limited to the Deployment scale subresource.

No real API server can run on the test machines (no cluster, no etcd), so the autoscaler's
Kubernetes actuator is exercised against this one over real HTTP. It implements what the
actuator relies on and checks every request the way the API server would:

- ``GET``/``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``, anything else 404;
- bearer-token authentication (401 ``Unauthorized``);
- RBAC: ``(verb, deployment)`` pairs outside ``allowed`` get 403 ``Forbidden`` with the API
  server's message;
- ``PATCH`` only as ``application/merge-patch+json`` (415 otherwise) with a body of exactly
  ``{"spec": {"replicas": N}}``, N >= 0 (422 ``Invalid`` otherwise);
- ``conflicts``: the next N writes answer 409 ``Conflict`` (an optimistic-concurrency clash);
- answers are ``autoscaling/v1`` ``Scale`` objects or ``v1`` ``Status`` objects.

Every request is recorded (method, path, query, headers, body, the status answered).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
SERVICE_ACCOUNT = "system:serviceaccount:pdserve:pdserve-autoscaler"


@dataclass(frozen=True)
class Seen:
    """One request as the server received it, and the status it answered."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    status: int


@dataclass
class FakeScaleApi:
    """The server's state: replicas per deployment of one namespace, who may do what."""

    token: str
    namespace: str = "pdserve"
    replicas: dict[str, int] = field(default_factory=lambda: {"pdserve-prefill": 1,
                                                              "pdserve-decode": 1})
    allowed: set[tuple[str, str]] = field(default_factory=lambda: {
        (verb, name) for verb in ("get", "patch")
        for name in ("pdserve-prefill", "pdserve-decode")})
    conflicts: int = 0
    seen: list[Seen] = field(default_factory=list)
    _version: int = 1
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeScaleApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                api._handle(self, "get")

            def do_PATCH(self) -> None:  # noqa: N802
                api._handle(self, "patch")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _scale(self, name: str) -> dict[str, Any]:
        n = self.replicas[name]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace,
                             "resourceVersion": str(self._version)},
                "spec": {"replicas": n}, "status": {"replicas": n}}

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "message": message, "reason": reason, "code": code}

    def _handle(self, req: BaseHTTPRequestHandler, verb: str) -> None:
        parts = urlsplit(req.path)
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in req.headers.items()}
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        with self._lock:
            status, answer = self._answer(verb, parts.path, headers, body)
            self.seen.append(Seen(verb.upper(), parts.path, dict(parse_qsl(parts.query)),
                                  headers, body, status))
        data = json.dumps(answer).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _answer(self, verb: str, path: str, headers: dict[str, str], body: Any
                ) -> tuple[int, dict[str, Any]]:
        if headers.get("authorization") != f"Bearer {self.token}":
            return 401, self._status(401, "Unauthorized", "Unauthorized")
        match = SCALE.match(path)
        if match is None or match.group(1) != self.namespace:
            return 404, self._status(404, "NotFound", f"the server could not find {path}")
        name = match.group(2)
        if (verb, name) not in self.allowed:
            return 403, self._status(
                403, "Forbidden",
                f'deployments.apps "{name}" is forbidden: User "{SERVICE_ACCOUNT}" cannot '
                f'{verb} resource "deployments/scale" in API group "apps" in the namespace '
                f'"{self.namespace}"')
        if name not in self.replicas:
            return 404, self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "get":
            return 200, self._scale(name)
        if headers.get("content-type", "").split(";")[0] != "application/merge-patch+json":
            return 415, self._status(415, "UnsupportedMediaType",
                                     f"the body of the request was in an unknown format: "
                                     f"{headers.get('content-type')}")
        replicas = body.get("spec", {}).get("replicas") if isinstance(body, dict) else None
        if (not isinstance(body, dict) or set(body) != {"spec"} or set(body["spec"]) !=
                {"replicas"} or not isinstance(replicas, int) or replicas < 0):
            return 422, self._status(422, "Invalid", f"Scale.autoscaling {name!r} is invalid")
        if self.conflicts > 0:
            self.conflicts -= 1
            return 409, self._status(
                409, "Conflict", f'Operation cannot be fulfilled on deployments.apps "{name}": '
                "the object has been modified; please apply your changes to the latest "
                "version and try again")
        self.replicas[name] = replicas
        self._version += 1
        return 200, self._scale(name)
