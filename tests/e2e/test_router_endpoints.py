"""The vLLM endpoints clients reach for, through the router to real workers."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import SERVED_NAME, Cluster, Plain

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
