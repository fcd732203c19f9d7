"""Out of one process (issue 19), as real processes on the real broker: a primary (grading,
lake, snapshots), two route replicas (``foretoken worker --role route``) and two routers on
one port (``router.processes``, SO_REUSEPORT) asking the replicas, in front of a simulated fleet.

In one load: a replica is SIGKILLed — no client sees an error, and every request is still
decided by a replica (no grant is the router's ``fallback``) within the route timeout; the
replica comes back, catches up from the primary's snapshot and its offsets, and answers again;
then the primary is SIGKILLed and restarted — and the lake holds exactly the client's
request ids."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import polars as pl
import pytest

from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop
from foretoken.settings import Settings
from tests.integration.stack import ScaledStack, start_scaled_stack
from tests.integration.test_lake_sink import BOUNDS, _check, client_counts

pytestmark = pytest.mark.integration
REQUESTS = 400
SPEEDUP = 2.5  # azure-conv: ~10 requests/s, ~40 s
ROUTE_TIMEOUT_S = 2.0  # generous: 9 processes share a loaded 2-core machine
TEST_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def scaled(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScaledStack]:
    tmp = tmp_path_factory.mktemp("scaled")
    stack = start_scaled_stack(
        kafka_settings, tmp, route_timeout_s=ROUTE_TIMEOUT_S,
        FORETOKEN_LAKE_DIR=str(tmp / "lake"), FORETOKEN_LAKE_BATCH_S="0.5",
    )  # fmt: skip
    yield stack
    stack.stop_all()
    for log in sorted(tmp.rglob("*.log")):
        print(f"--- {log}\n{log.read_text()[-2500:]}")


def _kill(stack: ScaledStack, name: str) -> None:
    proc = stack.procs[name]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _stats(url: str) -> dict[str, Any]:
    return dict(get_json(f"{url}/v1/stats", timeout_s=10.0))


def _router_pids(url: str, tries: int = 40) -> set[int]:
    """The processes answering on the shared port (a new connection each time)."""
    pids = set()
    for _ in range(tries):
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as resp:
            pids.add(int(__import__("json").loads(resp.read())["pid"]))
    return pids


def _fallbacks(url: str, tries: int = 40) -> int:
    """Router fallback decisions, summed over the routers answering on the port."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as resp:
            pid = int(__import__("json").loads(resp.read())["pid"])
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        seen[pid] = int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith("foretoken_router_fallbacks_total")))  # fmt: skip
    return sum(seen.values())


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_replica_and_primary_killed_mid_load(scaled: ScaledStack) -> None:
    tmp = scaled.tmp
    assert len(_router_pids(scaled.router_url)) == 2, "both routers answer on the shared port"
    for replica in scaled.replicas:
        health = get_json(f"{replica.url}/healthz")
        assert health["status"] == "ok" and health["role"] == "route"
    out = tmp / "client.parquet"
    load = spawn(foretoken_cmd(
        "load", "--url", scaled.router_url, "--model", scaled.engines[0]["model"],
        "--trace", "azure-conv", "--limit", str(REQUESTS), "--speedup", str(SPEEDUP),
        "--bounds", BOUNDS, "--max-output-tokens", "8", "--concurrency", "64",
        "--timeout-s", "120", "--out", str(out), "--no-progress",
    ), scaled.primary.env, tmp / "load.log")  # fmt: skip
    victim = scaled.replicas[0]
    try:
        deadline = time.monotonic() + 60.0  # mid-load: once the victim has answered some
        while (before := _stats(victim.url)["routes_answered"]) < 20:
            assert time.monotonic() < deadline and load.poll() is None, (
                "the router spreads requests over both replicas"
            )
            time.sleep(0.5)
        _kill(scaled, "replica0")  # mid-load, with route calls in flight
        time.sleep(3.0)
        scaled.restart("replica0", victim)  # back: catches up, /healthz 200 when ready
        restarted = _stats(victim.url)
        assert restarted["restored_from_snapshot"], "it started from the primary's snapshot"
        assert restarted["readiness"]["status"] == "ok"
        _kill(scaled, "primary")  # grading stops; routing goes on through the replicas
        time.sleep(3.0)
        scaled.restart("primary", scaled.primary)
        assert load.wait(timeout=TEST_TIMEOUT_S / 2) == 0, (tmp / "load.log").read_text()[-2000:]
    finally:
        if load.poll() is None:
            stop(load)
    client = pl.read_parquet(out)
    assert client.height == REQUESTS
    counts = client_counts(client)
    # no client error: every answer is a 200, or a 429/400 the route service decided
    assert set(counts) <= {200, 429, 400}, counts
    assert client.filter(pl.col("error").is_not_null() & (pl.col("status") == 200)).height == 0
    used_again = _stats(victim.url)["routes_answered"]
    assert used_again > 0, "the restarted replica is used again"
    lake = tmp / "lake"
    _check(lake, "az-", client)  # the lake's request ids are the client's, each once
    from foretoken.adapters.lake.views import connect, query

    con = connect(lake)
    try:
        fell_back = query(con, "SELECT count(*) AS n FROM graded WHERE fallback")["n"][0]
    finally:
        con.close()
    assert fell_back == 0, "every request was decided by a route replica"
    assert _fallbacks(scaled.router_url) == 0
    print(f"client {counts}; replica0 answered {before} before the kill, {used_again} after")
