"""Route service latency over HTTP (issue #6, benchmark b; PRODUCT.md §3 "Route service").

``python -m foretoken.bench.route_bench [--quick] [--rate R] [--seconds S]`` prints one JSON object.
It starts the Faust worker (the route service) as a real process on topics of its own, on
a broker that answers (else the project's local one, started and stopped here), and tells
it, through the real topics, about ``WORKERS`` workers of one model: their registrations,
and KV events that put ``DOCUMENTS`` shared 16k-token prefixes on two workers each.

Then, open loop at each rate of ``RATES`` requests/s in turn (evenly spaced; it stops
climbing once the route service cannot keep up), ``POST /v1/route`` with
``PROMPT_TOKENS``-token prompts (a shared prefix + a unique suffix, packed token ids in
msgpack as the router sends them), timed from send to the full response. The bench plays
the engines: for every admitted request it publishes a ``first_token`` outcome when the
prediction says (at most ``MAX_TTFT_S`` later) and a ``completion`` ``DECODE_S`` after it,
so that the worker's queue models stay at a steady depth, and the route service works
while its agents consume outcomes and KV events, as in production.

Baseline, in the same run and process: ``GET /healthz`` on the same worker at the same
rate (the HTTP stack, the Faust web server and this client), in windows alternating with
the route windows (A B A B); reported as the route's percentiles minus the baseline's.

``in_process``: the same workers, cache and bodies on the processor's core in this process
(:func:`~foretoken.adapters.http.route_page.answer_route`: decode, hash, index lookup, 16
candidate predictions, decision, grant applied, answer encoded), requests at 500/s of
virtual time with the engines' outcomes fed back as over HTTP; CPU of the route call alone,
with the native backends (index, queue walk) and with the Python reference's.

``summary`` (flat): ``route_cpu_ms_per_request`` (in process, native; the reference's beside
it), ``p99_ms_at_500_rps`` (over HTTP; null when 500/s was not run or not sustained: fewer
than 95% of the rate achieved, or any request not answered 200), ``max_sustained_rps``
(the highest rate sustained with p99 ≤ ``SUSTAINED_P99_MS``), and per rate its p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiokafka import AIOKafkaProducer

from foretoken.adapters.kafka.producer import record_key
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.ports import free_port
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.bench.router_stack import worker_env
from foretoken.core.types import EngineBlockHash, ModelName, RequestId, WorkerId
from foretoken.ops import kafka_local
from foretoken.settings import Settings, load_settings
from foretoken.wire.codec import encode
from foretoken.wire.records import (
    BlockStored,
    KvEventBatch,
    Outcome,
    Record,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest, RouteResponse, pack_token_ids

WORKERS = 16
PROMPT_TOKENS = 32_768
PREFIX_TOKENS = 16_384
DOCUMENTS = 32
BLOCK = 16
MODEL = ModelName("bench-route-32k")
MAX_TTFT_S = 1.0
DECODE_S = 0.5
START_TIMEOUT_S = 120.0
RID_PLACEHOLDER = "r" + "0" * 11
RATES = (50.0, 100.0, 200.0, 500.0)
QUICK_RATES = (100.0, 500.0)
TARGET_MS = 5.0
TARGET_CPU_MS = 0.5
SUSTAINED_P99_MS = 100.0  # a p99 above this is a queue that grows, not a latency
SATURATED_P99_MS = 2000.0


def registrations(now: float) -> list[WorkerRegistration]:
    return [_registration(i, now) for i in range(WORKERS)]


def _registration(i: int, now: float) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=WorkerId(f"rb-{i:02d}"), model=MODEL, engine="vllm", engine_version="bench",
        block_size=BLOCK, endpoints=WorkerEndpoints(http_url=f"http://127.0.0.1:9/rb-{i:02d}"),
        scheduler=SchedulerSettings(max_num_batched_tokens=8192, max_num_seqs=256),
        gpu_blocks=200_000, config_hash="bench", ts=now,
    )  # fmt: skip


def documents(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 150_000) for _ in range(PREFIX_TOKENS)] for _ in range(DOCUMENTS)]


def kv_batches(docs: list[list[int]], now: float) -> list[KvEventBatch]:
    """Each document's blocks stored on two workers (engine hashes: arbitrary, distinct)."""
    out: list[KvEventBatch] = []
    seq: dict[int, int] = {}
    for d, doc in enumerate(docs):
        blocks = len(doc) // BLOCK
        hashes = tuple(EngineBlockHash(((d + 1) << 32) | k) for k in range(blocks))
        stored = BlockStored(block_hashes=hashes, token_ids=tuple(doc), block_size=BLOCK)
        for w in ((2 * d) % WORKERS, (2 * d + 1) % WORKERS):
            seq[w] = seq.get(w, -1) + 1
            out.append(KvEventBatch(worker_id=WorkerId(f"rb-{w:02d}"), model=MODEL, seq=seq[w],
                                    ts=now, events=(stored,)))  # fmt: skip
    return out


def body_templates(docs: list[list[int]], rng: random.Random, count: int) -> list[bytes]:
    """msgpack bodies with a fixed-width request id to replace (no encoding per request)."""
    out = []
    for i in range(count):
        suffix = [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS - PREFIX_TOKENS)]
        req = RouteRequest(
            request_id=RequestId(RID_PLACEHOLDER), model=MODEL,
            packed_token_ids=pack_token_ids(docs[i % len(docs)] + suffix),
            prompt_tokens=PROMPT_TOKENS,
        )  # fmt: skip
        out.append(msgspec.msgpack.encode(req))
    return out


class Engines:
    """Plays the engines: outcomes for admitted requests, published through Kafka."""

    def __init__(self, producer: AIOKafkaProducer, settings: Settings) -> None:
        self.producer, self.settings = producer, settings
        self.tasks: set[asyncio.Task[None]] = set()
        self.published = 0

    def admitted(self, resp: RouteResponse) -> None:
        task = asyncio.create_task(self._play(resp))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _play(self, resp: RouteResponse) -> None:
        g = resp.grant
        assert g.worker_id is not None
        ttft = min(g.predicted_ttft_s or 0.0, MAX_TTFT_S)
        await asyncio.sleep(ttft)
        await self._send(Outcome(request_id=g.request_id, ts=time.time(), kind="first_token",
                                 worker_id=g.worker_id, actual_ttft_s=ttft,
                                 engine_cached_tokens=g.cached_tokens))  # fmt: skip
        await asyncio.sleep(DECODE_S)
        await self._send(Outcome(request_id=g.request_id, ts=time.time(), kind="completion",
                                 worker_id=g.worker_id, actual_ttft_s=ttft, output_tokens=16,
                                 e2e_s=ttft + DECODE_S))  # fmt: skip

    async def _send(self, record: Record) -> None:
        await send(self.producer, self.settings, "outcomes", record)
        self.published += 1


async def send(producer: AIOKafkaProducer, settings: Settings, logical: str, rec: Record) -> None:
    await producer.send(settings.topic(logical), key=record_key(logical, rec),
                        value=encode(rec, settings.wire_format))  # fmt: skip


async def window(
    session: aiohttp.ClientSession, url: str, rate: float, seconds: float,
    bodies: list[bytes] | None, engines: Engines | None, counter: list[int],
) -> dict[str, Any]:  # fmt: skip
    """One open-loop window: latencies (s) of the requests, and their statuses."""

    async def one(i: int) -> tuple[str, float]:
        started = time.perf_counter()
        try:
            if bodies is None:
                async with session.get(url) as resp:
                    await resp.read()
                    status = str(resp.status)
            else:
                counter[0] += 1
                rid = f"r{counter[0]:011d}"
                body = bodies[i % len(bodies)].replace(RID_PLACEHOLDER.encode(), rid.encode(), 1)
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/msgpack"}
                ) as resp:
                    raw = await resp.read()
                    status = str(resp.status)
                if resp.status == 200 and engines is not None:
                    decided = msgspec.json.decode(raw, type=RouteResponse)
                    status = "admitted" if decided.grant.admitted else "rejected"
                    if decided.grant.admitted:
                        engines.admitted(decided)
        except (aiohttp.ClientError, TimeoutError) as exc:
            status = type(exc).__name__
        return status, time.perf_counter() - started

    return await open_loop(rate, seconds, one)


async def open_loop(
    rate: float, seconds: float, call: Callable[[int], Awaitable[tuple[str, float]]]
) -> dict[str, Any]:
    """``rate × seconds`` calls ``call(i)`` (→ status, latency in s) started on schedule,
    each without waiting for the others; their latencies, statuses, start lag and rate.
    The load generator's own garbage collector is off for the window: its full passes
    (27-150 ms here) stalled its event loop and landed in the latencies it measured."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return await _open_loop(rate, seconds, call)
    finally:
        if collecting:
            gc.enable()


async def _open_loop(
    rate: float, seconds: float, call: Callable[[int], Awaitable[tuple[str, float]]]
) -> dict[str, Any]:
    n = int(rate * seconds)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    lag: list[float] = []

    async def one(i: int) -> None:
        status, latency = await call(i)
        latencies.append(latency)
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


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else None


def summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for w in windows for x in w["latencies"]]
    lag = [x for w in windows for x in w["lag"]]
    statuses: dict[str, int] = {}
    for w in windows:
        for k, v in w["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "requests": len(lat), "statuses": statuses,
        "p50_ms": _ms(lat, 50), "p90_ms": _ms(lat, 90), "p99_ms": _ms(lat, 99),
        "max_ms": _ms(lat, 100),
        "dispatch_lag_p99_ms": _ms(lag, 99),
        "achieved_rps": round(float(np.mean([w["achieved_rps"] for w in windows])), 1),
    }  # fmt: skip


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(settings: Settings, worker_url: str, worker_pid: int, rates: list[float],
                seconds: float, rounds: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(7)
    docs = documents(rng)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers,
                                linger_ms=5, max_request_size=8 << 20)  # fmt: skip
    await producer.start()
    try:
        now = time.time()
        for reg in registrations(now):
            await send(producer, settings, "workers", reg)
        for batch in kv_batches(docs, now):
            await send(producer, settings, "kv_events", batch)
        await producer.flush()
        cache_url = f"{worker_url}/v1/cache/{MODEL}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                page = get_json(cache_url)
                if len(page["workers"]) == WORKERS and all(
                    w.get("blocks", {}).get("GPU", 0) > 0 for w in page["workers"].values()
                ):
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the route service did not learn the workers and their cache")
            await asyncio.sleep(0.5)
        bodies = body_templates(docs, rng, 64)
        engines = Engines(producer, settings)
        counter = [0]
        steps: list[dict[str, Any]] = []
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        ) as session:
            route_url, health_url = f"{worker_url}/v1/route", f"{worker_url}/healthz"
            for rate in rates:
                # warm-up: fills the queue models to their steady depth (not counted)
                await window(session, route_url, rate, min(seconds, 2.0), bodies, engines, counter)
                route_w: list[dict[str, Any]] = []
                base_w: list[dict[str, Any]] = []
                route_cpu = 0.0
                for _ in range(rounds):
                    base_w.append(
                        await window(session, health_url, rate, seconds, None, None, counter)
                    )
                    c0 = cpu_seconds(worker_pid)
                    route_w.append(
                        await window(session, route_url, rate, seconds, bodies, engines, counter)
                    )
                    route_cpu += cpu_seconds(worker_pid) - c0
                route, base = summary(route_w), summary(base_w)
                steps.append({
                    "rate_rps": rate, "route": route, "baseline_healthz": base,
                    "route_minus_baseline_ms": {
                        k: round(route[k] - base[k], 3) for k in ("p50_ms", "p90_ms", "p99_ms")
                    },
                    "worker_cpu_ms_per_route_request": round(
                        route_cpu / max(route["requests"], 1) * 1e3, 3
                    ),
                })  # fmt: skip
                await asyncio.gather(*list(engines.tasks), return_exceptions=True)
                if (route["p99_ms"] or 0.0) > SATURATED_P99_MS:
                    break  # the route service cannot keep up: higher rates only queue more
        stats: Any = None
        with contextlib.suppress(OSError, ValueError):
            stats = get_json(f"{worker_url}/v1/stats", timeout_s=30.0)
        sustained = [s["rate_rps"] for s in steps if (s["route"]["p99_ms"] or 0.0) <= TARGET_MS]
        return {
            "steps": steps,
            "highest_rate_meeting_target_rps": max(sustained) if sustained else None,
            "outcomes_published": engines.published,
            "worker_consumed": None if stats is None else stats.get("consumed"),
        }
    finally:
        await producer.stop()


def replay_vs_walk(depths: tuple[int, ...] = (4, 16, 64), calls: int = 200) -> dict[str, Any]:
    """In process, same queues: a new request's prediction by a full replay of the queue
    (the route service before the recorded future) against a walk through the recorded
    future (now); CPU µs per prediction, each worker's future recorded once."""
    from foretoken.core.queue.inflight import InFlightEstimate
    from foretoken.core.queue.scheduler import CurveStepCost, NewRequest, simulate_until_first_token

    cost = CurveStepCost(lambda n: 1.5e-4 * n + 2.5e-9 * n * n, 0.004, 1e-4)
    settings = SchedulerSettings(max_num_batched_tokens=8192, max_num_seqs=256)
    rng = random.Random(3)
    out: dict[str, Any] = {}
    for depth in depths:
        est = InFlightEstimate(settings)
        for i in range(depth):
            est.advance(100.0 + 0.05 * i, cost)
            est.arrive(i, 100.0 + 0.05 * i, rng.randrange(500, 32_768), 0, 64)
        now = 100.0 + 0.05 * depth
        est.advance(now, cost)
        state = est.state()
        news = [NewRequest(rng.randrange(500, 32_768), 0) for _ in range(calls)]
        t0 = time.thread_time()
        full = [simulate_until_first_token(settings, state, n, now, cost).ttft_s for n in news]
        t1 = time.thread_time()
        walked = [est.predict(n, now, cost).ttft_s for n in news]
        t2 = time.thread_time()
        worst = max(abs(a - b) / max(a, 1e-9) for a, b in zip(full, walked, strict=True))
        out[f"queue_{depth}"] = {
            "full_replay_us": round((t1 - t0) / calls * 1e6, 1),
            "walk_us": round((t2 - t1) / calls * 1e6, 1),
            "speedup": round((t1 - t0) / max(t2 - t1, 1e-9), 1),
            "max_relative_difference": worst,
        }
    return out


def in_process(backend: str, requests: int, rate: float = 500.0) -> dict[str, Any]:
    """The route call on the processor's core in this process (``backend``: "native" for
    the native index and queue walk, "python" for the Python reference's); CPU ms per
    request (thread time of the call alone)."""
    import dataclasses
    import heapq

    from foretoken.adapters.http.route_page import answer_route, limits_of
    from foretoken.compose import build_core
    from foretoken.core.index.protocol import make_index
    from foretoken.core.queue import native_walk
    from foretoken.wire.route_rpc import decode_route_request

    settings = load_settings()
    predictor = dataclasses.replace(settings.predictor, queue_walk=backend)  # type: ignore[arg-type]
    core = build_core(settings, index=make_index(backend), predictor=predictor)  # type: ignore[arg-type]
    rng = random.Random(7)
    docs = documents(rng)
    t0 = 1_000_000.0
    regs = {r.worker_id: r for r in registrations(t0)}
    for reg in regs.values():
        core.register(reg)
    for batch in kv_batches(docs, t0):
        core.index.apply(batch, t0)
    bodies = body_templates(docs, rng, 64)
    limits = limits_of(settings.route)  # decoded as the route service does, in the timing
    pending: list[tuple[float, int, Outcome]] = []
    cpu: list[float] = []
    admitted = 0
    next_expire = t0
    for i in range(requests):
        now = t0 + i / rate
        while pending and pending[0][0] <= now:
            at, _, outcome = heapq.heappop(pending)
            core.on_outcome(outcome, at)
        if now >= next_expire:
            core.expire(now)
            next_expire = now + 1.0
        body = bodies[i % len(bodies)].replace(RID_PLACEHOLDER.encode(), f"r{i:011d}".encode(), 1)
        c0 = time.thread_time()
        raw = answer_route(core, regs, decode_route_request(body, limits), now)
        cpu.append(time.thread_time() - c0)
        g = msgspec.json.decode(raw, type=RouteResponse).grant
        if g.admitted and g.worker_id is not None:
            admitted += 1
            ttft = min(g.predicted_ttft_s or 0.0, MAX_TTFT_S)
            first = Outcome(request_id=g.request_id, ts=now + ttft, kind="first_token",
                            worker_id=g.worker_id, actual_ttft_s=ttft,
                            engine_cached_tokens=g.cached_tokens)  # fmt: skip
            done = Outcome(request_id=g.request_id, ts=now + ttft + DECODE_S,
                           kind="completion", worker_id=g.worker_id, actual_ttft_s=ttft,
                           output_tokens=16, e2e_s=ttft + DECODE_S)  # fmt: skip
            heapq.heappush(pending, (now + ttft, 2 * i, first))
            heapq.heappush(pending, (now + ttft + DECODE_S, 2 * i + 1, done))
    warm = cpu[len(cpu) // 5 :]  # the queue models at their steady depth
    ms = np.array(warm) * 1e3
    return {
        "backend": backend,
        "native_walk": native_walk.MODELED and backend == "native",
        "requests": requests,
        "virtual_rate_rps": rate,
        "admitted": admitted,
        "cpu_ms_per_request_mean": round(float(ms.mean()), 4),
        "cpu_ms_p50": round(float(np.percentile(ms, 50)), 4),
        "cpu_ms_p99": round(float(np.percentile(ms, 99)), 4),
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The flat figures: CPU per request (in process, native and reference), and over HTTP
    the p99 at 500/s (null when not sustained) and the highest rate sustained."""
    native, reference = result["in_process"]["native"], result["in_process"]["python"]
    per_rate: dict[str, Any] = {}
    sustained: list[float] = []
    for step in result["steps"]:
        route, rate = step["route"], step["rate_rps"]
        answered = route["statuses"].get("admitted", 0) + route["statuses"].get("rejected", 0)
        ok = (route["achieved_rps"] >= 0.95 * rate and answered == route["requests"]
              and (route["p99_ms"] or 0.0) <= SUSTAINED_P99_MS)  # fmt: skip
        if ok:
            sustained.append(rate)
        per_rate[f"{rate:g}"] = {
            "p99_ms": route["p99_ms"],
            "sustained": ok,
            "worker_cpu_ms": step["worker_cpu_ms_per_route_request"],
        }
    at_500 = per_rate.get("500")
    ratio = reference["cpu_ms_per_request_mean"] / native["cpu_ms_per_request_mean"]
    return {
        "route_cpu_ms_per_request": native["cpu_ms_per_request_mean"],
        "route_cpu_ms_p99": native["cpu_ms_p99"],
        "p99_ms_at_500_rps": at_500["p99_ms"] if at_500 and at_500["sustained"] else None,
        "max_sustained_rps": max(sustained) if sustained else None,
        "native_walk": native["native_walk"],
        "by_rate": per_rate,
        "reference": {
            "route_cpu_ms_per_request": reference["cpu_ms_per_request_mean"],
            "route_cpu_ms_p99": reference["cpu_ms_p99"],
        },
        "ratio": {"route_cpu_ms_per_request": round(ratio, 2)},
        "target": {"route_cpu_ms_per_request": TARGET_CPU_MS, "p99_ms_at_500_rps": TARGET_MS},
    }


def run(quick: bool, *, rate: float | None = None, seconds: float | None = None,
        replicas: int = 1) -> dict[str, Any]:  # fmt: skip
    if replicas > 1:  # one route replica against two, side by side (route_replicas.py)
        from foretoken.bench.route_replicas import run_replicas

        return run_replicas(quick, replicas, seconds=seconds)
    rates = [rate] if rate else list(QUICK_RATES if quick else RATES)
    seconds = seconds or (2.0 if quick else 5.0)
    rounds = 1 if quick else 2
    base = load_settings()
    _status, started = kafka_local.up(base)  # none started when one answers
    tmp = Path(tempfile.mkdtemp(prefix="foretoken-route-bench-"))
    prefix, port = f"rt{uuid.uuid4().hex[:8]}-", free_port()
    env = worker_env(base, prefix, port, tmp / "worker-data")
    settings = load_settings(env={**os.environ, **env})
    proc = None
    try:
        asyncio.run(ensure_topics(settings))
        proc = spawn(foretoken_cmd("worker"), env, tmp / "worker.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", START_TIMEOUT_S, proc)
        result = asyncio.run(drive(settings, url, proc.pid, rates, seconds, rounds))
    except BaseException:
        with contextlib.suppress(OSError):
            print((tmp / "worker.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        if proc is not None:
            stop(proc)
        if started:
            kafka_local.down(base)
    setup = {
        "workers": WORKERS, "prompt_tokens": PROMPT_TOKENS, "rates_rps": rates,
        "window_s": seconds, "rounds": rounds, "documents": DOCUMENTS,
        "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip
    requests = 1500 if quick else 5000
    out = {
        "setup": setup,
        "in_process": {b: in_process(b, requests) for b in ("native", "python")},
        "replay_vs_walk": replay_vs_walk(),
        **result,
        "target": {"route_p99_ms_at_most": TARGET_MS, "at_rate_rps": 500.0},
    }
    out["summary"] = summarize(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--replicas", type=int, default=1, help="2: one replica against two")
    parser.add_argument("--in-process", choices=["native", "python"], help="only that")
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(in_process(args.in_process, args.requests)))
        return
    result = run(args.quick, rate=args.rate, seconds=args.seconds, replicas=args.replicas)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
