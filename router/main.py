"""``python -m router.main``: run the router under uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import sys

from router.api.context import RequestContextFilter
from router.config import RouterSettings, load
from router.errors import ConfigError
from router.state.registry import redacted_url

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(role)s [%(request_id)s] %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestContextFilter("router"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    quiet_http_clients()


def quiet_http_clients() -> None:
    """httpx logs every request at INFO: the load and health polls would bury the lines that
    matter (two a second per worker). Their failures still surface through our own logs."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load(argv)
    except ConfigError as exc:
        print(f"pdserve-router: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    serve(settings)
    return 0


def serve(settings: RouterSettings) -> None:
    """Serve the router app for ``settings`` under uvicorn until it is told to stop: on the
    inherited listening socket ``settings.listen_fd`` when there is one, else on host:port."""
    import uvicorn

    # one prompt per encode: rayon's thread pool would only add threads to the router's core
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from router.api.app import create_app
    from router.http_protocol import SlowClientLimits, protocol_class

    app = create_app(settings, settle_heap=True)
    closed = app.state.router.metrics.connections_closed
    limits = SlowClientLimits(header_timeout_s=settings.header_timeout_s,
                              body_timeout_s=settings.body_timeout_s,
                              on_close=lambda reason: closed.labels(reason=reason).inc())
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level.lower(), access_log=False,
                            http=protocol_class(limits),
                            limit_concurrency=settings.max_connections or None)
    # a socket someone else bound and keeps (pdserve up; its family comes from the fd), else
    # uvicorn binds host:port itself
    sockets = None if settings.listen_fd < 0 else [socket.socket(fileno=settings.listen_fd)]
    where = sockets[0].getsockname() if sockets else f"http://{settings.host}:{settings.port}"
    logger.info("router listening on %s (redis %s)", where, redacted_url(settings.redis_url))
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    raise SystemExit(main())
