"""The router's prompt tokenization: the Rust backend's ids equal the wrapper's, short prompts
are encoded on the loop and long ones in a thread, with the same ids either way."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from router.api import tokenization
from router.api.tokenization import INLINE_CHARS, TokenizerCache, _encode, _encoder
from serve.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(build_tiny_model())


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return tokenization._load(model_path)


PROMPTS = ["", "Hello", " leading space", "Prefill and decode.\n\nTwo engines, one KV cache.",
           "caf\u00e9 \u4e2d\u6587 \U0001f600 tabs\tand  double  spaces", "<s> looks special",
           "x" * 5000]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_backend_gives_the_wrappers_ids(tokenizer: Any, prompt: str) -> None:
    encode = _encoder(tokenizer)
    assert encode(prompt) == _encode(tokenizer, prompt)
    # the fast path is the one chosen for this tokenizer (not the wrapper again)
    assert encode.__name__ == "fast"


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(max_size=300))
def test_any_text_gets_the_wrappers_ids(tokenizer: Any, prompt: str) -> None:
    assert _encoder(tokenizer)(prompt) == _encode(tokenizer, prompt)


class _DisagreeingWrapper:
    """A wrapper whose ``backend_tokenizer`` is some other real tokenizer (as a transformers
    tokenizer that adds ids in Python would be): its backend must not be used."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        other = Tokenizer(models.WordLevel({"[UNK]": 0, "Hello": 1}, unk_token="[UNK]"))
        other.pre_tokenizer = pre_tokenizers.Whitespace()
        self.backend_tokenizer = other

    def __call__(self, prompt: str, add_special_tokens: bool = True) -> Any:
        return self.wrapped(prompt, add_special_tokens=add_special_tokens)


@pytest.fixture
def encode_threads(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread of every encode a ``TokenizerCache`` made from here on."""
    threads: list[str] = []
    chosen = _encoder(tokenizer)

    def recording(tok: Any) -> Any:
        def encode(prompt: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return chosen(prompt)
        return encode

    monkeypatch.setattr(tokenization, "_encoder", recording)
    return threads


def test_a_backend_that_disagrees_is_not_used(tokenizer: Any) -> None:
    wrapper = _DisagreeingWrapper(tokenizer)
    encode = _encoder(wrapper)
    assert encode("Hello there") == _encode(tokenizer, "Hello there")
    # negative control: the backend alone gives other ids
    assert wrapper.backend_tokenizer.encode("Hello there").ids != _encode(tokenizer, "Hello there")


def test_short_prompts_on_the_loop_long_ones_in_a_thread(model_path: str, tokenizer: Any,
                                                         encode_threads: list[str]) -> None:
    threads = encode_threads
    short, long = "a short prompt", "word " * (INLINE_CHARS // 5 + 1)

    async def count() -> tuple[list[int] | None, list[int] | None]:
        cache = TokenizerCache()
        return (await cache.count_completion(model_path, short),
                await cache.count_completion(model_path, long))

    got_short, got_long = asyncio.run(count())
    assert got_short == _encode(tokenizer, short)
    assert got_long == _encode(tokenizer, long)
    main = threading.main_thread().name
    assert threads == [main, threads[1]] and threads[1] != main


def test_short_chats_on_the_loop_long_ones_in_a_thread(model_path: str, tokenizer: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    render = tokenization._render_chat

    def recording(tok: Any, messages: Any, extra: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return render(tok, messages, extra)

    monkeypatch.setattr(tokenization, "_render_chat", recording)
    short: list[dict[str, Any]] = [{"role": "user", "content": "a short question"}]
    long: list[dict[str, Any]] = [
        {"role": "system", "content": "rules " * (INLINE_CHARS // 12 + 1)},
        {"role": "user", "content": [{"type": "text", "text": "more " * (INLINE_CHARS // 10 + 1)}]}]

    async def count() -> tuple[list[int] | None, list[int] | None]:
        cache = TokenizerCache()
        return (await cache.count_chat(model_path, short, {}),
                await cache.count_chat(model_path, long, {}))

    got_short, got_long = asyncio.run(count())
    assert got_short == render(tokenizer, short, {})
    assert got_long == render(tokenizer, long, {})
    main = threading.main_thread().name
    assert threads == [main, threads[1]] and threads[1] != main


def test_a_batch_is_judged_by_its_total_length(model_path: str, tokenizer: Any,
                                               encode_threads: list[str]) -> None:
    """Prompts that are short one by one but long together go to a thread, in one call;
    prompts given as ids come back as they are, in their places."""
    threads = encode_threads
    piece = "w " * (INLINE_CHARS // 6 + 1)  # three of them pass INLINE_CHARS, two do not
    small: list[str | list[int]] = [piece, [7, 8, 9], piece]
    big: list[str | list[int]] = [piece, [7, 8, 9], piece, piece]

    async def count() -> tuple[list[list[int] | None], list[list[int] | None]]:
        cache = TokenizerCache()
        return (await cache.count_completions(model_path, small),
                await cache.count_completions(model_path, big))

    got_small, got_big = asyncio.run(count())
    ids = _encode(tokenizer, piece)
    assert got_small == [ids, [7, 8, 9], ids]
    assert got_big == [ids, [7, 8, 9], ids, ids]
    main = threading.main_thread().name
    assert threads[:2] == [main, main]
    assert len(threads) == 5 and main not in threads[2:]


def test_without_a_tokenizer_texts_are_unknown_and_ids_stay(tmp_path: Any) -> None:
    async def count() -> list[list[int] | None]:
        return await TokenizerCache().count_completions(str(tmp_path / "missing"),
                                                        ["some text", [1, 2]])

    assert asyncio.run(count()) == [None, [1, 2]]


CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Prefill and decode: which one holds the KV cache?"}]


def test_the_named_class_loads_what_auto_tokenizer_loads(model_path: str, tokenizer: Any) -> None:
    """The router loads the tiny model's tokenizer without AutoTokenizer's module
    (``router.api.tokenizer_class``): the same class, ids and chat rendering as through it."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(model_path)
    assert type(tokenizer) is type(auto)
    for prompt in PROMPTS:
        assert _encode(tokenizer, prompt) == _encode(auto, prompt)
    assert tokenization._render_chat(tokenizer, CHAT, {}) == \
        tokenization._render_chat(auto, CHAT, {})


_LOAD_ALONE = """
import json, sys
from router.api.tokenization import _encode, _load
tok = _load(sys.argv[1])
print(json.dumps(["torch" in sys.modules, _encode(tok, "Hello, world")]))
"""


def test_loading_a_tokenizer_imports_no_torch(model_path: str, tokenizer: Any) -> None:
    """A fresh process that loads the model's tokenizer as the router does has not imported
    torch (AutoTokenizer's module would: seconds of CPU and a heap of objects in the router).
    Control: that process did load the real tokenizer (its ids are this one's)."""
    out = subprocess.run([sys.executable, "-c", _LOAD_ALONE, model_path], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    torch_imported, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == _encode(tokenizer, "Hello, world")
    assert torch_imported is False
