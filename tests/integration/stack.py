"""The whole live stack as real processes, for integration tests: Faust worker, simulated
fleet, ingest and router, on the module's own topics."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foretoken.adapters.processes import (
    STOP_GRACE_S,
    foretoken_cmd,
    get_json,
    spawn,
    stop,
    wait_http,
)
from foretoken.settings import Settings
from tests.conftest import RunningWorker, free_port, launch_worker

START_S = 90.0


@dataclass
class Stack:
    worker: RunningWorker
    router_url: str
    engines: list[dict[str, Any]]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker_proc: subprocess.Popen[bytes] | None = None
    tmp: Path = Path(".")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop(proc)
        if self.worker_proc is not None:
            stop(self.worker_proc)


def start_stack(settings: Settings, tmp: Path, fleet: str = "small", time_scale: float = 1.0,
                route_timeout_s: float = 0.25, extra_env: dict[str, str] | None = None,
                **worker_env: str) -> Stack:  # fmt: skip
    """``extra_env`` and ``worker_env`` reach the worker, fleet, ingest and router (e.g.
    FORETOKEN_CONFIG, FORETOKEN_LAKE_DIR)."""
    proc, worker = launch_worker(settings, tmp / "worker", **{**(extra_env or {}), **worker_env})
    stack = Stack(worker=worker, router_url="", engines=[], worker_proc=proc, tmp=tmp)
    try:
        engines_file = tmp / "engines.toml"
        env = dict(worker.env)
        stack.procs["fleet"] = spawn(foretoken_cmd(
            "fleet", "run", fleet, "--base-port", "0", "--kv-base-port", "0",
            "--engines-out", str(engines_file), "--time-scale", str(time_scale),
        ), env, tmp / "fleet.log")  # fmt: skip
        deadline = time.monotonic() + START_S
        while not engines_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        stack.engines = tomllib.loads(engines_file.read_text())["engines"]
        ingest_cmd = foretoken_cmd("ingest", "-e", str(engines_file), "--port", str(free_port()))
        stack.procs["ingest"] = spawn(ingest_cmd, env, tmp / "ingest.log")
        port = free_port()
        router_env = {**env, "FORETOKEN_ROUTE_URL": worker.url,
                      "FORETOKEN_ROUTE_TIMEOUT_S": str(route_timeout_s)}  # fmt: skip
        stack.procs["router"] = spawn(foretoken_cmd("router", "-e", str(engines_file),
                                                    "--port", str(port)),
                                      router_env, tmp / "router.log")  # fmt: skip
        stack.router_url = f"http://127.0.0.1:{port}"
        wait_http(f"{stack.router_url}/healthz", START_S, stack.procs["router"])
        model = stack.engines[0]["model"]
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:  # the route service knows every engine
            page = get_json(f"{worker.url}/v1/cache/{model}")
            if len(page["workers"]) == len(stack.engines):
                break
            time.sleep(0.3)
        return stack
    except Exception:
        stack.stop_all()
        for log in tmp.glob("*.log"):
            print(log, log.read_text()[-2000:])
        raise


@dataclass
class ScaledStack:
    """A primary, route replicas and router processes sharing one port (``router.processes``,
    SO_REUSEPORT), in front of a simulated fleet: the scaled profile of docker-compose.yml as
    real processes."""

    primary: RunningWorker
    replicas: list[RunningWorker]
    router_url: str
    engines: list[dict[str, Any]]
    tmp: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: int = 0

    def worker_proc(self, name: str) -> subprocess.Popen[bytes]:
        return self.procs[name]

    def restart(self, name: str, worker: RunningWorker) -> None:
        """Start a killed processor again: same env (group, port, data, instance id)."""
        self.restarts += 1
        log = self.tmp / f"{name}-restart{self.restarts}.log"
        self.procs[name] = spawn(foretoken_cmd("worker"), worker.env, log)
        wait_http(f"{worker.url}/healthz", START_S * 2, self.procs[name])

    def stop_all(self) -> None:
        stop_together(list(self.procs.values()))


def stop_together(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process group first, then wait for each (one grace period in all, not
    one each: a teardown of nine processes in seconds)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_scaled_stack(settings: Settings, tmp: Path, replicas: int = 2, routers: int = 2,
                       route_timeout_s: float = 2.0, fleet: str = "small",
                       **primary_env: str) -> ScaledStack:  # fmt: skip
    """A primary (``primary_env``: e.g. its lake), ``replicas`` route replicas reading its
    snapshots, and ``routers`` routers on one port asking the replicas (static URLs)."""
    from tests.conftest import worker_env

    app_id = f"scaled-{settings.topic_prefix}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        proc, primary = launch_worker(settings, tmp / "primary", app_id,
                                      FORETOKEN_SNAPSHOT_INTERVAL_S="2", **primary_env)  # fmt: skip
        procs["primary"] = proc
        snapshots = primary.env["FORETOKEN_WORKER_DATA_DIR"]
        workers: list[RunningWorker] = []
        for i in range(replicas):  # started together, waited for together (they catch up)
            port = free_port()
            env = {**worker_env(settings, tmp / f"replica{i}", port, app_id),
                   "FORETOKEN_ROLE": "route", "FORETOKEN_INSTANCE_ID": f"replica-{i}",
                   "FORETOKEN_SNAPSHOT_DIR": snapshots}  # fmt: skip
            procs[f"replica{i}"] = spawn(foretoken_cmd("worker"), env, tmp / f"replica{i}.log")
            workers.append(RunningWorker(settings, f"http://127.0.0.1:{port}", env,
                                         tmp / f"replica{i}.log"))  # fmt: skip
        engines_file = tmp / "engines.toml"
        env = dict(primary.env)
        procs["fleet"] = spawn(foretoken_cmd(
            "fleet", "run", fleet, "--base-port", "0", "--kv-base-port", "0",
            "--engines-out", str(engines_file),
        ), env, tmp / "fleet.log")  # fmt: skip
        deadline = time.monotonic() + START_S
        while not engines_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        engines = tomllib.loads(engines_file.read_text())["engines"]
        procs["ingest"] = spawn(foretoken_cmd("ingest", "-e", str(engines_file)), env,
                                tmp / "ingest.log")  # fmt: skip
        for i, w in enumerate(workers):
            wait_http(f"{w.url}/healthz", START_S * 2, procs[f"replica{i}"])
        port = free_port()
        router_env = {**env, "FORETOKEN_ROUTE_URLS": ",".join(w.url for w in workers),
                      "FORETOKEN_ROUTE_TIMEOUT_S": str(route_timeout_s),
                      "FORETOKEN_ROUTER_PROCESSES": str(routers)}  # fmt: skip
        # router.processes: that many router processes on the port (SO_REUSEPORT)
        procs["router"] = spawn(
            foretoken_cmd("router", "-e", str(engines_file), "--port", str(port)),
            router_env, tmp / "router.log",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", START_S, procs["router"])
        model = engines[0]["model"]
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:  # every replica knows every engine
            pages = [get_json(f"{w.url}/v1/cache/{model}") for w in workers]
            if all(len(p["workers"]) == len(engines) for p in pages):
                break
            time.sleep(0.3)
        return ScaledStack(primary, workers, url, engines, tmp, procs)
    except Exception:
        for p in procs.values():
            stop(p)
        for log in sorted(tmp.rglob("*.log")):
            print(log, log.read_text()[-2000:])
        raise
