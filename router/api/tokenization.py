"""Prompt token counting with the model's own tokenizer.

A request of up to ``INLINE_CHARS`` characters (its prompts, or a chat's text and tools) is
tokenized on the event loop, a completion's prompts by the tokenizer's Rust backend directly
when that gives the ``transformers`` wrapper's ids (checked once per tokenizer). A thread hop
cost more than the encode: the encode holds the GIL most of its run (two threads encoding ran
1.15x faster than one here), so the thread bought little parallelism and cost a GIL hand-off
per request. Longer requests go to a thread, where the loop still gets the GIL every switch
interval.
One tokenizer per ``model_path`` is loaded in a thread and cached (without importing torch
where ``router.api.tokenizer_class`` can tell the class): ahead of traffic by
:meth:`TokenizerCache.warm` (the router's ``/health`` starts it for every registered model and
says ``warming`` until it is done, so the first request after ready does not pay the 1-4 s
load), else on first use. When a tokenizer cannot be loaded on the router host the context
check is skipped (vLLM still enforces it and its 400 is relayed) and a warning is logged once
for that path.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from router.api.tokenizer_class import lean_class
from router.api.untrusted import TEMPLATE_CALL_KWARGS

logger = logging.getLogger(__name__)


INLINE_CHARS = 4096
"""Prompts up to this many characters are encoded on the event loop (about 2 ms at most here)."""
_PROBE = "Hello, world! Prefill and decode: 1,000 tokens of KV cache; \u00e9\u4e2d\U0001f600 <s>"
"""The text on which the backend's ids must equal the wrapper's before it is used."""


class TokenizerCache:
    """Each model's tokenizer, loaded once per ``model_path``."""

    def __init__(self, on_loaded: Callable[[], object] = lambda: None) -> None:
        self._on_loaded = on_loaded
        """Called after each tokenizer loaded (the router settles its heap: ``router.heap``)."""
        self._tokenizers: dict[str, Any] = {}
        self._encoders: dict[str, Callable[[str], list[int]]] = {}
        self._failed: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._warming: dict[str, asyncio.Task[None]] = {}

    def warm(self, model_path: str) -> bool:
        """True once ``model_path``'s tokenizer is loaded (or failed to load); otherwise
        starts loading it and running one encode in the background (needs a running event
        loop) and returns False until that is done."""
        if model_path in self._tokenizers or model_path in self._failed:
            return model_path not in self._warming
        if model_path not in self._warming:
            task = asyncio.get_running_loop().create_task(self._warm(model_path))
            self._warming[model_path] = task
        return False

    async def _warm(self, model_path: str) -> None:
        try:
            tok = await self.get(model_path)
            if tok is not None:  # the first call pays the tokenizer's own lazy set-up
                await asyncio.to_thread(self._encoders[model_path], "warm up")
        finally:
            self._warming.pop(model_path, None)

    async def get(self, model_path: str) -> Any | None:
        """The tokenizer of ``model_path``, or None when it cannot be loaded."""
        if model_path in self._tokenizers:
            return self._tokenizers[model_path]
        if model_path in self._failed:
            return None
        lock = self._locks.setdefault(model_path, asyncio.Lock())
        async with lock:
            if model_path in self._tokenizers:
                return self._tokenizers[model_path]
            if model_path in self._failed:
                return None
            try:
                tok = await asyncio.to_thread(_load, model_path)
            except Exception as exc:  # any loader failure: missing dir, bad files, ...
                logger.error("cannot load the tokenizer from %s (%s): context-length checks "
                             "are left to vLLM, and prefix-aware placement hashes 4-byte "
                             "chunks of the prompt text instead of tokens (mount the model's "
                             "tokenizer files on the router to fix)", model_path, exc)
                self._failed.add(model_path)
                return None
            self._encoders[model_path] = _encoder(tok)
            self._tokenizers[model_path] = tok
            self._on_loaded()
            return tok

    async def count_completion(
        self, model_path: str, prompt: str | Sequence[int]
    ) -> list[int] | None:
        """``prompt``'s ids (a prompt given as ids: those); None without a tokenizer."""
        return (await self.count_completions(model_path, [prompt]))[0]

    async def count_completions(
        self, model_path: str, prompts: Sequence[str | Sequence[int]]
    ) -> list[list[int] | None]:
        """Each prompt's ids, the texts encoded on the loop when they hold ``INLINE_CHARS``
        characters or fewer in all, else in one thread call."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded: Sequence[list[int] | None] = [None] * len(texts)
        encode = await self._encoder_of(model_path) if texts else None
        if encode is not None and sum(map(len, texts)) <= INLINE_CHARS:
            encoded = [encode(t) for t in texts]
        elif encode is not None:
            encoded = await asyncio.to_thread(lambda: [encode(t) for t in texts])
        found = iter(encoded)
        return [next(found) if isinstance(p, str) else list(p) for p in prompts]

    async def _encoder_of(self, model_path: str) -> Callable[[str], list[int]] | None:
        """``model_path``'s encoder (its tokenizer loaded first), or None without one."""
        if model_path not in self._encoders:
            await self.get(model_path)
        return self._encoders.get(model_path)

    async def count_chat(
        self, model_path: str, messages: list[dict[str, Any]], extra: Mapping[str, Any]
    ) -> list[int] | None:
        tok = await self.get(model_path)
        if tok is None:
            return None
        try:
            if _chat_chars(messages, extra) <= INLINE_CHARS:
                return _render_chat(tok, messages, extra)
            return await asyncio.to_thread(_render_chat, tok, messages, extra)
        except Exception as exc:  # a template the router cannot render: let vLLM decide
            logger.debug("chat template rendering failed, skipping context check: %s", exc)
            return None


APPROX_BYTES_PER_TOKEN = 4


def approximate_ids(text: str) -> tuple[int, ...]:
    """Stand-in token ids when the tokenizer is missing: each 4 bytes of the UTF-8 text is one
    id, so equal prefixes still hash to equal blocks and different prompts spread out (without
    it, every prompt would hash to the same empty key and land on the same workers)."""
    raw = text.encode()
    step = APPROX_BYTES_PER_TOKEN
    return tuple(int.from_bytes(raw[i:i + step], "little") for i in range(0, len(raw), step))


def _load(model_path: str) -> Any:
    """``model_path``'s tokenizer: through the class ``AutoTokenizer`` would pick, imported
    without torch when that can be told (``router.api.tokenizer_class``), else through
    ``AutoTokenizer``. A hub id is resolved from the local HF cache only: the router never
    downloads weights."""
    local_only = not os.path.isdir(model_path)
    cls = lean_class(model_path)
    if cls is not None:
        return cls.from_pretrained(model_path, local_files_only=local_only)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=local_only)


def _encode(tok: Any, prompt: str) -> list[int]:
    return list(tok(prompt, add_special_tokens=True)["input_ids"])


def _encoder(tok: Any) -> Callable[[str], list[int]]:
    """``_encode`` for ``tok``: through its Rust backend (``backend_tokenizer``) when that gives
    the wrapper's ids on ``_PROBE``, else through the wrapper."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        # ``encode_batch_fast`` skips the offsets nobody here reads: 80 instead of 112-117 us of
        # CPU for a 400-character prompt with the tiny tokenizer (run in the caller's thread when
        # ``TOKENIZERS_PARALLELISM`` is false, as ``router.main`` sets it)
        batch = getattr(backend, "encode_batch_fast", None)

        def fast(prompt: str) -> list[int]:
            if batch is not None:
                ids: list[int] = batch([prompt], add_special_tokens=True)[0].ids
            else:
                ids = backend.encode(prompt, add_special_tokens=True).ids
            return ids
        try:
            if fast(_PROBE) == _encode(tok, _PROBE):
                return fast
        except Exception as exc:  # a backend that cannot encode plain text: use the wrapper
            logger.debug("tokenizer backend unusable (%s): encoding through transformers", exc)
    return lambda prompt: _encode(tok, prompt)


def _chat_chars(messages: list[dict[str, Any]], extra: Mapping[str, Any]) -> int:
    """About the characters the template renders: the messages' text and the tools' JSON."""
    tools = extra.get("tools")
    return sum(len(c) for m in messages if isinstance(c := _text_content(m.get("content")), str)) \
        + (len(str(tools)) if tools else 0)


def _text_content(content: Any) -> Any:
    """vLLM accepts content as a list of parts; the template wants text."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") == "text")
    return content


def _render_chat(tok: Any, messages: list[dict[str, Any]], extra: Mapping[str, Any]) -> list[int]:
    msgs = [{**m, "content": _text_content(m.get("content"))} for m in messages]
    kwargs: dict[str, Any] = {}
    if extra.get("tools"):
        kwargs["tools"] = extra["tools"]
    if isinstance(extra.get("chat_template_kwargs"), dict):
        # template variables only: never a client's template or a call argument
        kwargs.update({k: v for k, v in extra["chat_template_kwargs"].items()
                       if k not in TEMPLATE_CALL_KWARGS})
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kwargs)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
