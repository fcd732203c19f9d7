"""The router benchmark's statistics: per-path reports, added latency with bootstrap
intervals, the router's Prometheus histogram, and the Kafka check (every answered request has
one grant, every admitted one one first token and one completion)."""

from __future__ import annotations

import contextlib
import math
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer

from foretoken.settings import Settings
from foretoken.sim.live.load import RequestResult
from foretoken.wire.codec import decode
from foretoken.wire.records import Grant, Outcome

BOOTSTRAP_ROUNDS = 1000
CONSUME_TIMEOUT_S = 60.0
CONSUME_SETTLE_S = 3.0


@dataclass
class PathRun:
    """Every measured window of one path: results, engine of each direct request, CPU."""

    results: list[RequestResult] = field(default_factory=list)
    direct_engine: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0  # windows from first dispatch to last answer
    dispatch_s: float = 0.0  # windows from first to last dispatch
    cpu_s: dict[str, float] = field(default_factory=dict)


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
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # as the router counted them

    def add(self, is_grant: bool, value: bytes | None) -> None:
        if is_grant:
            g = decode(value, Grant)
            self.grants[g.request_id] += 1
            self.admitted[g.request_id] += int(g.admitted)
            self.worker[g.request_id] = g.worker_id
            self.prompt_tokens[g.request_id] = g.prompt_tokens
            return
        o = decode(value, Outcome)
        (self.first if o.kind == "first_token" else self.done)[o.request_id] += 1
        if o.kind == "first_token" and o.actual_ttft_s is not None:
            self.router_ttft_s[o.request_id] = o.actual_ttft_s


async def consume_records(settings: Settings, expect: set[str]) -> KafkaView:
    """Read this run's grants and outcomes until every expected request has its grant and
    every admitted one its completion, then a little longer (duplicates), or a timeout."""

    def complete(view: KafkaView) -> bool:
        return expect <= set(view.grants) and all(view.done[r] for r in expect if view.admitted[r])

    return await read_records(settings, "router-bench", complete, settle_s=CONSUME_SETTLE_S)


async def read_records(
    settings: Settings, group: str, complete: Callable[[KafkaView], bool], *, settle_s: float
) -> KafkaView:
    """This run's grants and outcomes (from the start of the topics, a consumer group of its
    own named after ``group``) until ``complete(view)`` and ``settle_s`` more, or a timeout."""
    consumer = AIOKafkaConsumer(
        settings.topic("grants"), settings.topic("outcomes"),
        bootstrap_servers=settings.kafka.bootstrap_servers, auto_offset_reset="earliest",
        group_id=f"{group}-{uuid.uuid4().hex[:6]}", enable_auto_commit=False,
    )  # fmt: skip
    view, grants_topic = KafkaView(), settings.topic("grants")
    await consumer.start()
    try:
        deadline, settle_until = time.monotonic() + CONSUME_TIMEOUT_S, math.inf
        while time.monotonic() < min(deadline, settle_until):
            for tp, msgs in (await consumer.getmany(timeout_ms=500, max_records=5000)).items():
                for m in msgs:
                    view.add(tp.topic == grants_topic, m.value)
            if math.isinf(settle_until) and complete(view):  # keep reading for duplicates
                settle_until = time.monotonic() + settle_s
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
