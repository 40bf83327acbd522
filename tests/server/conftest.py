"""In-process servers over the fake engine, served the way run_server serves them."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_engine import FakeEngine  # tests/server is on sys.path: pytest's rootdir-less import mode

from dsv4.config import ServerArgs
from dsv4.server.app import build_app


class ProductionLikeServer(TestServer):
    """aiohttp's TestServer cancels handlers on disconnect; run_server does not, so neither do we:
    the tests must prove that the server's own disconnect handling aborts engine requests."""

    async def _make_runner(self, **kwargs):
        kwargs["handler_cancellation"] = False
        kwargs["shutdown_timeout"] = 2.0  # bounds every test's teardown
        return await super()._make_runner(**kwargs)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def make_client(engine):
    clients = []

    async def make(**arg_overrides) -> TestClient:
        args = ServerArgs(**{"served_model_name": "fake-model", "max_request_bytes": 64 * 1024, **arg_overrides})
        client = TestClient(ProductionLikeServer(build_app(engine, args)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client) -> TestClient:
    return await make_client()
