"""A worker's 4xx answer leaves the router in the stable envelope (router.api.upstream_errors).

The bodies are what vLLM 0.32's OpenAI server answers (captured from a running worker), plus the
older and plain-FastAPI shapes.
"""

from __future__ import annotations

import json

import pytest

from router.api.relay import relay_body
from router.api.upstream_errors import stable_error_body, upstream_api_error

VLLM_PARSE = json.dumps({"error": {
    "message": "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature', "
               "'msg': 'Input should be a valid number, unable to parse string as a number', "
               "'input': 'hot'}",
    "type": "Bad Request", "param": "body.temperature", "code": 400}}).encode()
VLLM_RANGE = json.dumps({"error": {
    "message": "temperature must be non-negative, got -1.0.", "type": "BadRequestError",
    "param": "temperature", "code": 400}}).encode()

CASES = [
    # (id, body, status, message, param, code)
    ("vllm-pydantic", VLLM_PARSE, 400,
     "'temperature': Input should be a valid number, unable to parse string as a number",
     "temperature", "invalid_type"),
    ("vllm-range", VLLM_RANGE, 400, "temperature must be non-negative, got -1.0.",
     "temperature", "invalid_value"),
    ("vllm-no-param", b'{"error":{"message":"stop cannot contain an empty string.",'
     b'"type":"BadRequestError","param":null,"code":400}}', 400,
     "stop cannot contain an empty string.", None, "invalid_value"),
    ("old-vllm", b'{"object":"error","message":"bad top_p","type":"BadRequestError",'
     b'"param":"top_p","code":400}', 400, "bad top_p", "top_p", "invalid_value"),
    ("stable-code-kept", b'{"error":{"message":"nope","type":"invalid_request_error",'
     b'"param":"model","code":"model_not_found"}}', 404, "nope", "model", "model_not_found"),
    ("fastapi-detail", b'{"detail":"Not Found"}', 404, "Not Found", None, "not_found"),
    ("not-json", b"Request Entity Too Large", 413, "Request Entity Too Large", None,
     "request_too_large"),
    ("empty", b"", 422, "worker answered 422", None, "invalid_value"),
    ("json-not-object", b"[1]", 409, "worker answered 409", None, "conflict"),
    ("unknown-status", b'{"error":{"message":"teapot","code":418}}', 418, "teapot", None,
     "invalid_request"),
]


@pytest.mark.parametrize(("body", "status", "message", "param", "code"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_upstream_4xx_becomes_the_stable_envelope(body: bytes, status: int, message: str,
                                                  param: str | None, code: str) -> None:
    err = upstream_api_error(body, status)
    assert (err.status, err.message, err.param, err.code, err.type) == (
        status, message, param, code, "invalid_request_error")
    wire = json.loads(stable_error_body(body, status))
    assert wire == {"error": {"message": message, "type": "invalid_request_error",
                              "param": param, "code": code}}


def test_429_is_a_rate_limit_error() -> None:
    err = upstream_api_error(b'{"error":{"message":"busy","code":429}}', 429)
    assert (err.type, err.code) == ("rate_limit_error", "rate_limit_exceeded")


def test_relay_maps_4xx_and_passes_2xx_untouched() -> None:
    ok = b'{"choices":[{"text":"x"}],"code":400}'
    assert relay_body(ok, 200, "application/json").body == ok
    bad = relay_body(VLLM_RANGE, 400, "application/json")
    assert bad.status_code == 400
    assert json.loads(bad.body)["error"] == {
        "message": "temperature must be non-negative, got -1.0.",
        "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}
