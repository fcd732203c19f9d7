"""``make demo``: the whole live pipeline on this machine.

Kafka (KRaft, local) → the Faust worker (index, fits, queues, route service, grading join)
→ a simulated fleet (``demo.toml``: engines with hidden true costs, vLLM-format KV events)
→ ingest → the router; then a stretch of the Mooncake trace through the router at a load
near the fleet's capacity, with a mix of TTFT bounds. It prints what the client saw, what
the predictor learned (fitted curves next to the simulator's hidden truth, which only the
demo reads, for comparison). The worker's sink writes every graded request to the Parquet
lake (``.run/demo/lake``); the demo waits for the lake to hold them all, prints the grading
report from it (``grading.report``, the same as ``foretoken report --lake``), and leaves the
Streamlit dashboard running on that lake in the background, printing its URL and how to
stop it (``--no-dashboard``: don't start it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleet.load import run_load
from fleet.spec import load_fleet
from fleet.traces import BoundMix, load_mooncake
from foretoken.settings import Settings, load_settings
from ops import kafka_local
from ops.procs import foretoken_cmd, get_json, spawn, stop, wait_http
from streams.topics import ensure_topics

START_S = 120.0
RUN_DIR = Path(".run/demo")
FLEET = "demo"
MODEL = "sim-demo"
ROUTER_PORT = 8000  # a free port is used instead when this one is taken
# A warm-up at half the trace's pace (quiet moments give the fits their prefill samples: a
# sample needs a request with no other prompt prefilling on its worker), then the trace at
# its own pace, which keeps this fleet busy (demo.toml is ~2.5x slower than the reference).
WARMUP_SECONDS = 30.0  # of trace time, i.e. 60 s of wall time at half pace
WARMUP_SPEEDUP = 0.5
TRACE_SPEEDUP = 1.0
TRACE_SECONDS = 90.0  # of trace time after the warm-up
BOUNDS = "10:0.3,30:0.4,none:0.3"
LAKE_DIR = RUN_DIR / "lake"
LAKE_WAIT_S = 90.0  # for the sink to write the last graded requests
LAKE_IDLE_S = 15.0  # ... or until the lake stops growing for this long
DASHBOARD_PORT = 8501  # a free port is used instead when this one is taken
DASHBOARD_PID = RUN_DIR / "dashboard.pid"

console = Console()


def run_demo(settings: Settings, keep: bool = False, dashboard: bool = True) -> int:
    console.rule("[bold]foretoken demo")
    st, started_broker = kafka_local.up(settings)
    console.print(f"broker: {st.describe()}")
    prefix = f"demo{uuid.uuid4().hex[:4]}-"
    _stop_dashboard()  # a previous demo's, which reads the lake about to be replaced
    shutil.rmtree(LAKE_DIR, ignore_errors=True)
    env = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_APP_ID": f"foretoken-{prefix}",
           "FORETOKEN_WORKER_DATA_DIR": str(RUN_DIR / "worker"),
           "FORETOKEN_LAKE_DIR": str(LAKE_DIR)}  # fmt: skip
    base = load_settings(env={**_os_env(), **env})
    if _busy(base.worker.web_host, base.worker.web_port):  # another worker runs: use a free port
        env["FORETOKEN_WEB_PORT"] = str(_free_port(base.worker.web_host))
    demo_settings = load_settings(env={**_os_env(), **env})
    asyncio.run(ensure_topics(demo_settings))
    console.print(f"topics: {', '.join(demo_settings.all_topics().values())}")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        urls = _start(demo_settings, env, procs)
        warm, summary = _drive(urls["router"])
        _show_client(summary)
        _show_fits(urls["worker"])
        _show_report(warm.counts()["sent"] + summary.counts()["sent"])
        console.print(f"\nrouter: {urls['router']}/v1  ·  worker: {urls['worker']}/metrics  ·  "
                      f"logs: {RUN_DIR}/")  # fmt: skip
        if dashboard:
            _start_dashboard()
        if keep:
            console.print("[bold]--keep[/bold]: everything keeps running; Ctrl-C to stop.")
            while True:
                time.sleep(3600)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc)
        if started_broker:
            kafka_local.down(settings)


def _busy(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _os_env() -> dict[str, str]:
    import os

    return dict(os.environ)


def _start(settings: Settings, env: dict[str, str], procs: dict[str, Any]) -> dict[str, str]:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    worker_url = f"http://{settings.worker.web_host}:{settings.worker.web_port}"
    procs["worker"] = spawn(foretoken_cmd("worker"), env, RUN_DIR / "worker.log")
    wait_http(f"{worker_url}/healthz", START_S, procs["worker"])
    console.print(f"worker: up at {worker_url}")
    engines = RUN_DIR / "engines.toml"
    engines.unlink(missing_ok=True)
    procs["fleet"] = spawn(foretoken_cmd("fleet", "run", FLEET, "--engines-out", str(engines)),
                           env, RUN_DIR / "fleet.log")  # fmt: skip
    deadline = time.monotonic() + START_S
    while not engines.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    console.print(f"fleet: {len(load_fleet(FLEET).engines)} simulated engines ({FLEET}.toml)")
    procs["ingest"] = spawn(foretoken_cmd("ingest", "-e", str(engines)), env,
                            RUN_DIR / "ingest.log")  # fmt: skip
    router_env = {**env, "FORETOKEN_ROUTE_URL": worker_url}
    port = _free_port("127.0.0.1") if _busy("127.0.0.1", ROUTER_PORT) else ROUTER_PORT
    router_cmd = foretoken_cmd("router", "-e", str(engines), "--port", str(port))
    procs["router"] = spawn(router_cmd, router_env, RUN_DIR / "router.log")
    router_url = f"http://127.0.0.1:{port}"
    wait_http(f"{router_url}/healthz", START_S, procs["router"])
    n = len(load_fleet(FLEET).engines)
    while time.monotonic() < deadline:
        if len(get_json(f"{worker_url}/v1/cache/{MODEL}")["workers"]) == n:
            break
        time.sleep(0.3)
    console.print(f"ingest and router: up; the route service knows all {n} engines")
    return {"worker": worker_url, "router": router_url}


def _drive(router_url: str) -> tuple[Any, Any]:
    warm = [r for r in load_mooncake(speedup=WARMUP_SPEEDUP)
            if r.arrival_s * WARMUP_SPEEDUP < WARMUP_SECONDS]  # fmt: skip
    console.rule(f"warm-up: {len(warm)} Mooncake requests at {WARMUP_SPEEDUP}x")
    warm_summary = run_load(router_url, MODEL, warm, concurrency=256, timeout_s=300.0,
                            max_output_tokens=16)  # fmt: skip
    end_s = WARMUP_SECONDS + TRACE_SECONDS
    rest = [r for r in load_mooncake(speedup=TRACE_SPEEDUP)
            if WARMUP_SECONDS <= r.arrival_s * TRACE_SPEEDUP < end_s]  # fmt: skip
    shift = min(r.arrival_s for r in rest)
    rest = [dataclasses.replace(r, arrival_s=r.arrival_s - shift) for r in rest]
    rest = BoundMix.parse(BOUNDS).assign(rest, seed=0)
    console.rule(f"{len(rest)} Mooncake requests at {TRACE_SPEEDUP}x, bounds {BOUNDS}")
    return warm_summary, run_load(router_url, MODEL, rest, concurrency=256, timeout_s=300.0,
                                  max_output_tokens=16)  # fmt: skip


def _show_client(summary: Any) -> None:
    c = summary.counts()
    table = Table(title="what the client saw (through the router)")
    for col in ("sent", "ok", "429", "failed", "TTFT p50", "TTFT p95", "TTFT p99"):
        table.add_column(col, justify="right")
    table.add_row(str(c["sent"]), str(c["ok"]), str(c["rejected"]), str(c["failed"]),
                  *(f"{c[k]:.2f} s" if c.get(k) is not None else "-"
                    for k in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s")))  # fmt: skip
    console.print(table)


def _show_fits(worker_url: str) -> None:
    fleet = {e.id: e.truth for e in load_fleet(FLEET).engines}
    table = Table(title="prefill curves: learned online vs the simulator's hidden truth")
    for col in ("worker", "samples", "C(8k) fit", "C(8k) true", "C(32k) fit", "C(32k) true"):
        table.add_column(col, justify="right")
    for fit in get_json(f"{worker_url}/v1/fits")["fits"]:
        if not fit["current"]:
            continue
        truth = fleet.get(fit["worker_id"])
        row = [fit["worker_id"], f"{fit['samples']}{' (default)' if fit['default'] else ''}"]
        for n in (8192, 32768):
            row.append(f"{fit['a'] * n + fit['b'] * n * n:.2f} s")
            row.append(f"{truth.prefill_s(n):.2f} s" if truth else "-")
        table.add_row(*row)
    console.print(table)


def _lake_requests() -> int:
    from grading.views import connect, rows

    con = connect(LAKE_DIR)
    try:
        return int(rows(con, "SELECT count(*) AS n FROM graded")[0]["n"])
    finally:
        con.close()


def _show_report(sent: int) -> None:
    """Wait for the sink to write every request the client sent, then the lake's report."""
    from grading.report import render, report

    console.rule(f"the grading lake: {LAKE_DIR}/")
    deadline = time.monotonic() + LAKE_WAIT_S
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline and seen < sent:
        n = _lake_requests()
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since > LAKE_IDLE_S:
            break
        time.sleep(1.0)
    console.print(f"{seen} of the {sent} requests sent are graded in the lake "
                  "(one row per request id)")  # fmt: skip
    render(report(LAKE_DIR), console)
    console.print(f"same report: foretoken report --lake {LAKE_DIR}  ·  "
                  f'SQL: foretoken sql --lake {LAKE_DIR} "select * from by_worker"')  # fmt: skip


def _stop_dashboard() -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(DASHBOARD_PID.read_text())
        os.killpg(pid, signal.SIGTERM)
    DASHBOARD_PID.unlink(missing_ok=True)


def _start_dashboard() -> None:
    """``foretoken dashboard`` on the lake, left running after the demo (its own session)."""
    port = _free_port("127.0.0.1") if _busy("127.0.0.1", DASHBOARD_PORT) else DASHBOARD_PORT
    proc = spawn(foretoken_cmd("dashboard", "--lake", str(LAKE_DIR), "--port", str(port)), {},
                 RUN_DIR / "dashboard.log")  # fmt: skip
    DASHBOARD_PID.write_text(str(proc.pid))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"{url}/_stcore/health", timeout=2.0),
        ):
            break
        time.sleep(0.5)
    if proc.poll() is not None:
        console.print(f"[red]the dashboard did not start[/red]; see {RUN_DIR}/dashboard.log")
        return
    console.print(f"[bold]dashboard[/bold]: {url}  (keeps running after the demo; stop it "
                  f"with: kill -- -$(cat {DASHBOARD_PID}))")  # fmt: skip
