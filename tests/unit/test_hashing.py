"""router.policy.hashing: the batched hash equals the single one, so callers may switch freely."""

from __future__ import annotations

from router.policy.hashing import hash_int, hash_ints


def test_hash_ints_equals_hash_int_per_value() -> None:
    start = (1 << 64) - 3  # crosses the 64-bit mask: both must wrap the same way
    values = range(start, start + 6)
    assert hash_ints(values, 7) == [hash_int(v, 7) for v in values]
    assert hash_ints(range(5, 5), 7) == []
    # negative control: the seed matters
    assert hash_ints(range(10), 7) != hash_ints(range(10), 8)
