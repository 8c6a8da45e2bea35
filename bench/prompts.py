"""Prompt synthesis to exact token counts with the served model's tokenizer.

Prompts are sequences of whole-word tokens (tokens that decode to a space plus letters and
re-encode to themselves). Pre-tokenizers split text at word boundaries, so any sequence of such
tokens re-encodes to exactly the same ids: a prompt of N words is N tokens (plus whatever the
tokenizer's special tokens add, which is counted), and a prompt that starts with an earlier
prompt's text shares its token prefix. Every prompt is checked by re-encoding it; a tokenizer
that breaks the rule is corrected word by word.

Parameters (defaults):
  seed=0                    all randomness; same trace + seed -> same prompts
  system_prompts=0          number of distinct shared system prompts for "API log" rows
  system_prompt_tokens=0    length of each shared system prompt (counted in the request tokens)
  sessions=True             "Conversation log" rows with a Session ID resend the session's
                            earlier turns (previous prompt + a stand-in of its response)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """No exact-length prompt could be built (for example a tokenizer without word tokens)."""


class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer used here."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def load_tokenizer(name_or_path: str) -> Any:
    """Load a Hugging Face tokenizer from a local dir or hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


@dataclass(frozen=True)
class Prompt:
    """A synthesized prompt and its token count under the tokenizer (special tokens included)."""

    text: str
    num_tokens: int
    shared_prefix_tokens: int = 0
    """Tokens at the start that an earlier request also sent (session history, system prompt)."""


class _RustTokenizer:
    """The ``tokenizers`` backend of a fast HF tokenizer: same ids, ~50x faster per call."""

    def __init__(self, backend: Any) -> None:
        self._t = backend

    def __len__(self) -> int:
        return int(self._t.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._t.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._t.decode(list(ids), skip_special_tokens=False))


class PromptSynthesizer:
    """Builds prompts of exact token counts; deterministic for a given seed and call order."""

    def __init__(self, tokenizer: Tokenizer, *, seed: int = 0, system_prompts: int = 0,
                 system_prompt_tokens: int = 0, sessions: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.tok: Tokenizer = _RustTokenizer(backend) if backend is not None else tokenizer
        self.rng = random.Random(seed)
        self.sessions = sessions
        self._special = len(tokenizer.encode("", add_special_tokens=True))
        self._words = self._word_tokens()
        if len(self._words) < 16:
            raise PromptError(f"tokenizer has only {len(self._words)} whole-word tokens")
        self._session_text: dict[str, str] = {}
        self._session_tokens: dict[str, int] = {}
        self._system = [self._words_text(system_prompt_tokens) for _ in range(system_prompts)] \
            if system_prompt_tokens > 0 else []

    def _word_tokens(self) -> list[str]:
        vocab_size = len(self.tok)  # type: ignore[arg-type]
        words: list[str] = []
        for i in range(vocab_size):
            s = self.tok.decode([i])
            if len(s) < 3 or s[0] != " " or not s[1:].isalpha() or not s[1:].isascii():
                continue
            if self.tok.encode(s + s, add_special_tokens=False) == [i, i]:
                words.append(s)
        logger.debug("prompt synthesis: %d whole-word tokens", len(words))
        return words

    def _words_text(self, n: int) -> str:
        return "".join(self.rng.choice(self._words) for _ in range(n))

    def count(self, text: str) -> int:
        """Tokens the server counts for ``text`` (special tokens included)."""
        return len(self.tok.encode(text, add_special_tokens=True))

    def _extend_to(self, prefix: str, target: int) -> str:
        """``prefix`` plus words so the whole text encodes to exactly ``target`` tokens."""
        text = prefix + self._words_text(max(0, target - self.count(prefix)))
        for _ in range(64):
            n = self.count(text)
            if n == target:
                return text
            if n < target:
                text += self._words_text(target - n)
            else:
                # Every word starts with a space: dropping k trailing words drops k tokens.
                cut = text.rsplit(" ", n - target)[0]
                text = cut if len(cut) >= len(prefix) else prefix
        raise PromptError(f"could not reach exactly {target} tokens (at {self.count(text)})")

    def prompt(self, request_tokens: int, *, session_id: str | None = None,
               response_tokens: int = 0, api: bool = False) -> Prompt:
        """A prompt of ``request_tokens`` tokens.

        With a ``session_id`` seen before, the prompt starts with the session's previous
        prompt and a stand-in for its response; after the call the session's history is this
        prompt plus ``response_tokens`` stand-in tokens. ``api`` rows get a shared system
        prompt when any are configured.
        """
        target = max(request_tokens, self._special + 1)
        prefix = ""
        if session_id is not None and self.sessions:
            prefix = self._session_text.get(session_id, "")
        elif api and self._system:
            prefix = self.rng.choice(self._system)
        if prefix and self.count(prefix) >= target:
            prefix = ""  # history longer than the recorded request: the client truncated it
        shared = self.count(prefix) - self._special if prefix else 0
        text = self._extend_to(prefix, target)
        if session_id is not None and self.sessions:
            self._session_text[session_id] = text + self._words_text(response_tokens)
        return Prompt(text, self.count(text), max(0, shared))
