"""Per-key ``cache_salt`` (``--cache-salt-per-key``; security review row 10).

vLLM mixes a request's ``cache_salt`` into the hash of its first KV block, so requests under
different salts never share prefix-cache blocks: one tenant cannot learn from its time to
first token whether another tenant sent a prompt (a prefix-cache timing side channel), and a
pulled or offloaded block is never served under another salt. With the option on, the router
sets ``cache_salt`` on every request of an API key, from the key, before anything is routed;
every call a worker receives for it (prefill, decode, an aggregated or whole request, a
first-token continuation, a moved stream, a retry) carries the body it was given, so the same
salt. The router's own prefix hashes (``router.policy.hashing.salt_seed``) follow the salt, so
its cache model never places, or reports on ``/workers?prompt=``, one key's prompt as
another's prefix.

The salt: HMAC-SHA256 of the key under the cluster secret (domain ``pdserve-cache-salt``), or
SHA-256 of it under that domain without a secret; hex, never the key. Rotating the secret
changes every salt once (cached prefixes are recomputed, nothing else). A salt the client
sent is kept inside its key's space, never used alone: the router sends SHA-256 of the key's
salt and the client's, so a client may split its own cache further (vLLM's per-user use of
the field) but cannot name another key's salt. The client's salt is checked with vLLM's rule
first (400 ``invalid_value`` otherwise, as vLLM would answer). Requests that present no key
(the router has no ``--api-key``) are left as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from typing import Any

from kvtransfer.signing import Keyring, KeyringFile, current
from router.errors import InvalidRequestError

FIELD = "cache_salt"
DOMAIN = b"pdserve-cache-salt"
MAX_LENGTH = 128
"""vLLM 0.32's longest ``cache_salt`` (``validate_cache_salt``)."""
FORBIDDEN = frozenset("@/\\\x00")
"""Characters vLLM 0.32 refuses in a ``cache_salt``."""


def check_client_salt(salt: object) -> str | None:
    """The client's ``cache_salt`` if it gave one vLLM accepts; 400 otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_LENGTH or \
            any(c in FORBIDDEN for c in salt):
        raise InvalidRequestError(
            f"'cache_salt' must be a non-empty string of at most {MAX_LENGTH} characters "
            "without '@', '/', '\\' or NUL", code="invalid_value", param=FIELD)
    return salt


class KeySalts:
    """Derives each API key's salt and puts it in request bodies."""

    def __init__(self, keyring: Keyring | KeyringFile | None) -> None:
        self.keyring = keyring
        """The cluster keyring (None: salts are unkeyed hashes of the API key)."""

    def of_key(self, key: str) -> str:
        """The salt of API key ``key`` (hex, 64 characters)."""
        keyring = current(self.keyring)
        if keyring is not None:
            return keyring.mac(DOMAIN, key.encode())
        return hashlib.sha256(DOMAIN + b"\n" + key.encode()).hexdigest()

    def apply(self, body: MutableMapping[str, Any], key: str | None) -> None:
        """Set ``body``'s ``cache_salt`` for ``key`` (None: left as it is), combined with a
        salt the client sent."""
        if key is None:
            return
        salt = self.of_key(key)
        client = check_client_salt(body.get(FIELD))
        if client is not None:
            salt = hashlib.sha256(f"{salt}\n{client}".encode()).hexdigest()
        body[FIELD] = salt
