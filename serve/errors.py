"""serve's exception tree.

::

    ServeError
    └── StartupError    `pdserve up` cannot start; the message names the cause in one line

Third-party and OS errors met while starting are wrapped with ``raise ... from exc``.
"""

from __future__ import annotations


class ServeError(Exception):
    """Root of every exception serve raises on purpose."""


class StartupError(ServeError):
    """The local cluster cannot start (bad setting, busy port, missing model, a child that died
    during start-up); nothing it started is left running."""
