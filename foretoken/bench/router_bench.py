"""The router's added latency under load, on the live stack (PRODUCT.md §3 "Router").

``python -m foretoken.bench.router_bench [--quick] [--rate R] [--profile-dir DIR]`` prints one JSON
object. It starts, as real processes on a topic prefix of its own, the Faust worker (route
service), ``fleet run small``, ``ingest`` and ``router`` (on a broker that answers, else on
the project's local one, started and stopped here), and drives streaming ``/v1/completions``
with ``fleet/load.py`` (gamma arrivals, prompts of ~300 tokens, ``max_tokens`` 2–4) in
alternating windows against the router and against the engines directly (round-robin over
the engines file), in ABBA order (R D D R R D …) so that drift falls on both paths alike:

* ``unloaded``: one request at a time (10/s, evenly spaced, 2 windows per path): the
  router's cost without queueing;
* ``loaded``: full 6 windows of 5 s per path at 200 requests/s; quick 2 of 1.25 s at 50/s.

A warm-up window per path is not counted. Reported per phase:

* ``added_latency``: a percentile of the router-path TTFT distribution minus the same
  percentile of the direct one (p50 − p50, p99 − p99: a request takes one path, so there
  are no per-request differences), with a bootstrap 95% interval; also per engine.
* ``router_added_histogram``: the router's ``foretoken_router_added_seconds`` (arrival →
  engine call), quantiles interpolated inside buckets as Prometheus does, and the exact
  fraction ≤ 1 ms and ≤ 2 ms; ``hop_overhead``: client TTFT minus the router's own TTFT
  (its ``first_token`` outcome), per request.
* per path: counts (ok, 429, failed), achieved rates, the load generator's dispatch lag,
  CPU per process (cores, ms per request) and ``others`` (the rest of the machine's load).

``correctness`` (both phases): from the grants and outcomes topics, every request the router
answered has one grant, every admitted one one ``first_token`` and one ``completion``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer

from foretoken.bench.router_stack import (
    FLEET,
    Stack,
    cpu_seconds,
    machine_busy_seconds,
    start_stack,
)
from foretoken.core.types import RequestId
from foretoken.settings import Settings
from foretoken.sim.live.load import RequestResult, run_load_async
from foretoken.sim.traces import LengthDistribution, TraceRequest, synthetic_requests
from foretoken.wire.codec import decode
from foretoken.wire.records import Grant, Outcome

TARGET_P99_ADDED_S = 0.002
TARGET_RATE_RPS = 200.0
PROMPT = LengthDistribution(median=300, sigma=0.25, min_tokens=128, max_tokens=600)
OUTPUT = LengthDistribution(median=3, sigma=0.3, min_tokens=2, max_tokens=4)
UNLOADED_RATE_RPS = 10.0
REGULAR = 1e6  # gamma burstiness: evenly spaced arrivals
CONCURRENCY = 2000  # never the limit: requests go out when due
REQUEST_TIMEOUT_S = 30.0
CONSUME_TIMEOUT_S = 60.0
CONSUME_SETTLE_S = 3.0
BOOTSTRAP_ROUNDS = 1000
ADDED_METRIC = "foretoken_router_added_seconds"
COUNTERS = tuple(f"foretoken_router_{c}" for c in ("requests", "fallbacks", "publish", "published"))
PROFILE_S = 10
PROFILE_RATE_HZ = 100
PROFILED = ("router", "worker")
PATHS = ("router", "direct")


@dataclass(frozen=True, slots=True)
class Mode:
    rate_rps: float
    window_s: float
    windows_per_path: int
    warmup_s: float
    unloaded_window_s: float


FULL = Mode(TARGET_RATE_RPS, window_s=5.0, windows_per_path=6, warmup_s=2.0, unloaded_window_s=5.0)
QUICK = Mode(50.0, window_s=1.25, windows_per_path=2, warmup_s=1.0, unloaded_window_s=1.5)


# ---------------------------------------------------------------------------- load


def window_requests(
    rate_rps: float, tag: str, seed: int, duration_s: float, burstiness: float = 1.0
) -> list[TraceRequest]:
    n = int(rate_rps * duration_s * 1.5) + 20
    reqs = synthetic_requests(n, rate_rps=rate_rps, prompt=PROMPT, output=OUTPUT,
                              burstiness=burstiness, seed=seed)  # fmt: skip
    return [
        dataclasses.replace(r, request_id=RequestId(f"{tag}-{i:06d}"))
        for i, r in enumerate(reqs)
        if r.arrival_s < duration_s
    ]


@dataclass
class PathRun:
    """Every measured window of one path: results, engine of each direct request, CPU."""

    results: list[RequestResult] = field(default_factory=list)
    direct_engine: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0  # windows from first dispatch to last answer
    dispatch_s: float = 0.0  # windows from first to last dispatch
    cpu_s: dict[str, float] = field(default_factory=dict)


async def run_window(
    stack: Stack, path: str, reqs: Sequence[TraceRequest], into: PathRun | None,
    concurrency: int = CONCURRENCY,
) -> None:  # fmt: skip
    """One window against one path; ``into`` None = warm-up (not recorded)."""
    model = stack.engines[0].model
    opts: dict[str, Any] = {"concurrency": concurrency, "timeout_s": REQUEST_TIMEOUT_S,
                            "progress": False}  # fmt: skip
    pids = stack.pids()
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    busy0, started = machine_busy_seconds(), time.monotonic()
    if path == "router":
        summaries = [await run_load_async(stack.router_url, model, reqs, **opts)]
    else:  # round-robin: request i goes to engine i mod n
        n = len(stack.engines)
        summaries = await asyncio.gather(*(
            run_load_async(e.http_url, model, reqs[k::n], **opts)
            for k, e in enumerate(stack.engines)
        ))  # fmt: skip
    if into is None:
        return
    into.wall_s += time.monotonic() - started
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    cpu["machine"] = machine_busy_seconds() - busy0
    for name, seconds in cpu.items():
        into.cpu_s[name] = into.cpu_s.get(name, 0.0) + seconds
    into.dispatch_s += max(r.sent_s or 0.0 for s in summaries for r in s.results)
    for k, summary in enumerate(summaries):
        into.results.extend(summary.results)
        if path == "direct":
            into.direct_engine.update(
                (r.request_id, stack.engines[k].worker_id) for r in summary.results
            )


def metric_values(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, ``name{labels}`` → value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def histogram_buckets(samples: dict[str, float], name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram, by upper bound."""
    head = f'{name}_bucket{{le="'
    return {
        math.inf if k[len(head) : -2] == "+Inf" else float(k[len(head) : -2]): v
        for k, v in samples.items()
        if k.startswith(head)
    }


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank q·count."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in sorted(buckets):
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: that bound, as Prometheus does
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


@dataclass
class Phase:
    """Alternating windows of both paths, and the router's metrics over them."""

    runs: dict[str, PathRun]
    order: list[str]
    added_buckets: dict[float, float]
    counters: dict[str, float]


def run_phase(
    stack: Stack, tag: str, rate_rps: float, window_s: float, windows_per_path: int,
    concurrency: int = CONCURRENCY, burstiness: float = 1.0,
) -> Phase:  # fmt: skip
    runs = {p: PathRun() for p in PATHS}
    order = [PATHS[(i + 1) // 2 % 2] for i in range(2 * windows_per_path)]  # R D D R R D…
    before = metric_values(stack.router_url)
    for w, path in enumerate(order):
        reqs = window_requests(rate_rps, f"{stack.settings.topic_prefix}{tag}-{path}-{w}",
                               100 + w, window_s, burstiness)  # fmt: skip
        asyncio.run(run_window(stack, path, reqs, runs[path], concurrency))
    after = metric_values(stack.router_url)
    counters = {k: v - before.get(k, 0.0) for k, v in after.items()
                if k.startswith(COUNTERS) and "_created" not in k}  # fmt: skip
    first = histogram_buckets(before, ADDED_METRIC)
    delta = {k: v - first.get(k, 0.0) for k, v in histogram_buckets(after, ADDED_METRIC).items()}
    return Phase(runs, order, delta, counters)


# ---------------------------------------------------------------------------- statistics


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def diff_with_ci(a: Sequence[float], b: Sequence[float], q: float) -> dict[str, Any]:
    """pct(a, q) − pct(b, q) with a bootstrap 95% interval (resampling each side)."""
    if not a or not b:
        return {"ms": None, "ci95_ms": None}
    x, y = np.asarray(a), np.asarray(b)
    rng = np.random.default_rng(0)
    xs = np.percentile(rng.choice(x, (BOOTSTRAP_ROUNDS, x.size)), q, axis=1)
    ys = np.percentile(rng.choice(y, (BOOTSTRAP_ROUNDS, y.size)), q, axis=1)
    lo, hi = np.percentile(xs - ys, [2.5, 97.5])
    point = float(np.percentile(x, q) - np.percentile(y, q))
    return {"ms": _ms(point), "ci95_ms": [_ms(float(lo)), _ms(float(hi))]}


def path_report(run: PathRun, rate_rps: float) -> dict[str, Any]:
    res = run.results
    ok = [r for r in res if r.ok and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    lag = [r.sent_s - r.scheduled_s for r in res if r.sent_s is not None]
    sent, rejected = sum(r.sent_s is not None for r in res), sum(r.rejected for r in res)
    errors = Counter((r.error or "")[:80] for r in res if not r.ok and not r.rejected)
    wall = run.wall_s or math.nan
    return {
        "offered_rps": rate_rps, "requests": len(res), "sent": sent, "ok": len(ok),
        "rejected_429": rejected, "failed": len(res) - len(ok) - rejected,
        "errors": dict(errors.most_common(5)), "wall_s": round(run.wall_s, 3),
        "dispatched_rps": round(sent / (run.dispatch_s or math.nan), 1),
        "completed_rps": round(len(ok) / wall, 1),
        "ttft_ms": {f"p{q:g}": _ms(pct(ttft, q)) for q in (50, 90, 99, 99.9)},
        "e2e_ms": {f"p{q:g}": _ms(pct([r.e2e_s or 0.0 for r in ok], q)) for q in (50, 99)},
        "dispatch_lag_ms": {"p50": _ms(pct(lag, 50)), "p99": _ms(pct(lag, 99)),
                            "max": _ms(max(lag) if lag else None)},
        # Mean cores busy per process; ``others``: the machine's busy time not in ours.
        "cpu_cores": {k: round(v / wall, 2) for k, v in sorted(run.cpu_s.items())}
        | {"others": round(max(0.0, 2 * run.cpu_s.get("machine", 0.0)
                                - sum(run.cpu_s.values())) / wall, 2)},
        # CPU per request sent; 1000 / this = the requests/s one core could sustain.
        "cpu_ms_per_request": {k: round(1000.0 * v / max(sent, 1), 2)
                               for k, v in sorted(run.cpu_s.items()) if k != "machine"},
    }  # fmt: skip


def added_latency(
    router: PathRun, direct: PathRun, worker_of: dict[str, str | None]
) -> dict[str, Any]:
    """Over all requests, and per engine (router requests the route service sent to engine
    e against direct requests to e): the route service does not spread load round-robin,
    and the engines differ."""
    r_ttft = {r.request_id: r.ttft_s for r in router.results if r.ok and r.ttft_s is not None}
    d_ttft = {r.request_id: r.ttft_s for r in direct.results if r.ok and r.ttft_s is not None}
    rv, dv = list(r_ttft.values()), list(d_ttft.values())
    out: dict[str, Any] = {
        "method": "percentile of router-path TTFT minus the same percentile of direct TTFT",
        "p50": diff_with_ci(rv, dv, 50), "p99": diff_with_ci(rv, dv, 99), "per_engine": {},
    }  # fmt: skip
    engines = sorted(set(direct.direct_engine.values()))
    r_by: dict[str, list[float]] = {e: [] for e in engines}
    d_by: dict[str, list[float]] = {e: [] for e in engines}
    for rid, t in r_ttft.items():
        worker = worker_of.get(rid)
        if worker in r_by:
            r_by[worker].append(t)
    for rid, t in d_ttft.items():
        d_by[direct.direct_engine[rid]].append(t)
    for e in engines:
        out["per_engine"][e] = {
            "router_n": len(r_by[e]), "direct_n": len(d_by[e]),
            "router_p50_ms": _ms(pct(r_by[e], 50)), "direct_p50_ms": _ms(pct(d_by[e], 50)),
            "p50": diff_with_ci(r_by[e], d_by[e], 50), "p99": diff_with_ci(r_by[e], d_by[e], 99),
        }  # fmt: skip
    return out


def histogram_report(delta: dict[float, float]) -> dict[str, Any]:
    total = delta.get(math.inf, 0.0)
    last = max((k for k in delta if not math.isinf(k)), default=0.0)
    beyond = total - delta.get(last, 0.0)  # past the last finite bound: quantiles capped
    return {
        "count": total,
        "p50_ms": _ms(histogram_quantile(0.5, delta)),
        "p99_ms": _ms(histogram_quantile(0.99, delta)),
        "over_last_bound": beyond,
        "p50_is_lower_bound": beyond > 0.5 * total,
        "p99_is_lower_bound": beyond > 0.01 * total,
        "fraction_le_1ms": round(delta.get(0.001, 0.0) / total, 4) if total else None,
        "fraction_le_2ms": round(delta.get(0.002, 0.0) / total, 4) if total else None,
        "buckets": {("+Inf" if math.isinf(k) else str(k)): v for k, v in delta.items()},
    }


# ---------------------------------------------------------------------------- Kafka check


@dataclass
class KafkaView:
    """Per request id: grants, admitted grants, first_token and completion outcomes; the
    worker of the (last) grant and the router's own TTFT (its first_token outcome)."""

    grants: Counter[str] = field(default_factory=Counter)
    admitted: Counter[str] = field(default_factory=Counter)
    first: Counter[str] = field(default_factory=Counter)
    done: Counter[str] = field(default_factory=Counter)
    worker: dict[str, str | None] = field(default_factory=dict)
    router_ttft_s: dict[str, float] = field(default_factory=dict)

    def add(self, is_grant: bool, value: bytes | None) -> None:
        if is_grant:
            g = decode(value, Grant)
            self.grants[g.request_id] += 1
            self.admitted[g.request_id] += int(g.admitted)
            self.worker[g.request_id] = g.worker_id
            return
        o = decode(value, Outcome)
        (self.first if o.kind == "first_token" else self.done)[o.request_id] += 1
        if o.kind == "first_token" and o.actual_ttft_s is not None:
            self.router_ttft_s[o.request_id] = o.actual_ttft_s


async def consume_records(settings: Settings, expect: set[str]) -> KafkaView:
    """Read this run's grants and outcomes until every expected request has its grant and
    every admitted one its completion, then a little longer (duplicates), or a timeout."""
    consumer = AIOKafkaConsumer(
        settings.topic("grants"), settings.topic("outcomes"),
        bootstrap_servers=settings.kafka.bootstrap_servers, auto_offset_reset="earliest",
        group_id=f"router-bench-{uuid.uuid4().hex[:6]}", enable_auto_commit=False,
    )  # fmt: skip
    view, grants_topic = KafkaView(), settings.topic("grants")
    await consumer.start()
    try:
        deadline, settle_until = time.monotonic() + CONSUME_TIMEOUT_S, math.inf
        while time.monotonic() < min(deadline, settle_until):
            for tp, msgs in (await consumer.getmany(timeout_ms=500, max_records=5000)).items():
                for m in msgs:
                    view.add(tp.topic == grants_topic, m.value)
            complete = expect <= set(view.grants) and all(
                view.done[r] for r in expect if view.admitted[r]
            )
            if complete and math.isinf(settle_until):  # keep reading a little for duplicates
                settle_until = time.monotonic() + CONSUME_SETTLE_S
    finally:
        await consumer.stop()
    return view


def correctness(routed: Sequence[RequestResult], view: KafkaView) -> dict[str, Any]:
    unanswered = {r.request_id for r in routed if r.status is None}
    answered = {r.request_id for r in routed if r.status is not None}
    ok_ids = {r.request_id for r in routed if r.ok}
    adm = {r for r in answered if view.admitted[r]}
    return {
        "answered": len(answered),
        "grants_missing": sum(view.grants[r] == 0 for r in answered),
        "grants_duplicated": sum(view.grants[r] > 1 for r in answered),
        "grants_for_unanswered": sum(view.grants[r] > 0 for r in unanswered),
        "admitted": len(adm),
        "first_token_missing": sum(view.first[r] == 0 for r in adm & ok_ids),
        "first_token_duplicated": sum(view.first[r] > 1 for r in adm),
        "completion_missing": sum(view.done[r] == 0 for r in adm),
        "completion_duplicated": sum(view.done[r] > 1 for r in adm),
        "outcomes_for_rejected": sum(1 for r in answered - adm if view.first[r] or view.done[r]),
    }


def hop_overhead(router: PathRun, view: KafkaView) -> dict[str, Any]:
    """Per request: client-seen TTFT minus the router's own TTFT (handler entry → first
    content token from the engine): the part of the extra HTTP hop outside the router's
    clock (connection, parsing the request head, relaying the chunk, event-loop queueing)."""
    gaps = [
        r.ttft_s - view.router_ttft_s[r.request_id]
        for r in router.results
        if r.ok and r.ttft_s is not None and r.request_id in view.router_ttft_s
    ]
    return {"n": len(gaps), "p50_ms": _ms(pct(gaps, 50)), "p99_ms": _ms(pct(gaps, 99))}


# ---------------------------------------------------------------------------- profile


def profile(stack: Stack, rate_rps: float, out_dir: Path) -> dict[str, Any]:
    """py-spy (non-blocking sampling) of the router and the route service during one extra
    router window that is not measured: a flame graph and folded stacks of each (the
    folded files give the shares of samples per function)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [spy, "record", "-d", str(PROFILE_S), "-r", str(PROFILE_RATE_HZ), "--nonblocking",
             "-p", str(stack.procs[name].pid), "-f", fmt, "-o", str(out_dir / f"{name}.{ext}")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for name in PROFILED
        for fmt, ext in (("flamegraph", "svg"), ("raw", "folded"))
    ]  # fmt: skip
    try:
        time.sleep(0.5)
        reqs = window_requests(rate_rps, f"{stack.settings.topic_prefix}prof", 9, PROFILE_S + 1)
        asyncio.run(run_window(stack, "router", reqs, None))
        for p in spies:
            p.wait(timeout=60)
    finally:
        for p in spies:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: [str(out_dir / f"{name}.{ext}") for ext in ("svg", "folded")]
            for name in PROFILED}  # fmt: skip


# ---------------------------------------------------------------------------- driver


def phase_report(phase: Phase, view: KafkaView, rate_rps: float) -> dict[str, Any]:
    router, direct = phase.runs["router"], phase.runs["direct"]
    return {
        "rate_rps": rate_rps,
        "window_order": phase.order,
        "paths": {p: path_report(phase.runs[p], rate_rps) for p in PATHS},
        "added_latency": added_latency(router, direct, view.worker),
        "router_added_histogram": histogram_report(phase.added_buckets),
        "hop_overhead": hop_overhead(router, view),
        "router_counters": phase.counters,
    }


def measure(stack: Stack, mode: Mode) -> dict[str, Any]:
    for path in PATHS:  # warm-up: connections, imports, the predictor's first fits
        tag = f"{stack.settings.topic_prefix}warm-{path}"
        asyncio.run(run_window(stack, path, window_requests(mode.rate_rps, tag, 1,
                                                            mode.warmup_s), None))  # fmt: skip
    unloaded = run_phase(stack, "unloaded", UNLOADED_RATE_RPS, mode.unloaded_window_s, 2,
                         concurrency=1, burstiness=REGULAR)  # fmt: skip
    loaded = run_phase(stack, "loaded", mode.rate_rps, mode.window_s, mode.windows_per_path)
    routed = [*unloaded.runs["router"].results, *loaded.runs["router"].results]
    view = asyncio.run(consume_records(stack.settings, {r.request_id for r in routed if r.status}))
    return {
        "unloaded": phase_report(unloaded, view, UNLOADED_RATE_RPS),
        "loaded": phase_report(loaded, view, mode.rate_rps),
        "correctness": correctness(routed, view),
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that ``finally`` stops the stack


def run(
    quick: bool, time_scale: float = 1.0, route_timeout_s: float = 0.25,
    profile_dir: Path | None = None, rate_rps: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    mode = QUICK if quick else FULL
    if rate_rps is not None:
        mode = dataclasses.replace(mode, rate_rps=rate_rps)
    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    stack: Stack | None = None
    try:
        stack = start_stack(tmp, time_scale, route_timeout_s)
        result = measure(stack, mode)
        if profile_dir is not None:
            result["profile"] = profile(stack, mode.rate_rps, profile_dir)
    except BaseException:
        if stack is not None:
            print(stack.log_tails(), file=sys.stderr)
        raise
    finally:
        if stack is not None:
            stack.close()
        signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(tmp, ignore_errors=True)  # kept (with the logs) when the run failed
    p99 = result["loaded"]["added_latency"]["p99"]["ms"]
    target_ms = TARGET_P99_ADDED_S * 1000
    return {
        "mode": "quick" if quick else "full", "fleet": FLEET, "engines": len(stack.engines),
        "time_scale": time_scale, "route_timeout_s": route_timeout_s,
        "rate_rps": mode.rate_rps, "window_s": mode.window_s,
        "windows_per_path": mode.windows_per_path,
        "prompt_tokens": dataclasses.asdict(PROMPT), "max_tokens": dataclasses.asdict(OUTPUT),
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "target": {"p99_added_ms": target_ms, "rate_rps": TARGET_RATE_RPS,
                   "met": p99 is not None and p99 <= target_ms
                   and mode.rate_rps >= TARGET_RATE_RPS,
                   "gap_ms": None if p99 is None else round(p99 - target_ms, 3)},
        **result,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--rate", type=float, default=None, help="loaded-phase requests/s")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="wall seconds per simulated engine second")  # fmt: skip
    parser.add_argument("--route-timeout-s", type=float, default=0.25)
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="py-spy the router and worker in one extra window")  # fmt: skip
    args = parser.parse_args()
    out = run(args.quick, args.time_scale, args.route_timeout_s, args.profile_dir, args.rate)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
