"""A plain vLLM server (no KV connector) on a free loopback port: the reference outputs that
P/D serving must equal (`pdserve chaos` and the tests compare against it)."""

from __future__ import annotations

import subprocess

from serve.redis_server import free_port
from serve.worker import vllm_command, vllm_env

KV_CACHE_GIB = 1.0
"""The reference serves one request at a time: the smallest KV cache."""


def start_plain_vllm(model: str, served_name: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``vllm serve model`` without a connector; returns the process and its URL (not yet
    healthy: await ``serve.worker.wait_healthy``, stop with ``serve.worker.stop_process``)."""
    port = free_port()
    proc = subprocess.Popen(vllm_command(model, "127.0.0.1", port, served_name, None, None),
                            env=vllm_env(KV_CACHE_GIB), start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"
