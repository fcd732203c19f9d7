"""`foretoken bench live-vs-replay`: one trace slice through the live stack and through
virtual time, graded side by side (issue 15, point 5).

The live side is the demo's stack (:mod:`foretoken.ops.demo`: the local broker, the Faust
worker, the simulated ``demo`` fleet in real time, ingest, the router) on fresh topics; the
slice of the Mooncake trace goes through the router (outputs capped at
``MAX_OUTPUT_TOKENS``, a mix of bounds) and the graded requests are read back from the
worker's lake. The replay side runs the same requests (same arrivals, same bounds, same
capped outputs) on the same fleet file through :func:`foretoken.sim.replay.replay` with the
predictor policy — the same predictor code, in virtual time, where outcomes reach it at the
instant they happen.

Both sides are graded the same way (PRODUCT.md §4) on the requests served on both, and
split where the live pipeline can differ: requests predicted on a default curve or a fitted
one, with or without a predicted queue wait. ``summary.gap_within_1s_points`` is the
replay's within-1 s less the live one's (issue 15's target: at most 2 points).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.lake.views import connect, rows
from foretoken.adapters.ports import free_port, in_use
from foretoken.adapters.processes import get_json, stop
from foretoken.ops import demo, kafka_local
from foretoken.settings import Settings, load_settings
from foretoken.sim.clients import BoundMix
from foretoken.sim.live.load import run_load
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import replay
from foretoken.sim.spec import load_fleet
from foretoken.sim.traces import TraceRequest, load_mooncake

SPEEDUP = 0.5  # the trace at half its pace (the demo's warm-up pace: the fleet keeps up)
FULL_TRACE_S, QUICK_TRACE_S = 120.0, 40.0  # of trace time
MAX_OUTPUT_TOKENS = 16
BOUNDS = "10:0.3,30:0.4,none:0.3"
LAKE_WAIT_S, LAKE_IDLE_S = 120.0, 20.0


def workload(trace_s: float) -> list[TraceRequest]:
    """The slice both sides run: arrivals in wall seconds, outputs capped, bounds drawn."""
    requests = [
        dataclasses.replace(r, output_tokens=min(r.output_tokens, MAX_OUTPUT_TOKENS))
        for r in load_mooncake(speedup=SPEEDUP) if r.arrival_s * SPEEDUP < trace_s
    ]  # fmt: skip
    return BoundMix.parse(BOUNDS).assign(requests, seed=0)


# ---------------------------------------------------------------------------- the two sides


def run_live(
    settings: Settings, requests: Sequence[TraceRequest], run_dir: Path
) -> tuple[list[Any], dict[str, Any]]:
    """The live stack on fresh topics; the graded rows of the lake (one per request id),
    and how late outcomes reached the worker's queue models (``outcome_delay_s``)."""
    prefix = f"lvr{uuid.uuid4().hex[:4]}-"
    shutil.rmtree(run_dir, ignore_errors=True)
    plan = demo.DemoPlan(run_dir)
    env = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_APP_ID": f"foretoken-{prefix}",
           "FORETOKEN_WORKER_DATA_DIR": str(run_dir / "worker"),
           "FORETOKEN_LAKE_DIR": str(plan.lake_dir)}  # fmt: skip
    base = load_settings(env={**demo._os_env(), **env})
    if in_use(base.worker.web_host, base.worker.web_port):
        env["FORETOKEN_WEB_PORT"] = str(free_port(base.worker.web_host))
    live_settings = load_settings(env={**demo._os_env(), **env})
    asyncio.run(ensure_topics(live_settings))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    printed_to = demo.console.file
    demo.console.file = sys.stderr  # the stack's progress lines; stdout carries the JSON
    try:
        urls = demo._start(live_settings, env, procs, plan)
        summary = run_load(urls["router"], demo.MODEL, requests, concurrency=256,
                           timeout_s=300.0, max_output_tokens=MAX_OUTPUT_TOKENS,
                           progress=False)  # fmt: skip
        _wait_for_lake(plan.lake_dir, summary.counts()["sent"])
        delay: dict[str, Any] = get_json(f"{urls['worker']}/v1/stats")["outcome_delay_s"]
        con = connect(plan.lake_dir)
        try:
            return list(rows(con, "SELECT * FROM graded")), delay
        finally:
            con.close()
    finally:
        demo.console.file = printed_to
        for proc in reversed(list(procs.values())):
            stop(proc)


def _wait_for_lake(lake_dir: Path, sent: int) -> None:
    deadline, seen, since = time.monotonic() + LAKE_WAIT_S, -1, time.monotonic()
    while time.monotonic() < deadline and seen < sent:
        n = demo._lake_requests(lake_dir) if lake_dir.exists() else 0
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since > LAKE_IDLE_S:
            return
        time.sleep(1.0)


def run_replay(settings: Settings, requests: Sequence[TraceRequest]) -> list[Any]:
    """The same requests on the same fleet in virtual time (the predictor policy)."""
    fleet = load_fleet(demo.FLEET)
    policy = PredictorPolicy.for_fleet(fleet, settings=settings)
    result = replay(requests, fleet, policy, speedup=1.0, progress=False, model=demo.MODEL)
    return [msgspec.structs.asdict(r) for r in result.records]


# ---------------------------------------------------------------------------- grading


def _served(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        str(r["request_id"]): r for r in records
        if r["status"] == "served" and r["predicted_ttft_s"] is not None
        and r["actual_ttft_s"] is not None
    }  # fmt: skip


def grades(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        return {"served": 0}
    pred = np.array([r["predicted_ttft_s"] for r in records], dtype=float)
    act = np.array([r["actual_ttft_s"] for r in records], dtype=float)
    err = pred - act
    p90 = [(r.get("predicted_ttft_p90_s"), r["actual_ttft_s"]) for r in records]
    covered = [a <= u for u, a in p90 if u is not None]
    return {
        "served": len(records),
        "within_1s": round(float(np.mean(np.abs(err) <= 1.0)), 4),
        "within_10s": round(float(np.mean(np.abs(err) <= 10.0)), 4),
        "mean_error_s": round(float(err.mean()), 4),
        "abs_error_p50_s": round(float(np.percentile(np.abs(err), 50)), 4),
        "abs_error_p95_s": round(float(np.percentile(np.abs(err), 95)), 4),
        "actual_ttft_p50_s": round(float(np.percentile(act, 50)), 4),
        "p90_coverage": round(float(np.mean(covered)), 4) if covered else None,
    }


SPLITS = {
    "default_curve": lambda r: bool(r.get("fit_default")),
    "fitted_curve": lambda r: not r.get("fit_default"),
    "queued": lambda r: (r.get("queue_wait_s") or 0.0) > 0.05,
    "not_queued": lambda r: (r.get("queue_wait_s") or 0.0) <= 0.05,
}


def compare(live: Sequence[dict[str, Any]], virtual: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Both sides' grades on the requests served on both, whole and split (module doc)."""
    a, b = _served(live), _served(virtual)
    both = sorted(set(a) & set(b))
    out: dict[str, Any] = {
        "requests_live": len(live), "requests_replay": len(virtual),
        "served_live": len(a), "served_replay": len(b), "served_both": len(both),
        "live": grades([a[k] for k in both]), "replay": grades([b[k] for k in both]),
        "by": {},
    }  # fmt: skip
    for name, keep in SPLITS.items():  # each side split by its own prediction's state
        out["by"][name] = {
            "live": grades([a[k] for k in both if keep(a[k])]),
            "replay": grades([b[k] for k in both if keep(b[k])]),
        }
    return out


def run(quick: bool) -> dict[str, Any]:
    settings = load_settings()
    requests = workload(QUICK_TRACE_S if quick else FULL_TRACE_S)
    _, started = kafka_local.up(settings)
    try:
        t0 = time.perf_counter()
        live, delay = run_live(settings, requests,
                               (settings.state_path / "live-vs-replay").resolve())  # fmt: skip
        live_s = time.perf_counter() - t0
    finally:
        if started:
            kafka_local.down(settings)
    t1 = time.perf_counter()
    virtual = run_replay(settings, requests)
    result = compare(live, virtual)
    lw, rw = result["live"].get("within_1s"), result["replay"].get("within_1s")
    result["meta"] = {"requests": len(requests), "speedup": SPEEDUP, "bounds": BOUNDS,
                      "max_output_tokens": MAX_OUTPUT_TOKENS, "live_wall_s": round(live_s, 1),
                      "replay_wall_s": round(time.perf_counter() - t1, 1)}  # fmt: skip
    result["summary"] = {
        "requests": len(requests), "served_both": result["served_both"],
        "live_within_1s": lw, "replay_within_1s": rw,
        "gap_within_1s_points": None if lw is None or rw is None else round(100 * (rw - lw), 2),
        "live_within_10s": result["live"].get("within_10s"),
        "replay_within_10s": result["replay"].get("within_10s"),
        "live_mean_error_s": result["live"].get("mean_error_s"),
        "replay_mean_error_s": result["replay"].get("mean_error_s"),
        "live_p90_coverage": result["live"].get("p90_coverage"),
        "replay_p90_coverage": result["replay"].get("p90_coverage"),
        "live_outcome_delay_p50_s": delay["p50"], "live_outcome_delay_p99_s": delay["p99"],
    }  # fmt: skip
    return result
