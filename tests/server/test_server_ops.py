"""Health, readiness, metrics, debug and model routes, and the API key."""

from __future__ import annotations

import pytest

KEY = "sk-test-123"


async def test_health_and_readiness(client, engine):
    assert (await client.get("/health")).status == 200
    response = await client.get("/health/ready")
    assert response.status == 200 and await response.json() == {"ready": True, "reasons": []}
    engine.not_ready_reasons = ["tick loop stalled for 6.0 s with 2 requests pending"]
    response = await client.get("/health/ready")
    assert response.status == 503
    assert (await response.json())["reasons"] == engine.not_ready_reasons
    assert (await client.get("/health")).status == 200  # liveness is not readiness


async def test_metrics_joins_engine_and_http_metrics(client):
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    await client.get("/nowhere")
    response = await client.get("/metrics")
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
    text = await response.text()
    assert "dsv4_fake_ticks_total 2.0" in text  # the engine's registry
    assert 'dsv4_http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0' in text
    assert 'dsv4_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'dsv4_http_request_duration_seconds_count{route="/v1/completions"} 1.0' in text


async def test_debug_requests_and_models(client, engine):
    assert await (await client.get("/debug/requests")).json() == engine.debug_requests()
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("fake-model", "model", 256)]


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None),
    ("GET", "/debug/requests", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
])
async def test_api_key_guards_api_routes(make_client, engine, method, path, body):
    client = await make_client(api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = await client.request(method, path, json=body, headers=headers)
        assert response.status == 401, headers
        error = (await response.json())["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert not engine.submitted
    response = await client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status == 200


async def test_probes_stay_open_with_an_api_key(make_client):
    client = await make_client(api_key=KEY)
    for path in ("/health", "/health/ready", "/metrics"):
        assert (await client.get(path)).status == 200, path
