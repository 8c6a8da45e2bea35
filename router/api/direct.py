"""The OpenAI POST endpoints answered ahead of FastAPI's own layers.

A request to ``/v1/completions`` or ``/v1/chat/completions`` went through FastAPI's exception
middleware, its exit-stack middleware, the router's route matching, the endpoint's dependency
solving and a wrapper per layer around every body chunk sent: about a tenth of the router's CPU
per streamed request, for an endpoint that takes the raw request and catches its own errors
(``RouterService.handle``). :class:`DirectRoutes` sits inside the user middleware (request id,
API keys, limits: they all still apply) and hands those two paths to their handler; anything
else (other methods, other paths, a trailing slash) goes on to FastAPI, where the same
endpoints stay registered.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    """ASGI middleware: ``POST`` to a path of ``routes`` is answered by its handler."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            handler = self.routes.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
