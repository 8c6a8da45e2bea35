"""Router API keys: which header values pass."""

from __future__ import annotations

import pytest

from router.api.auth import ApiKeys


@pytest.mark.parametrize(("header", "ok"), [
    ("Bearer key-one", True), ("bearer key-two", True), ("Bearer  key-one ", True),
    (None, False), ("", False), ("Bearer", False), ("Bearer key-on", False),
    ("Bearer key-one-and-more", False), ("Basic key-one", False), ("key-one", False)])
def test_allows(header: str | None, ok: bool) -> None:
    assert ApiKeys(["key-one", "key-two"]).allows(header) is ok


def test_needs_a_key() -> None:
    with pytest.raises(ValueError):
        ApiKeys(["", ""])
