"""bench.cli.server_info against a real HTTP server that wants a bearer token (as a pdserve
worker's vLLM does): with the key it learns the model's context length, which `bench profile`
uses to skip prompt lengths the server would refuse."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.cli import server_info

KEY = "worker-key"


class _Models(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"data": [{"id": "m", "root": "/models/m",
                                     "max_model_len": 2048}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def keyed_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_key_opens_the_model_listing(keyed_url: str) -> None:
    info = server_info(keyed_url, "m", api_key=KEY)
    assert (info.model, info.root, info.max_model_len) == ("m", "/models/m", 2048)
    # control: without the key the listing is refused and nothing but the name is known
    assert server_info(keyed_url, "m").max_model_len is None
