"""Stream the prefill's token at once: the first token of a P/D request costs one prefill.

The prefill worker runs the prompt with ``max_tokens=1`` and so samples the first output token
anyway. Classic P/D (vLLM's toy proxy, SGLang's router) throws it away and waits for the decode
worker to recompute the last prompt position and sample it again: the client's first token then
waits for the decode request, the KV pull and a decode step (~20-60 ms here, ~58 ms of recompute
alone in vllm#50913). Here the router sends that token to the client as soon as the prefill
answers and asks the decode worker to *continue* from it: the decode request's prompt is the
prompt's token ids plus the sampled token, the KV of the prompt comes from the prefill (the
connector pulls only the tokens the prefill holds) and the decode computes the one new position,
exactly what a plain engine does after sampling its first token. Greedy output is unchanged;
sampled output has the same distribution.

Only requests whose every field keeps that true take this path (``eligible``): a single prompt,
streaming, ``n == 1``, ``max_tokens`` unset or > 1, no stop strings, logprobs, echo, penalties
over the output, structured output, tools or seeded sampling. Everything else, and a prefill
whose token ended the request or is an incomplete UTF-8 sequence, uses classic P/D.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.api.journal import SAMPLING_FIELDS, max_tokens_of, sse_event
from router.api.schemas import Endpoint

_COMMON = {"model", "stream", "stream_options", "max_tokens", "n", "best_of", "stop",
           "presence_penalty", "frequency_penalty", "logprobs"} | SAMPLING_FIELDS
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                          "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice"}
_EMPTY: tuple[Any, ...] = (None, False, 0, 0.0, "", [], {})


def eligible(endpoint: Endpoint, body: Mapping[str, Any]) -> bool:
    """True when continuing from the prefill's token gives what the whole request would."""
    max_tokens = max_tokens_of(body)
    return resumable(endpoint, body) and (max_tokens is None or max_tokens >= 2)


def resumable(endpoint: Endpoint, body: Mapping[str, Any]) -> bool:
    """True when a stream of ``body`` can go on from any of its generated ids on another
    engine and give what the whole request would (``router.api.journal``): greedy output
    token for token, sampled output from the same distribution."""
    allowed = _CHAT_FIELDS if endpoint.chat else _COMPLETION_FIELDS
    if set(body) - allowed or body.get("stream") is not True:
        return False
    for name in ("stop", "presence_penalty", "frequency_penalty", "logprobs", "echo",
                 "top_logprobs", "tools", "tool_choice"):
        if body.get(name) not in _EMPTY and body.get(name) != "none":
            return False
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return False
    if body.get("seed") is not None and body.get("temperature") != 0:
        return False  # a seeded sample must come from one generator, as on one engine
    if body.get("add_generation_prompt") is False:
        return False
    if endpoint.chat:
        return True
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                       and all(isinstance(t, int) for t in prompt))


@dataclass(frozen=True)
class FirstToken:
    """What the prefill sampled, and the ids its KV belongs to."""

    response_id: str
    created: int
    model: str
    text: str
    token_id: int
    prompt_token_ids: tuple[int, ...]


def parse_prefill(data: Any) -> FirstToken | None:
    """The prefill's token when the request can continue from it, else None (classic P/D)."""
    if not isinstance(data, dict):
        return None
    choices = data.get("choices") or []
    if len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    text = choice.get("text")
    if text is None and isinstance(choice.get("message"), dict):
        text = choice["message"].get("content")
    token_ids = choice.get("token_ids")
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    # A token that decodes to nothing yet (part of a UTF-8 character the detokenizer holds back)
    # cannot be streamed on its own, and a continuation whose prompt ends inside a character
    # makes vLLM's incremental detokenizer emit the whole prompt text: classic P/D then.
    if (choice.get("finish_reason") != "length" or not isinstance(text, str) or not text
            or "\ufffd" in text
            or not isinstance(token_ids, list) or len(token_ids) != 1
            or not isinstance(prompt_ids, list) or not prompt_ids):
        return None
    return FirstToken(str(data.get("id", "")), int(data.get("created", 0)),
                      str(data.get("model", "")), text, int(token_ids[0]),
                      tuple(int(t) for t in prompt_ids))


def first_events(endpoint: Endpoint, first: FirstToken,
                 body: Mapping[str, Any] | None = None) -> bytes:
    """The SSE events that carry the first token (chat: the role chunk, then the content), in
    vLLM 0.32's chunk schema (keys, their order and nulls as a plain vLLM server streams them;
    per-chunk usage when ``body`` asks for ``stream_options.continuous_usage_stats``)."""
    prompt = len(first.prompt_token_ids)
    continuous = continuous_usage(body or {})
    head = {"id": first.response_id,
            "object": "chat.completion.chunk" if endpoint.chat else "text_completion",
            "created": first.created, "model": first.model}
    if not endpoint.chat:
        chunk: dict[str, Any] = {**head, "choices": [
            {"index": 0, "text": first.text, "logprobs": None, "finish_reason": None,
             "stop_reason": None, "prompt_token_ids": None, "token_ids": None}]}
        if continuous:
            chunk["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + 1,
                              "completion_tokens": 1}
        return sse_event(chunk)
    role: dict[str, Any] = {**head, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}]}
    content: dict[str, Any] = {**head, "choices": [
        {"index": 0, "delta": {"content": first.text}, "logprobs": None,
         "finish_reason": None, "token_ids": None}]}
    if continuous:
        role["usage"] = chat_usage(prompt, 0)
        content["usage"] = chat_usage(prompt, 1)
    role.update(prompt_token_ids=None, prompt_text=None)
    return sse_event(role) + sse_event(content)


def continuous_usage(body: Mapping[str, Any]) -> bool:
    """True when the request asks for usage on every chunk (vLLM's
    ``stream_options.continuous_usage_stats``; it needs ``include_usage`` too)."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage")) and bool(
        options.get("continuous_usage_stats"))


def chat_usage(prompt: int, completion: int) -> dict[str, Any]:
    """A chat chunk's per-chunk usage as vLLM streams it."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "completion_tokens_details": None}
