"""Prompt synthesis: exact token counts with the tiny tokenizer, sessions, system prompts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.prompts import PromptSynthesizer, load_tokenizer
from serve.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(str(build_tiny_model()))


def n_tokens(tok, text: str) -> int:  # type: ignore[no-untyped-def]
    return len(tok(text).input_ids)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31))
def test_exact_token_count(tokenizer, n: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    p = PromptSynthesizer(tokenizer, seed=seed).prompt(n)
    assert p.num_tokens == n == n_tokens(tokenizer, p.text)


def test_deterministic_with_seed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    def texts(seed: int) -> list[str]:
        s = PromptSynthesizer(tokenizer, seed=seed, system_prompts=2, system_prompt_tokens=20)
        return [s.prompt(50).text, s.prompt(70, session_id="a", response_tokens=9).text,
                s.prompt(200, session_id="a").text, s.prompt(40, api=True).text]

    assert texts(1) == texts(1)
    assert texts(1) != texts(2)


def test_session_turns_resend_earlier_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    s = PromptSynthesizer(tokenizer, seed=3)
    t1 = s.prompt(100, session_id="conv", response_tokens=30)
    other = s.prompt(100, session_id="other", response_tokens=30)
    t2 = s.prompt(400, session_id="conv", response_tokens=10)
    assert t1.shared_prefix_tokens == 0
    assert t2.text.startswith(t1.text) and not t2.text.startswith(other.text)
    assert t2.shared_prefix_tokens == 130 and t2.num_tokens == 400
    ids1, ids2 = tokenizer(t1.text).input_ids, tokenizer(t2.text).input_ids
    assert ids2[: len(ids1)] == ids1  # a token-level prefix: the prefix cache can hit
    # A recorded request shorter than the history: the client truncated, no sharing.
    t3 = s.prompt(50, session_id="conv")
    assert t3.num_tokens == 50 and t3.shared_prefix_tokens == 0


def test_shared_system_prompts_for_api_rows(tokenizer) -> None:  # type: ignore[no-untyped-def]
    s = PromptSynthesizer(tokenizer, seed=4, system_prompts=2, system_prompt_tokens=64)
    prompts = [s.prompt(200, api=True) for _ in range(20)]
    assert all(p.num_tokens == 200 and p.shared_prefix_tokens == 64 for p in prompts)
    assert len({p.text[: len(s._system[0])] for p in prompts}) == 2
    assert s.prompt(200).shared_prefix_tokens == 0  # not an API row
