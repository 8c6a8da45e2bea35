"""Per-key ``cache_salt`` (security review row 10): the salt a key's requests carry, and the
router's prefix hashes under it (``router.api.cache_salt``, ``router.policy.hashing``)."""

from __future__ import annotations

import hashlib

import pytest

from kvtransfer.signing import Keyring
from router.api.cache_salt import KeySalts, check_client_salt
from router.api.first_token import resumable
from router.api.journal import continuation_body
from router.api.schemas import CHAT_COMPLETIONS, COMPLETIONS
from router.config import load
from router.errors import InvalidRequestError
from router.policy.cache_model import ClusterCacheModel
from router.policy.hashing import block_hashes, salt_seed

IDS = tuple(range(500, 564))  # 4 blocks of 16
KEY_A, KEY_B = "sk-tenant-a-0000000000", "sk-tenant-b-0000000000"


def test_the_routing_hash_differs_across_salts() -> None:
    plain = block_hashes(IDS)
    a, a_again, b = (block_hashes(IDS, seed=salt_seed(s)) for s in ("salt-a", "salt-a", "salt-b"))
    assert len(a) == len(b) == len(plain) == 4
    assert a == a_again  # one salt: one prefix, as the engine caches it
    assert not set(a) & set(b) and not set(a) & set(plain)  # no block in common
    # no salt (or one vLLM refuses) hashes as before
    assert salt_seed(None) == salt_seed("") == salt_seed(7) == 0
    assert block_hashes(IDS, seed=salt_seed(None)) == plain


def test_the_cache_model_sees_no_prefix_across_salts() -> None:
    model = ClusterCacheModel()
    model.insert("w", block_hashes(IDS, seed=salt_seed("salt-a")))
    assert model.match("w", block_hashes(IDS, seed=salt_seed("salt-a"))) == 4
    assert model.match("w", block_hashes(IDS, seed=salt_seed("salt-b"))) == 0
    assert model.match("w", block_hashes(IDS)) == 0


@pytest.mark.parametrize("keyring", [None, Keyring.parse("cluster-secret-0123456789-0123456789")])
def test_each_key_has_its_own_salt_that_is_not_the_key(keyring: Keyring | None) -> None:
    salts = KeySalts(keyring)
    a, b = salts.of_key(KEY_A), salts.of_key(KEY_B)
    assert a == salts.of_key(KEY_A) and a != b
    assert KEY_A not in a and len(a) == 64 and int(a, 16) >= 0  # hex: vLLM accepts it
    body: dict[str, object] = {"model": "m", "prompt": "p"}
    salts.apply(body, KEY_A)
    assert body["cache_salt"] == a
    unkeyed: dict[str, object] = {"model": "m"}
    salts.apply(unkeyed, None)
    assert "cache_salt" not in unkeyed  # no key presented: left as it was


def test_the_salt_depends_on_the_cluster_secret() -> None:
    one = KeySalts(Keyring.parse("cluster-secret-0123456789-0123456789")).of_key(KEY_A)
    other = KeySalts(Keyring.parse("cluster-secret-9876543210-9876543210")).of_key(KEY_A)
    unkeyed = KeySalts(None).of_key(KEY_A)
    assert len({one, other, unkeyed}) == 3
    assert unkeyed != hashlib.sha256(KEY_A.encode()).hexdigest()  # domain-separated


def test_a_client_salt_stays_inside_its_keys_space() -> None:
    salts = KeySalts(None)
    body: dict[str, object] = {"cache_salt": "user-1"}
    salts.apply(body, KEY_A)
    combined = body["cache_salt"]
    assert combined not in ("user-1", salts.of_key(KEY_A))
    again: dict[str, object] = {"cache_salt": "user-1"}
    salts.apply(again, KEY_B)
    assert again["cache_salt"] != combined  # the same client salt under another key
    # naming another key's salt does not join its cache
    forged: dict[str, object] = {"cache_salt": salts.of_key(KEY_B)}
    salts.apply(forged, KEY_A)
    assert forged["cache_salt"] != salts.of_key(KEY_B)


@pytest.mark.parametrize("salt", ["", 5, "a/b", "a@b", "a\\b", "a\x00b", "x" * 129])
def test_a_client_salt_vllm_refuses_is_refused(salt: object) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check_client_salt(salt)
    assert raised.value.param == "cache_salt" and raised.value.code == "invalid_value"
    assert check_client_salt("x" * 128) == "x" * 128  # control: the longest accepted


def test_a_salted_stream_can_still_continue_and_its_continuation_keeps_the_salt() -> None:
    body = {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 8,
            "cache_salt": "s1"}
    assert resumable(COMPLETIONS, body)
    assert resumable(CHAT_COMPLETIONS, {**{k: v for k, v in body.items() if k != "prompt"},
                                        "messages": [{"role": "user", "content": "hi"}]})
    out = continuation_body(body, [1, 2, 3], [9], None)
    assert out["cache_salt"] == "s1" and out["prompt"] == [1, 2, 3, 9]
    unsalted = {k: v for k, v in body.items() if k != "cache_salt"}
    assert "cache_salt" not in continuation_body(unsalted, [1], [], None)  # control


def test_cache_salt_per_key_flag_and_env() -> None:
    assert load([], env={}).cache_salt_per_key is False
    assert load(["--cache-salt-per-key"], env={}).cache_salt_per_key is True
    on = {"PDSERVE_ROUTER_CACHE_SALT_PER_KEY": "1"}
    assert load([], env=on).cache_salt_per_key is True
    assert load(["--no-cache-salt-per-key"], env=on).cache_salt_per_key is False
