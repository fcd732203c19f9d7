"""The router's overhead under load: ``foretoken bench router [--quick]``.

Prints one JSON object. It starts, as real processes on a topic prefix of its own, the
processor (route service and agents), a near-zero-cost engine stub (``engine_stub.py``: four
fake engines answering an OpenAI stream of 4 tokens, the first after 20 ms, then every 5 ms,
at a small fraction of a core), ingest (which registers them) and the router (uvloop;
``--router-processes N`` on one port), on the broker that answers, else on the project's own.
``foretoken/sim/live/load.py`` drives streaming ``/v1/completions`` (gamma arrivals, token-id
prompts of ~300 tokens) in alternating windows against the router and straight to the stub
(round-robin), in ABBA order (R D D R R D …) so that drift falls on both paths alike:

* ``unloaded``: one request at a time (10/s, evenly spaced): the router's cost without queueing;
* ``by_rate``: 50, 200 and 500 requests/s (quick: 50 and 200), windows of 5 s (quick 2 s);
* ``reject_429``: 32k-token *text* prompts whose bound cannot be met, 20/s: how fast the 429
  comes back, tokenization included (client-side, from send to the full answer).

Per rate: ``added_ttft`` — a percentile of router-path TTFT minus the same percentile direct
(a request takes one path, so there are no per-request differences), bootstrap 95% intervals;
CPU per request of the router process(es) and of the whole path (router + processor +
ingest), from ``/proc`` over the router windows; the router's own time before the engine call
(its histogram); the Kafka check (every answered request has one grant, every admitted one
one first token and one completion: ``lost``, ``duplicated``). The flat ``summary`` holds the
200/s figures and the targets of issue 18.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from foretoken.bench.router_stack import Stack, cpu_seconds, machine_busy_seconds, start_stack
from foretoken.bench.router_stats import (
    KafkaView,
    PathRun,
    _ms,
    added_latency,
    consume_records,
    correctness,
    histogram_buckets,
    histogram_report,
    hop_overhead,
    metric_values,
    path_report,
    pct,
)
from foretoken.core.types import RequestId
from foretoken.sim.live.load import run_load_async
from foretoken.sim.traces import LengthDistribution, TraceRequest, synthetic_requests

TARGETS = {"router_cpu_ms_per_request": 0.5, "whole_path_cpu_ms_per_request": 3.0,
           "added_ttft_p50_ms": 1.0, "added_ttft_p99_ms": 3.0, "added_ttft_p99_ms_at_500": 10.0,
           "reject_429_p99_ms": 10.0}  # fmt: skip
SUMMARY_RATE = 200.0
PROMPT = LengthDistribution(median=300, sigma=0.25, min_tokens=128, max_tokens=600)
OUTPUT = LengthDistribution(median=4, sigma=0.0, min_tokens=4, max_tokens=4)
UNLOADED_RATE_RPS = 10.0
REGULAR = 1e6  # gamma burstiness: evenly spaced arrivals
CONCURRENCY = 4000  # never the limit: requests go out when due
REQUEST_TIMEOUT_S = 30.0
ADDED_METRIC = "foretoken_router_added_seconds"
COUNTERS = tuple(f"foretoken_router_{c}" for c in ("requests", "fallbacks", "publish", "published"))
PROFILE_S = 10
PROFILE_RATE_HZ = 100
PROFILED = ("router", "worker")
PATHS = ("router", "direct")
REJECT_PROMPT_TOKENS = 32_768
REJECT_RATE_RPS = 20.0


@dataclass(frozen=True, slots=True)
class Mode:
    rates_rps: tuple[float, ...]
    window_s: float
    windows_per_path: int
    warmup_s: float
    unloaded_window_s: float
    reject_s: float


FULL = Mode((50.0, 200.0, 500.0), window_s=5.0, windows_per_path=3, warmup_s=2.0,
            unloaded_window_s=4.0, reject_s=5.0)  # fmt: skip
QUICK = Mode((50.0, 200.0), window_s=2.0, windows_per_path=2, warmup_s=1.0,
             unloaded_window_s=1.5, reject_s=2.0)  # fmt: skip


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
        uvloop.run(run_window(stack, path, reqs, runs[path], concurrency))
    after = metric_values(stack.router_url)  # one process's, when there are several
    counters = {k: v - before.get(k, 0.0) for k, v in after.items()
                if k.startswith(COUNTERS) and "_created" not in k}  # fmt: skip
    first = histogram_buckets(before, ADDED_METRIC)
    delta = {k: v - first.get(k, 0.0) for k, v in histogram_buckets(after, ADDED_METRIC).items()}
    return Phase(runs, order, delta, counters)


# ---------------------------------------------------------------------------- 429s


def reject_text(tokens: int) -> str:
    """A text of exactly ``tokens`` built-in tokens (one word a token)."""
    return " ".join(f"w{i % 977}" for i in range(tokens))


async def _rejects(url: str, model: str, rate_rps: float, duration_s: float,
                   tag: str) -> dict[str, Any]:  # fmt: skip
    """Open-loop text prompts with an unmeetable bound (4.999 s of 5 s already waited)."""
    body = json.dumps({"model": model, "prompt": reject_text(REJECT_PROMPT_TOKENS),
                       "max_tokens": 4}).encode()  # fmt: skip
    latencies: list[float] = []
    statuses: dict[int, int] = {}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        headers = {"Content-Type": "application/json", "x-max-queue-wait-s": "5",
                   "x-already-waited-s": "4.999", "x-request-id": f"{tag}-{i:05d}"}  # fmt: skip
        started = time.monotonic()
        async with session.post(f"{url}/v1/completions", data=body, headers=headers) as resp:
            await resp.read()
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status == 429:
                latencies.append(time.monotonic() - started)

    n = int(rate_rps * duration_s)
    async with aiohttp.ClientSession() as session:
        t0, tasks = time.monotonic(), []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate_rps - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, i)))
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"prompt_tokens": REJECT_PROMPT_TOKENS, "prompt": "text", "rate_rps": rate_rps,
            "requests": n, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "p50_ms": _ms(pct(latencies, 50)), "p99_ms": _ms(pct(latencies, 99)),
            "max_ms": _ms(max(latencies) if latencies else None)}  # fmt: skip


# ---------------------------------------------------------------------------- profile


def profile(stack: Stack, rate_rps: float, out_dir: Path) -> dict[str, Any]:
    """py-spy (non-blocking sampling) of the router and the route service during one extra
    router window that is not measured: a flame graph and folded stacks of each (the
    folded files give the shares of samples per function)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    pids = stack.pids()
    spies = [
        subprocess.Popen(
            [spy, "record", "-d", str(PROFILE_S), "-r", str(PROFILE_RATE_HZ), "--nonblocking",
             "-p", str(pids[name]), "-f", fmt, "-o", str(out_dir / f"{name}.{ext}")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for name in PROFILED
        for fmt, ext in (("flamegraph", "svg"), ("raw", "folded"))
    ]  # fmt: skip
    try:
        time.sleep(0.5)
        reqs = window_requests(rate_rps, f"{stack.settings.topic_prefix}prof", 9, PROFILE_S + 1)
        uvloop.run(run_window(stack, "router", reqs, None))
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


def rate_report(phase: Phase, view: KafkaView, rate_rps: float) -> dict[str, Any]:
    router, direct = phase.runs["router"], phase.runs["direct"]
    sent = sum(r.sent_s is not None for r in router.results)
    router_cpu = sum(v for k, v in router.cpu_s.items() if k.startswith("router"))
    whole = router_cpu + router.cpu_s.get("worker", 0.0) + router.cpu_s.get("ingest", 0.0)
    added = added_latency(router, direct, view.worker)
    return {
        "rate_rps": rate_rps, "window_order": phase.order,
        "router_cpu_ms_per_request": round(1000 * router_cpu / max(sent, 1), 3),
        "whole_path_cpu_ms_per_request": round(1000 * whole / max(sent, 1), 3),
        "added_ttft_p50_ms": added["p50"]["ms"], "added_ttft_p50_ci95_ms": added["p50"]["ci95_ms"],
        "added_ttft_p99_ms": added["p99"]["ms"], "added_ttft_p99_ci95_ms": added["p99"]["ci95_ms"],
        "paths": {p: path_report(phase.runs[p], rate_rps) for p in PATHS},
        "added_latency": added,
        "router_added_histogram": histogram_report(phase.added_buckets),
        "hop_overhead": hop_overhead(router, view),
        "router_counters": phase.counters,
    }  # fmt: skip


def measure(stack: Stack, mode: Mode) -> dict[str, Any]:
    for path in PATHS:  # warm-up: connections, imports, the predictor's first decisions
        tag = f"{stack.settings.topic_prefix}warm-{path}"
        reqs = window_requests(mode.rates_rps[0], tag, 1, mode.warmup_s)
        uvloop.run(run_window(stack, path, reqs, None))
    unloaded = run_phase(stack, "unloaded", UNLOADED_RATE_RPS, mode.unloaded_window_s, 2,
                         concurrency=1, burstiness=REGULAR)  # fmt: skip
    phases = {rate: run_phase(stack, f"r{rate:g}", rate, mode.window_s, mode.windows_per_path)
              for rate in mode.rates_rps}  # fmt: skip
    rejects = uvloop.run(_rejects(stack.router_url, stack.engines[0].model, REJECT_RATE_RPS,
                                  mode.reject_s, f"{stack.settings.topic_prefix}rej"))  # fmt: skip
    routed = [r for ph in (unloaded, *phases.values()) for r in ph.runs["router"].results]
    view = asyncio.run(consume_records(stack.settings, {r.request_id for r in routed if r.status}))
    check = correctness(routed, view)
    return {
        "unloaded": rate_report(unloaded, view, UNLOADED_RATE_RPS),
        "by_rate": {f"{rate:g}": rate_report(ph, view, rate) for rate, ph in phases.items()},
        "reject_429": rejects,
        "correctness": check,
        "lost": check["grants_missing"] + check["first_token_missing"]
        + check["completion_missing"],
        "duplicated": check["grants_duplicated"] + check["first_token_duplicated"]
        + check["completion_duplicated"],
    }  # fmt: skip


def summary(result: dict[str, Any], load: list[float]) -> dict[str, Any]:
    at = result["by_rate"].get(f"{SUMMARY_RATE:g}", {})
    top = result["by_rate"].get("500", {})
    flat = {
        "rate_rps": SUMMARY_RATE,
        "router_cpu_ms_per_request": at.get("router_cpu_ms_per_request"),
        "whole_path_cpu_ms_per_request": at.get("whole_path_cpu_ms_per_request"),
        "added_ttft_p50_ms": at.get("added_ttft_p50_ms"),
        "added_ttft_p99_ms": at.get("added_ttft_p99_ms"),
        "added_ttft_p99_ms_at_500": top.get("added_ttft_p99_ms"),
        "reject_429_p99_ms": result["reject_429"]["p99_ms"],
        "lost": result["lost"], "duplicated": result["duplicated"],
        "loadavg_start_1m": load[0],
    }  # fmt: skip
    met = {k: flat[k] is not None and flat[k] <= v for k, v in TARGETS.items()}
    met["lost"] = flat["lost"] == 0
    met["duplicated"] = flat["duplicated"] == 0
    return flat | {"targets": TARGETS, "met": met}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that ``finally`` stops the stack


def run(
    quick: bool, route_timeout_s: float = 0.25, profile_dir: Path | None = None,
    rates: Sequence[float] | None = None, router_processes: int = 1,
) -> dict[str, Any]:  # fmt: skip
    mode = QUICK if quick else FULL
    if rates:
        mode = dataclasses.replace(mode, rates_rps=tuple(rates))
    load_start = [round(x, 2) for x in os.getloadavg()]
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    stack: Stack | None = None
    try:
        stack = start_stack(tmp, route_timeout_s, router_processes)
        result = measure(stack, mode)
        if profile_dir is not None:
            result["profile"] = profile(stack, SUMMARY_RATE, profile_dir)
    except BaseException:
        if stack is not None:
            print(stack.log_tails(), file=sys.stderr)
        raise
    finally:
        if stack is not None:
            stack.close()
        signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(tmp, ignore_errors=True)  # kept (with the logs) when the run failed
    return {
        "summary": summary(result, load_start),
        "mode": "quick" if quick else "full", "engine": "stub (engine_stub.py)",
        "engines": len(stack.engines), "router_processes": router_processes,
        "route_timeout_s": route_timeout_s, "rates_rps": list(mode.rates_rps),
        "window_s": mode.window_s, "windows_per_path": mode.windows_per_path,
        "prompt_tokens": dataclasses.asdict(PROMPT), "max_tokens": dataclasses.asdict(OUTPUT),
        "cpus": os.cpu_count(), "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        **result,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, 50 and 200/s")
    parser.add_argument("--rates", default="", help="comma-separated requests/s (50,200,500)")
    parser.add_argument("--router-processes", type=int, default=1)
    parser.add_argument("--route-timeout-s", type=float, default=0.25)
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="py-spy router and processor in an extra 200/s window")  # fmt: skip
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    out = run(args.quick, args.route_timeout_s, args.profile_dir, rates, args.router_processes)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
