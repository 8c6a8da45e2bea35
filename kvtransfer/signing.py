"""Signed ``kv_transfer_params``: only the router may make a worker lease blocks or read KV.

The router signs the ``kv_transfer_params`` it sends to a prefill (``do_remote_decode``: keep
the blocks under a lease) and to a decode (``do_remote_prefill``: read these blocks from this
handshake). Workers verify before acting; unsigned, forged or stale params are stripped, so the
request runs as a plain one (no lease, no read). A client that reaches a worker's port directly
can therefore neither pin KV blocks nor make a decode read from an address it chose.

Signature: HMAC-SHA256 over the canonical JSON of the params (every key but ``pdserve_sig``,
sorted, compact), the signing time and a random nonce, stored as ``{"k": key id, "t": unix
time, "n": nonce, "m": hex mac}`` under ``pdserve_sig``. Keys come from a *keyring*: the first
key signs, every key verifies, so a secret is rotated without downtime (add the new one second,
reload everywhere, move it first, later drop the old).

A signature is a capability for one call to one engine: the router signs each upstream attempt
anew with the chosen worker's engine id under ``pdserve_target`` (covered by the MAC), and a
worker accepts a MAC once (:class:`SeenSignatures`). A blob that leaks (request logs, a rogue
worker) is useless elsewhere and cannot be replayed. Parameters:

- ``max_age_s`` (default 120 s): older (or more than this in the future: clock skew) is stale;
  seen MACs are remembered twice this long (the past and the future window), so a replay is
  refused for as long as it could verify.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SIGNATURE_KEY = "pdserve_sig"
TARGET_KEY = "pdserve_target"
"""The engine id a signature is for (a worker refuses params signed for another engine)."""
DEFAULT_MAX_AGE_S = 120.0
REPLAYED = "replayed signature"
"""Why :func:`verify_for_engine` refuses a signature it already accepted."""
MIN_SECRET_BYTES = 32
"""Shortest secret (line of a keyring) accepted, in bytes. Key ids (a SHA-256 prefix) and every
signed blob are public, so a weak secret falls to an offline search (security review finding
22). Length cannot prove randomness; it rules out the short passwords people type. Every
generator pdserve ships or documents draws 32 random bytes (``secrets.token_urlsafe(32)``,
``openssl rand -base64 32``, 32 bytes of ``/dev/urandom`` as hex)."""
ENV_SECRET = "PDSERVE_CLUSTER_SECRET"
ENV_SECRET_FILE = "PDSERVE_CLUSTER_SECRET_FILE"
ENV_API_KEYRING_FILE = "PDSERVE_API_KEYRING_FILE"
"""Set for a worker's vLLM process: the keyring whose derived API keys it requires on ``/v1``."""


def _key_id(secret: bytes) -> str:
    return hashlib.sha256(b"pdserve-key-id:" + secret).hexdigest()[:12]


def worker_api_key(secret: bytes) -> str:
    """The vLLM API key derived from one cluster secret (never the secret itself)."""
    return hmac.new(secret, b"pdserve-worker-api-key", hashlib.sha256).hexdigest()


def _canonical(params: Mapping[str, Any], signed_at: float, nonce: str) -> bytes:
    body = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=str)
    return f"{signed_at:.6f}\n{nonce}\n".encode() + blob.encode()


@dataclass(frozen=True)
class Keyring:
    """Cluster secrets: ``secrets[0]`` signs, any of them verifies."""

    secrets: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("a keyring needs at least one secret")
        for i, s in enumerate(self.secrets):
            if len(s) < MIN_SECRET_BYTES:
                where = f"secret {i + 1} of {len(self.secrets)}" if len(self.secrets) > 1 \
                    else "the cluster secret"
                raise ValueError(
                    f"{where} is {len(s)} bytes; at least {MIN_SECRET_BYTES} are required "
                    "(make one from 32 random bytes, e.g. `openssl rand -base64 32`)")

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """One secret per line (blank lines and ``#`` comments ignored); first line signs."""
        lines = [ln.strip() for ln in text.splitlines()]
        return cls(tuple(ln.encode() for ln in lines if ln and not ln.startswith("#")))

    @property
    def worker_api_keys(self) -> tuple[str, ...]:
        """The workers' vLLM API keys (``--api-key``), one derived from each secret: the router
        sends the first, a worker accepts any (so no second secret is distributed)."""
        return tuple(worker_api_key(s) for s in self.secrets)

    def mac(self, domain: bytes, data: bytes) -> str:
        """HMAC-SHA256 (hex) of ``data`` under the signing secret, separated by ``domain`` from
        every other use of the secret."""
        return hmac.new(self.secrets[0], domain + b"\n" + data, hashlib.sha256).hexdigest()

    def verify_mac(self, domain: bytes, data: bytes, mac: str) -> bool:
        """Whether ``mac`` is `mac` of ``data`` under any secret (constant-time compares)."""
        ok = False
        for secret in self.secrets:
            want = hmac.new(secret, domain + b"\n" + data, hashlib.sha256).hexdigest()
            ok |= hmac.compare_digest(want, mac)
        return ok

    @property
    def wire_keys(self) -> tuple[bytes, ...]:
        """The sealed KV wire's hello keys, one derived from each secret (first one proves)."""
        return tuple(hmac.new(s, b"pdserve-kv-wire", hashlib.sha256).digest()
                     for s in self.secrets)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Public ids of the secrets (safe to log)."""
        return tuple(_key_id(s) for s in self.secrets)

    def sign(self, params: Mapping[str, Any], now: float,
             target: str | None = None) -> dict[str, Any]:
        """A copy of ``params`` carrying a fresh signature made at ``now`` (unix seconds) for
        the engine ``target`` (None: keeps any ``pdserve_target`` already in ``params``)."""
        secret = self.secrets[0]
        signed_at = round(now, 6)
        nonce = secrets.token_hex(8)
        out = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
        if target is not None:
            out[TARGET_KEY] = target
        mac = hmac.new(secret, _canonical(out, signed_at, nonce), hashlib.sha256).hexdigest()
        out[SIGNATURE_KEY] = {"k": _key_id(secret), "t": signed_at, "n": nonce, "m": mac}
        return out

    def verify(self, params: Mapping[str, Any], now: float,
               max_age_s: float = DEFAULT_MAX_AGE_S) -> str | None:
        """None when ``params`` carry a valid, fresh signature; else why not (for logs)."""
        sig = params.get(SIGNATURE_KEY)
        if not isinstance(sig, dict):
            return "unsigned"
        kid, signed_at, mac = sig.get("k"), sig.get("t"), sig.get("m")
        nonce = sig.get("n")
        if not isinstance(kid, str) or not isinstance(mac, str) or \
                not isinstance(nonce, str) or \
                not isinstance(signed_at, int | float) or isinstance(signed_at, bool):
            return "malformed signature"
        if abs(now - float(signed_at)) > max_age_s:
            return f"stale signature ({now - float(signed_at):.1f} s old)"
        message = _canonical(params, float(signed_at), nonce)
        ok = False
        for secret in self.secrets:  # every key is tried: no timing hint of which matched
            expected = hmac.new(secret, message, hashlib.sha256).hexdigest()
            ok |= hmac.compare_digest(expected, mac) and _key_id(secret) == kid
        return None if ok else "bad signature"


class SeenSignatures:
    """MACs a worker has accepted, each kept until its signature would be stale anyway.

    Bounded by ``max_entries`` (default 65,536: above any plausible rate x lifetime of one
    worker); when full, the oldest is forgotten first."""

    def __init__(self, max_entries: int = 65536) -> None:
        self._max = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # mac -> forget after

    def first_use(self, mac: str, now: float, keep_s: float) -> bool:
        """True the first time ``mac`` is shown (and remember it), False on a replay."""
        while self._seen:
            oldest, until = next(iter(self._seen.items()))
            if until > now and len(self._seen) < self._max:
                break
            del self._seen[oldest]
        if mac in self._seen:
            return False
        self._seen[mac] = now + keep_s
        return True


def verify_for_engine(keyring: Keyring, params: Mapping[str, Any], now: float,
                      engine_id: str, seen: SeenSignatures,
                      max_age_s: float = DEFAULT_MAX_AGE_S) -> str | None:
    """None when ``params`` carry a valid, fresh signature made for ``engine_id`` and not
    seen before (it is remembered); else why not (for logs)."""
    why = keyring.verify(params, now, max_age_s)
    if why is not None:
        return why
    if params.get(TARGET_KEY) != engine_id:
        return f"signed for engine {params.get(TARGET_KEY)!r}, not this one"
    if not seen.first_use(str(params[SIGNATURE_KEY]["m"]), now, 2 * max_age_s):
        return REPLAYED
    return None


class KeyringFile:
    """A keyring read from a file and re-read when the file changes (rotation)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._keyring: Keyring | None = None
        self.current()

    def current(self) -> Keyring:
        """The keyring as of the file's last change; a broken rewrite keeps the previous one."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                with open(self.path) as fh:
                    keyring = Keyring.parse(fh.read())
                self._stamp, self._keyring = stamp, keyring
                logger.info("cluster keyring loaded from %s (key ids %s)", self.path,
                            ", ".join(keyring.key_ids))
        except (OSError, ValueError) as exc:
            if self._keyring is None:
                raise ValueError(f"cannot read the cluster keyring {self.path}: {exc}") from exc
            logger.warning("keeping the previous cluster keyring: %s", exc)
        assert self._keyring is not None
        return self._keyring


def keyring_source(secret: str | None, secret_file: str | None) -> KeyringFile | Keyring | None:
    """The keyring given by a secret or a file (the file wins; it can be rotated), or None."""
    if secret_file:
        return KeyringFile(secret_file)
    if secret:
        return Keyring.parse(secret)
    return None


def current(source: KeyringFile | Keyring | None) -> Keyring | None:
    """The keyring a source holds now."""
    if isinstance(source, KeyringFile):
        return source.current()
    return source


def secret_from_env(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(secret, secret file) from ``PDSERVE_CLUSTER_SECRET`` / ``PDSERVE_CLUSTER_SECRET_FILE``."""
    return env.get(ENV_SECRET) or None, env.get(ENV_SECRET_FILE) or None


def strip_signature(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` without a signature or target (to re-sign what a prefill returned)."""
    return {k: v for k, v in params.items() if k not in (SIGNATURE_KEY, TARGET_KEY)}

