"""What `pdserve up` checks before it starts anything (Redis, a worker, the router).

Each check raises :class:`~serve.errors.StartupError` with a one-line cause, so a mistake costs
a second, not a minute of vLLM start-up followed by a traceback.
"""

from __future__ import annotations

import errno
import os
import re

from serve.errors import StartupError
from serve.listener import bound_socket

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: a Hugging Face model id (vLLM downloads it or finds it in the HF cache)."""


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` as the router will (:func:`serve.listener.bound_socket`); refuse
    when something holds it."""
    try:
        bound_socket(host, port).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is already in use; pick another with "
                               "--port (or PDSERVE_PORT)") from exc
        raise StartupError(f"cannot bind the router to {host}:{port}: "
                           f"{exc.strerror or exc}") from exc


def check_model(model: str | None) -> None:
    """A local model must exist; ``org/name`` passes as a Hugging Face id; None is the tiny
    model, built on first use."""
    if model is None or os.path.exists(os.path.expanduser(model)):
        return
    if _HF_ID.match(model) and not model.startswith(("./", "../")):
        return
    raise StartupError(f"model {model!r} is neither an existing path nor a Hugging Face id "
                       "(org/name); pass --model DIR, or leave it out for the tiny model")


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (as :func:`check_port_free` binds it)."""
    try:
        check_port_free(host, port)
    except StartupError:
        return False
    return True


def check_policies(policy: str, decode_policy: str | None) -> None:
    """The router's placement policies must be registered names (router.policy.registry)."""
    from router.policy.registry import DECODE_POLICIES, PREFILL_POLICIES

    if policy not in PREFILL_POLICIES:
        raise StartupError(f"unknown --policy {policy!r}; allowed: "
                           f"{', '.join(sorted(PREFILL_POLICIES))}")
    if decode_policy is not None and decode_policy not in DECODE_POLICIES:
        raise StartupError(f"unknown --decode-policy {decode_policy!r}; allowed: "
                           f"{', '.join(sorted(DECODE_POLICIES))}")
