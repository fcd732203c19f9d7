"""The router's choice among several route services (no network here: the order of the
attempts; failover against real killed replicas is tests/integration/test_scale_out.py)."""

from __future__ import annotations

import time

from foretoken.adapters.http.route_client import RouteClient
from foretoken.settings import load_settings
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import Member

URLS = "http://r0:1,http://r1:1,http://r2:1"


def _client(**env: str) -> RouteClient:
    client = RouteClient(load_settings(env={"FORETOKEN_ROUTE_URLS": URLS, **env}))
    for s in client.services.values():
        s.ready = True
    return client


def test_one_route_url_is_the_single_call_of_before() -> None:
    client = RouteClient(load_settings(env={}))
    assert client.single and [s.url for s in client.order("m", None)] == ["http://127.0.0.1:6066"]


def test_requests_are_spread_and_a_conversation_sticks_to_its_replica() -> None:
    client = _client()
    firsts = [client.order("m", None)[0].url for _ in range(6)]
    assert set(firsts) == set(URLS.split(","))  # round robin over the ready ones
    assert len(client.order("m", None)) == 3  # the others follow, for failover
    conv = {client.order("m", "conv-7")[0].url for _ in range(5)}
    assert len(conv) == 1  # the same replica holds the conversation's stickiness


def test_only_ready_services_are_tried_and_a_failed_one_is_skipped_a_while() -> None:
    client = _client()
    client.services["http://r1:1"].ready = False  # /healthz said 503 (catching up)
    client._failed(client.services["http://r2:1"])
    assert [s.url for s in client.order("m", None)] == ["http://r0:1"]
    client.services["http://r0:1"].ready = False
    assert client.order("m", None) == []  # none ready: the router decides alone
    client.services["http://r2:1"].skip_until = time.monotonic() - 1
    assert [s.url for s in client.order("m", None)] == ["http://r2:1"]


def test_sharded_the_owner_of_the_model_is_asked_first() -> None:
    client = _client(FORETOKEN_ROUTE_MEMBERS="true", FORETOKEN_APP_ID="app")
    assert client.members is not None
    now = time.time()
    for i, parts in enumerate(((0, 1), (2, 3))):
        client.members.apply(Member(
            instance_id=f"s{i}", role="route", url=f"http://r{i}:1", group="app-route",
            sharding="model", partitions=parts, ready=True, ts=now,
        ))  # fmt: skip
    for model in ("a", "b", "c", "d", "e"):
        owner = "http://r0:1" if model_partition(model, 4) in (0, 1) else "http://r1:1"
        assert all(client.order(model, None)[0].url == owner for _ in range(4))
