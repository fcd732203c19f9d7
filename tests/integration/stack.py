"""The whole live stack as real processes, for integration tests: Faust worker, simulated
fleet, ingest and router, on the module's own topics."""

from __future__ import annotations

import subprocess
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
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
