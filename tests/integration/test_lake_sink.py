"""The worker's lake sink end to end: fleet (small.toml, real time), ingest, router and the
Faust worker on the real broker; requests sent with ``foretoken load``; the lake that the
worker writes holds every request exactly once — also when the worker is SIGKILLed in the
middle of a run and restarted (at-least-once delivery, deduped by request id), while the
sink compacts the hours it writes to."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from foretoken.adapters.lake.report import report
from foretoken.adapters.lake.views import connect, query
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.settings import Settings
from tests.conftest import WORKER_START_S
from tests.integration.stack import Stack, start_stack

pytestmark = pytest.mark.integration
LOAD_S = 600.0
LAKE_WAIT_S = 150.0
TEST_TIMEOUT_S = 900  # stack start, two loads, a kill and a restart on a loaded machine
SETTLE_S = 6.0  # after the counts match: long enough for a doubled record to show up
BOUNDS = "5:0.3,none:0.7"


@pytest.fixture(scope="module")
def lake_stack(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("lake")
    lake = tmp / "lake"
    stack = start_stack(
        kafka_settings, tmp,
        FORETOKEN_LAKE_DIR=str(lake),
        FORETOKEN_LAKE_BATCH_S="0.5",
        # Every hour counts as closed: compaction runs every 3 s on the hours being written,
        # racing the appends and the readers.
        FORETOKEN_LAKE_COMPACT_INTERVAL_S="3",
        FORETOKEN_LAKE_COMPACT_AFTER_S="-7200",
    )  # fmt: skip
    yield stack
    stack.stop_all()
    for log in sorted(tmp.rglob("*.log")):
        print(f"--- {log}\n{log.read_text()[-3000:]}")


def _load(
    stack: Stack, trace: str, limit: int, speedup: float, out: Path, max_output_tokens: int = 4
) -> subprocess.Popen[bytes]:
    return spawn(foretoken_cmd(
        "load", "--url", stack.router_url, "--model", stack.engines[0]["model"],
        "--trace", trace, "--limit", str(limit), "--speedup", str(speedup), "--bounds", BOUNDS,
        "--max-output-tokens", str(max_output_tokens), "--concurrency", "64", "--timeout-s", "120",
        "--out", str(out), "--no-progress",
    ), stack.worker.env, out.with_suffix(".log"))  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], out: Path) -> pl.DataFrame:
    assert proc.wait(timeout=LOAD_S) == 0, out.with_suffix(".log").read_text()[-2000:]
    return pl.read_parquet(out)


def _lake_ids(lake: Path, prefix: str) -> tuple[list[str], int]:
    """(request ids in the deduped ``graded`` view, rows in ``graded_raw``) for ``prefix``."""
    con = connect(lake)
    try:
        like = [f"{prefix}%"]
        ids = query(con, "SELECT request_id FROM graded WHERE request_id LIKE ?", like)
        raw = query(con, "SELECT count(*) AS n FROM graded_raw WHERE request_id LIKE ?", like)
    finally:
        con.close()
    return ids["request_id"].to_list(), int(raw["n"][0])


def _wait_for_lake(lake: Path, prefix: str, expected: int) -> list[str]:
    deadline = time.monotonic() + LAKE_WAIT_S
    ids: list[str] = []
    while time.monotonic() < deadline:
        ids, _ = _lake_ids(lake, prefix) if lake.exists() else ([], 0)
        if len(ids) >= expected:
            break
        time.sleep(1.0)
    time.sleep(SETTLE_S)
    ids, _ = _lake_ids(lake, prefix)
    return ids


def _check(lake: Path, prefix: str, client: pl.DataFrame) -> dict[str, Any]:
    sent = client["request_id"].to_list()
    ids = _wait_for_lake(lake, prefix, len(sent))
    assert len(ids) == len(set(ids)), "the graded view holds a request id twice"
    assert sorted(ids) == sorted(sent), (
        f"lost {sorted(set(sent) - set(ids))[:10]}, unexpected {sorted(set(ids) - set(sent))[:10]}"
    )
    # The lake agrees with what the client saw: every 200 was admitted (graded served, or
    # error when the engine failed mid-stream), every 429 — every 400 for a prompt larger
    # than any worker's KV cache, and every 503 for a model no worker serves — was a rejection.
    con = connect(lake)
    try:
        counts = query(con, "SELECT admitted, status, count(*) AS n FROM graded "
                            "WHERE request_id LIKE ? GROUP BY ALL", [f"{prefix}%"])  # fmt: skip
    finally:
        con.close()
    by_status = {f"{'admitted' if a else 'not admitted'} {st}": n for a, st, n in counts.rows()}
    admitted = int(counts.filter(pl.col("admitted"))["n"].sum())
    refused = int(counts.filter(~pl.col("admitted"))["n"].sum())
    assert admitted == client.filter(pl.col("status") == 200).height, (
        by_status,
        client_counts(client),
    )
    assert refused == client.filter(pl.col("status").is_in([400, 429, 503])).height, by_status
    assert by_status.get("not admitted rejected", 0) == refused  # rejected <=> not admitted
    return by_status


def client_counts(client: pl.DataFrame) -> dict[Any, int]:
    return dict(client.group_by("status").len().rows())


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_request_lands_in_the_lake_once(lake_stack: Stack) -> None:
    lake = Path(lake_stack.worker.env["FORETOKEN_LAKE_DIR"])
    tmp = lake_stack.tmp
    client = _finish(_load(lake_stack, "azure-conv", 150, 2.0, tmp / "azure.parquet"),
                     tmp / "azure.parquet")  # fmt: skip
    assert client.height == 150
    _check(lake, "az-", client)
    summary = report(lake)
    assert summary["totals"]["requests"] == 150  # the report counts each request once
    stats = get_json(f"{lake_stack.worker.url}/v1/stats")
    assert stats["lake"]["records"] >= 150 and stats["lake"]["failed"] == 0
    deadline = time.monotonic() + 30.0  # the sink compacts what it wrote
    while stats["lake"]["compacted_hours"] == 0 and time.monotonic() < deadline:
        time.sleep(1.0)
        stats = get_json(f"{lake_stack.worker.url}/v1/stats")
    assert stats["lake"]["compacted_hours"] >= 1


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_worker_killed_mid_run_loses_and_doubles_nothing(lake_stack: Stack) -> None:
    lake = Path(lake_stack.worker.env["FORETOKEN_LAKE_DIR"])
    tmp = lake_stack.tmp
    out = tmp / "mooncake.parquet"
    n = 300
    # Long answers keep many requests between their grant and their completion when the
    # worker dies: those are the ones a worker that acked too early would lose.
    load = _load(lake_stack, "mooncake", n, 4.0, out, max_output_tokens=256)
    try:
        deadline = time.monotonic() + LOAD_S  # kill once the sink has written part of the run
        while time.monotonic() < deadline and load.poll() is None:
            if lake.exists() and len(_lake_ids(lake, "mc-")[0]) >= n // 5:
                break
            time.sleep(0.5)
        assert load.poll() is None, "the load ended before the worker could be killed"
        old = lake_stack.worker_proc
        assert old is not None
        os.killpg(old.pid, signal.SIGKILL)
        old.wait()
        written_before_kill = len(_lake_ids(lake, "mc-")[0])
        assert written_before_kill < n, "the whole run was in the lake before the kill"
        # The same worker again: same group, port, data and lake directories.
        lake_stack.worker_proc = spawn(foretoken_cmd("worker"), lake_stack.worker.env,
                                       tmp / "worker-restarted.log")  # fmt: skip
        wait_http(f"{lake_stack.worker.url}/healthz", WORKER_START_S, lake_stack.worker_proc)
        client = _finish(load, out)
    finally:
        if load.poll() is None:
            stop(load)
    assert client.height == n
    by_status = _check(lake, "mc-", client)
    _ids, raw = _lake_ids(lake, "mc-")
    print(f"lake: {written_before_kill} of {n} before the kill; {raw} raw rows now; {by_status}")
