"""The router's HTTP layer: app factory, OpenAI schemas, error handler, P/D proxy."""

from router.api.app import create_app

__all__ = ["create_app"]
