"""``make demo``: the whole live pipeline on this machine.

Kafka (KRaft, local) → the Faust worker (index, fits, queues, route service, grading join)
→ a simulated fleet (``demo.toml``: engines with hidden true costs, vLLM-format KV events)
→ ingest → the router; then a stretch of the Mooncake trace through the router at a load
near the fleet's capacity, with a mix of TTFT bounds. It prints what the client saw, what
the predictor learned (fitted curves next to the simulator's hidden truth, which only the
demo reads, for comparison). The worker's sink writes every graded request to the Parquet
lake (``.run/demo/lake``); the demo waits for the lake to hold them all, prints the grading
report from it (``foretoken.adapters.lake.report``, the same as ``foretoken report --lake``), and
leaves the
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

from rich.table import Table

from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.lake.report import output_console, print_table
from foretoken.adapters.ports import free_port, in_use
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.ops import kafka_local
from foretoken.settings import Settings, load_settings
from foretoken.sim.clients import BoundMix
from foretoken.sim.live.load import run_load
from foretoken.sim.spec import load_fleet
from foretoken.sim.traces import load_mooncake

START_S = 120.0
FLEET = "demo"
MODEL = "sim-demo"
ROUTER_PORT = 8000  # a free port is used instead when this one is taken
# A warm-up at half the trace's pace (quiet moments give the fits their prefill samples: a
# sample needs a request with no other prompt prefilling on its worker), then the trace at
# its own pace, which keeps this fleet busy (demo.toml is ~2.5x slower than the reference).
WARMUP_SPEEDUP = 0.5
TRACE_SPEEDUP = 1.0
BOUNDS = "10:0.3,30:0.4,none:0.3"
LAKE_WAIT_S = 90.0  # for the sink to write the last graded requests
LAKE_IDLE_S = 15.0  # ... or until the lake stops growing for this long
DASHBOARD_PORT = 8501  # a free port is used instead when this one is taken


@dataclasses.dataclass(frozen=True, slots=True)
class DemoPlan:
    """How much trace the demo drives (trace seconds) and where it keeps its files."""

    run_dir: Path
    warmup_s: float = 30.0  # of trace time, i.e. 60 s of wall time at half pace
    trace_s: float = 90.0  # of trace time after the warm-up

    @classmethod
    def for_settings(cls, settings: Settings, quick: bool = False) -> DemoPlan:
        """``--quick`` (the CI smoke run): a short warm-up and slice, well under 3 minutes
        with the broker's start. Files under the state directory, whatever the cwd."""
        run_dir = (settings.state_path / "demo").resolve()
        return cls(run_dir, 6.0, 24.0) if quick else cls(run_dir)

    @property
    def lake_dir(self) -> Path:
        return self.run_dir / "lake"

    @property
    def dashboard_pid(self) -> Path:
        return self.run_dir / "dashboard.pid"


console = output_console()


def run_demo(
    settings: Settings, keep: bool = False, dashboard: bool = True, quick: bool = False
) -> int:
    """The demo; 0 only when it ends with a graded lake and its report (1 otherwise)."""
    plan = DemoPlan.for_settings(settings, quick)
    console.rule("[bold]foretoken demo" + (" (quick)" if quick else ""))
    st, started_broker = kafka_local.up(settings)
    console.print(f"broker: {st.describe()}")
    prefix = f"demo{uuid.uuid4().hex[:4]}-"
    _stop_dashboard(plan)  # a previous demo's, which reads the lake about to be replaced
    shutil.rmtree(plan.lake_dir, ignore_errors=True)
    env = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_APP_ID": f"foretoken-{prefix}",
           "FORETOKEN_WORKER_DATA_DIR": str(plan.run_dir / "worker"),
           "FORETOKEN_LAKE_DIR": str(plan.lake_dir)}  # fmt: skip
    base = load_settings(env={**_os_env(), **env})
    if in_use(base.worker.web_host, base.worker.web_port):  # another worker runs: use a free port
        env["FORETOKEN_WEB_PORT"] = str(free_port(base.worker.web_host))
    demo_settings = load_settings(env={**_os_env(), **env})
    asyncio.run(ensure_topics(demo_settings))
    console.print(f"topics: {', '.join(demo_settings.all_topics().values())}")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        urls = _start(demo_settings, env, procs, plan)
        warm, summary = _drive(urls["router"], plan)
        _show_client(summary)
        _show_fits(urls["worker"])
        graded = _show_report(warm.counts()["sent"] + summary.counts()["sent"], plan)
        console.print(f"\nrouter: {urls['router']}/v1  ·  worker: {urls['worker']}/metrics  ·  "
                      f"logs: {plan.run_dir}/")  # fmt: skip
        if graded == 0:
            console.print(f"[red]error:[/red] no graded request reached the lake "
                          f"{plan.lake_dir}; see the logs in {plan.run_dir}/")  # fmt: skip
            return 1
        if dashboard:
            _start_dashboard(plan)
        if keep:
            keep_running()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc)
        if started_broker:
            kafka_local.down(settings)


def keep_running() -> None:
    """``--keep``: leave everything running until Ctrl-C (KeyboardInterrupt)."""
    console.print("[bold]--keep[/bold]: everything keeps running; Ctrl-C to stop.")
    while True:
        time.sleep(3600)


def _os_env() -> dict[str, str]:
    import os

    return dict(os.environ)


def _start(
    settings: Settings, env: dict[str, str], procs: dict[str, Any], plan: DemoPlan
) -> dict[str, str]:
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    worker_url = f"http://{settings.worker.web_host}:{settings.worker.web_port}"
    procs["worker"] = spawn(foretoken_cmd("worker"), env, run_dir / "worker.log")
    wait_http(f"{worker_url}/healthz", START_S, procs["worker"])
    console.print(f"worker: up at {worker_url}")
    engines = run_dir / "engines.toml"
    engines.unlink(missing_ok=True)
    procs["fleet"] = spawn(foretoken_cmd("fleet", "run", FLEET, "--engines-out", str(engines)),
                           env, run_dir / "fleet.log")  # fmt: skip
    deadline = time.monotonic() + START_S
    while not engines.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    console.print(f"fleet: {len(load_fleet(FLEET).engines)} simulated engines ({FLEET}.toml)")
    ingest_cmd = foretoken_cmd("ingest", "-e", str(engines), "--port", str(free_port()))
    procs["ingest"] = spawn(ingest_cmd, env, run_dir / "ingest.log")
    router_env = {**env, "FORETOKEN_ROUTE_URL": worker_url}
    port = free_port("127.0.0.1") if in_use("127.0.0.1", ROUTER_PORT) else ROUTER_PORT
    router_cmd = foretoken_cmd("router", "-e", str(engines), "--port", str(port))
    procs["router"] = spawn(router_cmd, router_env, run_dir / "router.log")
    router_url = f"http://127.0.0.1:{port}"
    wait_http(f"{router_url}/healthz", START_S, procs["router"])
    n = len(load_fleet(FLEET).engines)
    while time.monotonic() < deadline:
        if len(get_json(f"{worker_url}/v1/cache/{MODEL}")["workers"]) == n:
            break
        time.sleep(0.3)
    console.print(f"ingest and router: up; the route service knows all {n} engines")
    return {"worker": worker_url, "router": router_url}


def _drive(router_url: str, plan: DemoPlan) -> tuple[Any, Any]:
    warm = [r for r in load_mooncake(speedup=WARMUP_SPEEDUP)
            if r.arrival_s * WARMUP_SPEEDUP < plan.warmup_s]  # fmt: skip
    console.rule(f"warm-up: {len(warm)} Mooncake requests at {WARMUP_SPEEDUP}x")
    warm_summary = run_load(router_url, MODEL, warm, concurrency=256, timeout_s=300.0,
                            max_output_tokens=16)  # fmt: skip
    end_s = plan.warmup_s + plan.trace_s
    rest = [r for r in load_mooncake(speedup=TRACE_SPEEDUP)
            if plan.warmup_s <= r.arrival_s * TRACE_SPEEDUP < end_s]  # fmt: skip
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
    print_table(console, table)


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
    print_table(console, table)


def _lake_requests(lake_dir: Path) -> int:
    from foretoken.adapters.lake.views import connect, rows

    con = connect(lake_dir)
    try:
        return int(rows(con, "SELECT count(*) AS n FROM graded")[0]["n"])
    finally:
        con.close()


def _show_report(sent: int, plan: DemoPlan) -> int:
    """Wait for the sink to write every request the client sent, then the lake's report;
    returns how many requests the lake holds."""
    from foretoken.adapters.lake.report import render, report

    lake_dir = plan.lake_dir
    console.rule(f"the grading lake: {lake_dir}/")
    deadline = time.monotonic() + LAKE_WAIT_S
    seen, since = -1, time.monotonic()
    while time.monotonic() < deadline and seen < sent:
        n = _lake_requests(lake_dir)
        if n != seen:
            seen, since = n, time.monotonic()
        elif time.monotonic() - since > LAKE_IDLE_S:
            break
        time.sleep(1.0)
    console.print(f"{seen} of the {sent} requests sent are graded in the lake "
                  "(one row per request id)")  # fmt: skip
    if seen <= 0:
        return 0
    render(report(lake_dir), console)
    console.print(f"same report: foretoken report --lake {lake_dir}  ·  "
                  f'SQL: foretoken sql --lake {lake_dir} "select * from by_worker"')  # fmt: skip
    return seen


def _stop_dashboard(plan: DemoPlan) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(plan.dashboard_pid.read_text())
        os.killpg(pid, signal.SIGTERM)
    plan.dashboard_pid.unlink(missing_ok=True)


def _start_dashboard(plan: DemoPlan) -> None:
    """``foretoken dashboard`` on the lake, left running after the demo (its own session)."""
    port = free_port("127.0.0.1") if in_use("127.0.0.1", DASHBOARD_PORT) else DASHBOARD_PORT
    proc = spawn(foretoken_cmd("dashboard", "--lake", str(plan.lake_dir), "--port", str(port)),
                 {}, plan.run_dir / "dashboard.log")  # fmt: skip
    plan.dashboard_pid.write_text(str(proc.pid))
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
        console.print(f"[red]the dashboard did not start[/red]; see {plan.run_dir}/dashboard.log")
        return
    console.print(f"[bold]dashboard[/bold]: {url}  (keeps running after the demo; stop it "
                  f"with: kill -- -$(cat {plan.dashboard_pid}))")  # fmt: skip
