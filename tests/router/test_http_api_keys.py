"""API keys on every `/v1` route of the HTTP API, over real HTTP to a router process.

With keys configured (as vLLM's `--api-key`), every `/v1` route, the model list and unknown
routes included, answers 401 in OpenAI's shape without a known key, before reading the body;
with a key the request goes on (here to a router with no reachable worker: 503). `/health` and
`/metrics` stay open.
"""

from __future__ import annotations

import httpx
import pytest

from tests.router.test_openai_schema import assert_openai_error, start_http_router
from tests.helpers import stop_process

KEY = "sk-http-key-0001"


@pytest.fixture(scope="module")
def keyed(smollm2_gguf_path):
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_API_KEYS", f"{KEY}:alice")
    try:
        p, base = start_http_router(smollm2_gguf_path)
    finally:
        mp.undo()
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            yield client
    finally:
        stop_process(p, timeout_s=15)


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/v1/completions"), ("GET", "/v1/nothing-here"), ("GET", "/v1"),
          ("GET", "/v1/models/"), ("POST", "/v1/tokenize")]


@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong-key-99", f"Basic {KEY}", "Bearer",
                                  f"Bearer {KEY}x"])
def test_every_v1_route_needs_a_known_key(keyed, method, path, auth):
    headers = {"authorization": auth} if auth is not None else {}
    r = keyed.request(method, path, content=b'{"not json', headers=headers)
    err = assert_openai_error(r, 401)
    assert err["code"] == "invalid_api_key"


def test_a_known_key_passes_and_open_routes_stay_open(keyed):
    key = {"authorization": f"Bearer {KEY}"}
    models = keyed.get("/v1/models", headers=key)
    assert models.status_code == 200 and models.json()["data"]
    # Past the door: the body is read and validated, then no worker answers.
    assert_openai_error(keyed.post("/v1/completions", content=b'{"not json', headers=key), 400)
    assert_openai_error(keyed.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                   headers=key), 503)
    assert_openai_error(keyed.get("/v1/nothing-here", headers=key), 404)
    assert keyed.get("/health").status_code == 200
    metrics = keyed.get("/metrics")
    assert metrics.status_code == 200 and "pdserve:" in metrics.text
    # Two authorization headers: refused, whichever holds the key.
    r = keyed.get("/v1/models", headers=[("authorization", f"Bearer {KEY}"),
                                         ("authorization", "Bearer other-key-000")])
    assert_openai_error(r, 401)
