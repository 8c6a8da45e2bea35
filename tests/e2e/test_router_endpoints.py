"""The vLLM endpoints clients reach for, through the router to real workers."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, Plain
from tests.support.metrics import scrape

pytestmark = pytest.mark.vllm


def test_models_retrieve_with_the_openai_sdk(cluster: Cluster) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    model = client.models.retrieve(SERVED_NAME)
    assert model.id == SERVED_NAME and model.owned_by == "pdserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_and_detokenize_match_a_plain_server(cluster: Cluster, plain: Plain) -> None:
    body = {"model": SERVED_NAME, "prompt": "The copper lantern by the river."}
    ours = httpx.post(f"{cluster.url}/tokenize", json=body, timeout=30)
    ref = httpx.post(f"{plain.url}/tokenize", json=body, timeout=30)
    assert ours.status_code == 200, ours.text
    assert ours.json()["tokens"] == ref.json()["tokens"] and ours.json()["count"] > 3
    back = httpx.post(f"{cluster.url}/detokenize", timeout=30,
                      json={"model": SERVED_NAME, "tokens": ours.json()["tokens"]})
    assert back.status_code == 200 and "copper lantern" in back.json()["prompt"]
    missing = httpx.post(f"{cluster.url}/tokenize", json={**body, "model": "nope"}, timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    # "model" is optional, as on vLLM's own /tokenize: the only served model answers
    no_model = httpx.post(f"{cluster.url}/tokenize", json={"prompt": body["prompt"]}, timeout=30)
    assert no_model.status_code == 200, no_model.text
    assert no_model.json()["tokens"] == ref.json()["tokens"]
    # what only the worker refuses comes back in the stable envelope
    bad = httpx.post(f"{cluster.url}/detokenize", json={"tokens": "x"}, timeout=30)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_type", err
    assert err["param"] == "tokens", err


def test_version(cluster: Cluster) -> None:
    resp = httpx.get(f"{cluster.url}/version", timeout=30)
    assert resp.status_code == 200, resp.text
    assert set(resp.json()) == {"version", "pdserve", "vllm"}
    assert str(resp.json()["vllm"]).startswith("0.32."), resp.json()


BAD_SAMPLING = [
    {"temperature": "hot"}, {"temperature": -1}, {"top_p": 5}, {"top_k": -2},
    {"repetition_penalty": 0}, {"seed": "x"}, {"max_tokens": 2, "min_tokens": 3},
]
"""Sampling parameters a plain vLLM server refuses with 400 and the router refuses itself."""


def _routed(url: str) -> float:
    """Requests the router has given a path (whole, P/D, ...): a refused one gets none."""
    return sum(v for (name, _), v in scrape(url).items() if name == "pdserve_router_paths_total")


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_sampling_parameters_are_refused_as_a_plain_server_refuses_them(
        cluster: Cluster, plain: Plain, endpoint: str) -> None:
    """Each is a 400 from both; ours is the stable envelope naming the same parameter (vLLM's
    ``body.`` prefix dropped) and no worker was asked. A value vLLM checks against the model
    (a ``logit_bias`` token outside the vocabulary) is refused by the worker, and its answer
    reaches the client in the same envelope. Control: the same body with good values, also
    as strings vLLM converts, is served alike by both."""
    base: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 4, "temperature": 0}
    base.update({"prompt": "The copper lantern"} if endpoint == "completions" else
                {"messages": [{"role": "user", "content": "The copper lantern"}]})
    for good in (base, {**base, "max_tokens": "4", "temperature": "0", "seed": "42"}):
        answers = [httpx.post(f"{url}/v1/{endpoint}", json=good, timeout=60)
                   for url in (cluster.url, plain.url)]
        assert [r.status_code for r in answers] == [200, 200], answers[0].text
        assert answers[0].json()["choices"] == answers[1].json()["choices"]
    for bad in [*BAD_SAMPLING, {"logit_bias": {"99999999": 1}}]:
        body = {**base, **bad}
        routed = _routed(cluster.url)
        ours = httpx.post(f"{cluster.url}/v1/{endpoint}", json=body, timeout=60)
        ref = httpx.post(f"{plain.url}/v1/{endpoint}", json=body, timeout=60)
        assert (ours.status_code, ref.status_code) == (400, 400), (bad, ours.text, ref.text)
        error, ref_error = ours.json()["error"], ref.json()["error"]
        assert error["type"] == "invalid_request_error" and isinstance(error["code"], str), error
        ref_param = ref_error.get("param")
        if ref_param is not None:
            assert error["param"] == ref_param.removeprefix("body."), (bad, error, ref_error)
        if "logit_bias" not in bad:  # refused before any worker was asked
            assert _routed(cluster.url) == routed, bad
