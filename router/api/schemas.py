"""OpenAI request schemas and the validation that runs before any worker is contacted.

The schemas check only what the router relies on; unknown fields are allowed and the original
JSON body (not the model) is what gets forwarded, so vLLM's many extra fields pass untouched.
Scalar fields take what vLLM's own (lax) pydantic models take (``"seed": "42"``,
``"stream": "true"``, ``"max_tokens": 8.0``); :func:`validate_request` writes the converted
value back into the body, so the router and the workers read the same number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from router.api.fastjson import loads
from router.errors import InvalidRequestError

PositiveInt = Annotated[int, Field(gt=0)]
TokenIds = list[Annotated[int, Strict(), Field(ge=0, le=2**32 - 1)]]  # vLLM: uint32
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
_INT64 = 2**63


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Strict(), Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    best_of: PositiveInt | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    # Sampling parameters, with the ranges vLLM's SamplingParams._verify_args enforces: checked
    # here so a bad value is answered with our envelope before any worker is touched.
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """-1 and 0 both disable top-k in vLLM; otherwise the number of candidates kept."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[str, Strict()] | list[Annotated[str, Strict()]] | TokenIds | list[TokenIds]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Strict(), Field(min_length=1)]
    content: Any = None


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


@dataclass(frozen=True)
class Endpoint:
    """One proxied OpenAI endpoint."""

    name: str
    path: str
    chat: bool


COMPLETIONS = Endpoint(name="completions", path="/v1/completions", chat=False)
CHAT_COMPLETIONS = Endpoint(name="chat_completions", path="/v1/chat/completions", chat=True)

_VALUE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "too_short", "too_long", "string_too_short", "string_too_long",
                 "finite_number"}


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode the body; 400 ``invalid_json`` / ``invalid_type`` when it is not a JSON object."""
    try:
        body = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}",
                                  code="invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_type")
    return body


def _param(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc)


def _from_validation_error(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    missing = [e for e in errors if e["type"] == "missing"]
    if missing:
        param = _param(missing[0]["loc"])
        return InvalidRequestError(f"missing required field '{param}'", code="missing_field",
                                   param=param)
    # A union field (prompt) reports one error per member: name the field, not the member.
    first = errors[0]
    top = str(first["loc"][0]) if first["loc"] else None
    if top == "prompt":
        return InvalidRequestError(
            "'prompt' must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids", code="invalid_type", param="prompt")
    param = _param(first["loc"])
    code = "invalid_value" if first["type"] in _VALUE_ERRORS else "invalid_type"
    return InvalidRequestError(f"'{param}': {first['msg']}", code=code, param=param)


def validate_request(endpoint: Endpoint, body: dict[str, Any]) -> _OpenAIRequest:
    """Schema checks plus the limits of P/D mode; raises :class:`InvalidRequestError`."""
    schema = ChatCompletionRequest if endpoint.chat else CompletionRequest
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        raise _from_validation_error(exc) from exc
    if req.best_of is not None and req.best_of > 1:  # vLLM's V1 engine refuses it too
        raise InvalidRequestError("best_of > 1 is not supported", code="invalid_value",
                                  param="best_of")
    max_tokens = requested_max_tokens(req)
    if req.min_tokens is not None and max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens ({req.min_tokens}) must be at most max_tokens "
                                  f"({max_tokens})", code="invalid_value", param="min_tokens")
    if isinstance(req, CompletionRequest) and \
            any(len(p) == 0 for p in completion_prompts(req)):
        raise InvalidRequestError("'prompt' must not be empty", code="invalid_value",
                                  param="prompt")
    _normalize(body, req)
    return req


SCALARS = ("max_tokens", "max_completion_tokens", "n", "best_of", "stream", "temperature",
           "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "min_tokens")
"""Fields whose JSON value vLLM converts (a numeric string, a boolean, 8.0 for an int)."""


def _normalize(body: dict[str, Any], req: _OpenAIRequest) -> None:
    """Write each converted scalar back into ``body`` (JSON numbers of the right kind stay as
    sent: an integer temperature is a float to vLLM as it is)."""
    for name in SCALARS:
        sent, value = body.get(name), getattr(req, name, None)
        if sent is None or value is None or type(sent) is type(value):
            continue
        if isinstance(value, float) and type(sent) is int:
            continue
        body[name] = value


def requested_max_tokens(req: _OpenAIRequest) -> int | None:
    """The output budget the client asked for (chat's max_completion_tokens wins)."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Every prompt of a completion request (a batch is a list of strings or of id lists)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return list(prompt)  # type: ignore[arg-type]
    return [prompt]  # type: ignore[list-item]


def single_prompt(req: CompletionRequest) -> str | list[int]:
    """The first prompt of a validated completion request (the one placement hashes)."""
    return completion_prompts(req)[0]


def whole_request_reason(req: _OpenAIRequest) -> str | None:
    """Why ``req`` must run whole on one worker rather than split into prefill and decode (it
    asks for several choices, or holds several prompts), or None."""
    if req.n is not None and req.n > 1:
        return "n_gt_1"
    if isinstance(req, CompletionRequest) and len(completion_prompts(req)) > 1:
        return "batched_prompts"
    return None


def tokenize_model(model: object, served: list[str]) -> str:
    """The model a ``/tokenize`` or ``/detokenize`` body names; like vLLM's own endpoints the
    field is optional: without it, the only served model (400 ``missing_field`` when several
    are served or none)."""
    if model is None:
        if len(served) == 1:
            return served[0]
        listed = ", ".join(served) if served else "none is served"
        raise InvalidRequestError(f"missing required field 'model' (served: {listed})",
                                  code="missing_field", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' must be a non-empty string", code="invalid_type",
                                  param="model")
    return model
