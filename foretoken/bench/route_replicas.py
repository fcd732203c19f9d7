"""``foretoken bench route --replicas 2``: route-service throughput with two read replicas
against one, side by side in one run, at the same p99; the replicas' queue-view staleness and
herding (issue 19; docs/BENCHMARKS.md "Route replicas").

The workload is the route bench's (:mod:`foretoken.bench.route_bench`: 16 workers of one model,
32 shared 16k-token prefixes on two workers each, 32k-token prompts as packed ids in msgpack,
the bench playing the engines' outcomes through Kafka). Here the bench also plays the router:
it publishes every decision on ``grants`` — that is how a replica learns the other's
decisions. Route replicas (``foretoken worker --role route``) run as real processes on topics
of their own:

* **one replica**: the rate ladder (open loop, evenly spaced) against replica 0;
* **two replicas**: replica 1 is started, catches up (``/healthz`` 200), and the same ladder
  is spread round-robin over both;
* (full run) **two replicas without shares**: both restarted with
  ``predictor.replica_tie_margin_s = 0``, one rate, for the herding baseline.

Throughput at the p99 target (:data:`P99_TARGET_MS`) is the achieved rate where the ladder's
p99 crosses the target (linear between the last rate under it and the first over it);
``summary.replica_speedup`` = two replicas' / one replica's.

**Staleness**: each replica's ``/v1/stats`` ``queue_view_staleness_s``: from a decision at the
other replica (the grant's ``ts``) to that grant in this replica's queue model. **Herding**:
among the decisions of a window, the share of admitted ones that chose a worker idle in the
deciding replica's view (no queued prompt tokens ahead) which the other replica also chose,
idle in its view, within the staleness window (the measured staleness p99) — the collisions
the queue models could not prevent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiokafka import AIOKafkaProducer

from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.ports import free_port
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.bench import route_bench as rb
from foretoken.ops import kafka_local
from foretoken.settings import Settings, load_settings
from foretoken.wire.route_rpc import RouteResponse

P99_TARGET_MS = 100.0
RATES = (25.0, 50.0, 75.0, 100.0, 125.0, 150.0, 175.0, 200.0, 250.0)
QUICK_RATES = (40.0, 80.0, 120.0, 160.0, 200.0)
SATURATED_P99_MS = 1000.0
HERDING_RATE = 50.0  # the no-share baseline's rate (requests/s)
MSGPACK = {"Content-Type": "application/msgpack"}


class Decisions:
    """Every decision of a window: (replica, its ts, worker, idle in its view)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, str, bool]] = []

    def add(self, replica: int, resp: RouteResponse) -> None:
        g = resp.grant
        if g.admitted and g.worker_id is not None:
            self.rows.append((replica, g.ts, g.worker_id, g.queue_tokens_ahead == 0))


def herding(rows: Sequence[tuple[int, float, str, bool]], window_s: float) -> dict[str, Any]:
    """Admitted decisions on a worker idle in the decider's view that another replica also
    chose, idle in its view, within ``window_s`` (each colliding decision counted once)."""
    idle = sorted((ts, replica, worker) for replica, ts, worker, free in rows if free)
    herded = 0
    for i, (ts, replica, worker) in enumerate(idle):
        for j in range(i - 1, -1, -1):
            other_ts, other, other_worker = idle[j]
            if ts - other_ts > window_s:
                break
            if other != replica and other_worker == worker:
                herded += 1
                break
    admitted = len(rows)
    return {"admitted": admitted, "idle_choices": len(idle), "herded": herded,
            "herding_rate": round(herded / admitted, 4) if admitted else None,
            "window_s": round(window_s, 4)}  # fmt: skip


def throughput_at(steps: list[dict[str, Any]], target_ms: float) -> float | None:
    """The achieved rate where p99 crosses ``target_ms`` (linear between the ladder's steps);
    the highest rate measured when it never does; None when even the first misses it."""
    points = [(s["route"]["achieved_rps"], s["route"]["p99_ms"] or 0.0) for s in steps]
    if not points or points[0][1] > target_ms:
        return None
    for (r0, p0), (r1, p1) in itertools.pairwise(points):
        if p1 > target_ms:
            return round(r0 + (r1 - r0) * (target_ms - p0) / max(p1 - p0, 1e-9), 1)
    return round(points[-1][0], 1)


async def _ladder(
    settings: Settings, urls: list[str], rates: Sequence[float], seconds: float,
    bodies: list[bytes], producer: AIOKafkaProducer, counter: list[int],
) -> tuple[list[dict[str, Any]], Decisions]:  # fmt: skip
    engines = rb.Engines(producer, settings)
    decisions = Decisions()
    steps: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        for rate in rates:
            # warm-up: the queue models at their steady depth (not counted)
            await _window(session, urls, rate, min(seconds, 1.5), bodies, engines, producer,
                          settings, counter, Decisions())  # fmt: skip
            w = await _window(session, urls, rate, seconds, bodies, engines, producer,
                              settings, counter, decisions)  # fmt: skip
            summary = rb.summary([w])
            steps.append({"rate_rps": rate, "route": summary, "loadavg_1m": os.getloadavg()[0]})
            await asyncio.gather(*list(engines.tasks), return_exceptions=True)
            if (summary["p99_ms"] or 0.0) > SATURATED_P99_MS:
                break
    return steps, decisions


async def _window(
    session: aiohttp.ClientSession, urls: list[str], rate: float, seconds: float,
    bodies: list[bytes], engines: rb.Engines, producer: AIOKafkaProducer, settings: Settings,
    counter: list[int], decisions: Decisions,
) -> dict[str, Any]:  # fmt: skip
    """One open-loop window, round-robin over ``urls``; every decision is published on
    ``grants`` (as the router does), admitted ones played as the engines would."""
    n = int(rate * seconds)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    lag: list[float] = []

    async def one(i: int) -> None:
        replica = i % len(urls)
        counter[0] += 1
        rid = f"r{counter[0]:011d}"
        body = bodies[i % len(bodies)].replace(rb.RID_PLACEHOLDER.encode(), rid.encode(), 1)
        started = time.perf_counter()
        try:
            async with session.post(f"{urls[replica]}/v1/route", data=body,
                                    headers=MSGPACK) as resp:  # fmt: skip
                raw = await resp.read()
                status = str(resp.status)
            latencies.append(time.perf_counter() - started)
            if resp.status == 200:
                decided = msgspec.json.decode(raw, type=RouteResponse)
                status = "admitted" if decided.grant.admitted else "rejected"
                decisions.add(replica, decided)
                await rb.send(producer, settings, "grants", decided.grant)
                if decided.grant.admitted:
                    engines.admitted(decided)
        except (aiohttp.ClientError, TimeoutError) as exc:
            latencies.append(time.perf_counter() - started)
            status = type(exc).__name__
        statuses[status] = statuses.get(status, 0) + 1

    tasks = []
    t0 = time.perf_counter()
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag.append(max(0.0, time.perf_counter() - due))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return {"latencies": latencies, "statuses": statuses, "lag": lag,
            "achieved_rps": n / max(time.perf_counter() - t0, 1e-9)}  # fmt: skip


class Replicas:
    """Route replicas as real processes on the bench's topics."""

    def __init__(self, base: dict[str, str], tmp: Path) -> None:
        self.base, self.tmp = base, tmp
        self.procs: dict[int, Any] = {}
        self.urls: dict[int, str] = {}
        self.ports: dict[int, int] = {}

    def start(self, i: int, **extra: str) -> str:
        port = self.ports.setdefault(i, free_port())
        env = {**self.base, "FORETOKEN_ROLE": "route", "FORETOKEN_INSTANCE_ID": f"bench-{i}",
               "FORETOKEN_WEB_PORT": str(port),
               "FORETOKEN_WORKER_DATA_DIR": str(self.tmp / f"replica{i}"), **extra}  # fmt: skip
        self.procs[i] = spawn(foretoken_cmd("worker"), env, self.tmp / f"replica{i}.log")
        self.urls[i] = f"http://127.0.0.1:{port}"
        wait_http(f"{self.urls[i]}/healthz", rb.START_TIMEOUT_S, self.procs[i])  # ready
        return self.urls[i]

    def stop(self, i: int) -> None:
        stop(self.procs.pop(i))

    def stop_all(self) -> None:
        for i in list(self.procs):
            self.stop(i)


def _staleness(urls: list[str]) -> dict[str, Any]:
    out = {}
    for url in urls:
        with contextlib.suppress(OSError, ValueError):
            stats = get_json(f"{url}/v1/stats", timeout_s=30.0)
            out[url] = {"staleness_s": stats["queue_view_staleness_s"],
                        "share": stats["replica_share"], "share_moves": stats["share_moves"],
                        "rss_bytes": stats["memory"]["rss_bytes"],
                        "index_blocks": stats["memory"]["index_blocks"]}  # fmt: skip
    return out


async def _learned(urls: list[str]) -> None:
    deadline = time.monotonic() + rb.START_TIMEOUT_S
    for url in urls:
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                page = get_json(f"{url}/v1/cache/{rb.MODEL}")
                if len(page["workers"]) == rb.WORKERS and all(
                    w.get("blocks", {}).get("GPU", 0) > 0 for w in page["workers"].values()
                ):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not learn the workers and their cache")
            await asyncio.sleep(0.5)


async def _drive(settings: Settings, replicas: Replicas, rates: Sequence[float],
                 seconds: float, quick: bool) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(7)
    docs = rb.documents(rng)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                linger_ms=5, max_request_size=8 << 20)  # fmt: skip
    await producer.start()
    try:
        now = time.time()
        for reg in rb.registrations(now):
            await rb.send(producer, settings, "workers", reg)
        for batch in rb.kv_batches(docs, now):
            await rb.send(producer, settings, "kv_events", batch)
        await producer.flush()
        bodies = rb.body_templates(docs, rng, 64)
        counter = [0]
        urls = [replicas.start(0)]
        await _learned(urls)
        one, _ = await _ladder(settings, urls, rates, seconds, bodies, producer, counter)
        urls.append(replicas.start(1))
        await _learned(urls)
        await asyncio.sleep(3 * settings.worker.member_interval_s)  # both see both: shares
        two, decided = await _ladder(settings, urls, rates, seconds, bodies, producer, counter)
        stale = _staleness(urls)
        p99s = [v["staleness_s"]["p99"] for v in stale.values() if v["staleness_s"]["p99"]]
        window_s = max(p99s) if p99s else 0.05
        result: dict[str, Any] = {
            "one_replica": one, "two_replicas": two, "replicas": stale,
            "herding_with_shares": herding(decided.rows, window_s),
        }  # fmt: skip
        if not quick:  # the baseline: the same two replicas, no shares
            replicas.stop_all()
            off = {"FORETOKEN__PREDICTOR__REPLICA_TIE_MARGIN_S": "0"}
            urls = [replicas.start(0, **off), replicas.start(1, **off)]
            await _learned(urls)
            await asyncio.sleep(3 * settings.worker.member_interval_s)
            _, plain = await _ladder(settings, urls, [HERDING_RATE], seconds * 2, bodies,
                                     producer, counter)  # fmt: skip
            result["herding_without_shares"] = herding(plain.rows, window_s)
        result["staleness_window_s"] = window_s
        return result
    finally:
        await producer.stop()


def run_replicas(quick: bool, count: int = 2, *, seconds: float | None = None) -> dict[str, Any]:
    if count != 2:
        raise ValueError("the replicas bench compares one replica with two (--replicas 2)")
    rates = list(QUICK_RATES if quick else RATES)
    seconds = seconds or (2.0 if quick else 4.0)
    base_settings = load_settings()
    started = False
    if not kafka_local.accepts_connections(base_settings.kafka.bootstrap_servers):
        _status, started = kafka_local.up(base_settings)
    tmp = Path(tempfile.mkdtemp(prefix="foretoken-route-replicas-"))
    prefix = f"rr{uuid.uuid4().hex[:8]}-"
    base = {
        "FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_APP_ID": f"foretoken-{prefix}bench",
        "FORETOKEN_LOG_LEVEL": "warn", "FORETOKEN_SNAPSHOT_DIR": str(tmp / "no-primary"),
        "KAFKA_BOOTSTRAP_SERVERS": base_settings.kafka.bootstrap_servers,
    }  # fmt: skip
    settings = load_settings(env={**os.environ, **base})
    replicas = Replicas(base, tmp)
    load_start = os.getloadavg()
    try:
        asyncio.run(ensure_topics(settings))
        result = asyncio.run(_drive(settings, replicas, rates, seconds, quick))
    except BaseException:
        for log in sorted(tmp.glob("*.log")):
            with contextlib.suppress(OSError):
                print(f"--- {log}\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        replicas.stop_all()
        if started:
            kafka_local.down(base_settings)
    one_rps = throughput_at(result["one_replica"], P99_TARGET_MS)
    two_rps = throughput_at(result["two_replicas"], P99_TARGET_MS)
    speedup = round(two_rps / one_rps, 2) if one_rps and two_rps else None
    herd = result["herding_with_shares"]
    base_herd = result.get("herding_without_shares") or {}
    stale = [v["staleness_s"] for v in result["replicas"].values()]
    summary = {
        "replica_speedup": speedup,
        "throughput_one_replica_rps": one_rps,
        "throughput_two_replicas_rps": two_rps,
        "p99_target_ms": P99_TARGET_MS,
        "staleness_p50_ms": _ms(max((s["p50"] or 0.0) for s in stale) if stale else None),
        "staleness_p99_ms": _ms(result["staleness_window_s"]),
        "herding_rate": herd["herding_rate"],
        "herding_rate_without_shares": base_herd.get("herding_rate"),
        "loadavg_1m_start": round(load_start[0], 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    setup = {"workers": rb.WORKERS, "prompt_tokens": rb.PROMPT_TOKENS, "rates_rps": rates,
             "window_s": seconds, "replicas": count}  # fmt: skip
    return {"summary": summary, "setup": setup, **result}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)
