"""Workers fail closed without the cluster secret, and their vLLM takes only the key the
router derives from it (security review findings 5 and 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtransfer.signing import ENV_API_KEYRING_FILE, Keyring
from serve.cli import _parser
from serve.vllm_cli import api_key_args
from serve.worker import WorkerSettings, settings_from_args, vllm_env

SECRET = "cluster-secret-0123456789abcdef-0123456789"


def _settings(role: str, *flags: str) -> WorkerSettings:
    args, extra = _parser().parse_known_args(["worker", "--role", role, "--model", "m", *flags])
    return settings_from_args(args, extra)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_kv_worker_without_the_secret_is_refused(role: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("PDSERVE_INSECURE", raising=False)
    with pytest.raises(ValueError, match="needs the cluster secret"):
        _settings(role)
    assert _settings(role, "--insecure").insecure  # the operator's explicit choice
    monkeypatch.setenv("PDSERVE_INSECURE", "1")
    assert _settings(role).insecure
    monkeypatch.delenv("PDSERVE_INSECURE")
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", SECRET)  # control: with the secret it starts
    assert _settings(role).cluster_secret == SECRET


def test_an_aggregated_worker_needs_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """It leases and reads nothing (plain vLLM, no connector)."""
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    assert _settings("aggregated").role == "aggregated"


def test_vllm_gets_every_derived_key_and_never_the_secret(tmp_path: Path) -> None:
    keyring = tmp_path / "keyring"
    keyring.write_text(f"{SECRET}\nolder-secret-0123456789abcdef-0123456789\n")
    args = api_key_args({ENV_API_KEYRING_FILE: str(keyring)})
    ring = Keyring.parse(keyring.read_text())
    assert args == ["--api-key", *ring.worker_api_keys] and len(ring.worker_api_keys) == 2
    assert not any(SECRET in a for a in args)
    assert api_key_args({}) == []  # no keyring: vLLM's /v1 stays open (an --insecure worker)


def test_a_plain_vllm_never_inherits_the_worker_keyring(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_API_KEYRING_FILE, "/some/keyring")
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://:password@redis:6379/0")
    env = vllm_env(1, "cpu")
    assert ENV_API_KEYRING_FILE not in env and "PDSERVE_CLUSTER_SECRET" not in env
    assert "PDSERVE_REDIS_URL" not in env  # the Redis password stays with the launcher
