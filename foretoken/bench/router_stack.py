"""The router benchmark's stack: the processor, the engine stub (four fake engines in one
process), ingest and the router as real processes on topics of their own, and their CPU
accounting (a router with several processes counts all of them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient

from foretoken.adapters.engines.engines_file import EngineConfig, load_engines
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.ports import free_port
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.ops import kafka_local
from foretoken.settings import Settings, load_settings

STUB_ENGINES = 4
STUB_MODEL = "stub-model"
START_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- the stack


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


@dataclass
class Stack:
    """The live stack on its own topics; ``close`` stops everything this bench started."""

    tmp: Path
    settings: Settings
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    engines: list[EngineConfig] = field(default_factory=list)
    worker_url: str = ""
    router_url: str = ""
    started_broker: bool = False
    kafka_pid: int | None = None  # the project's local broker, when that is the one used

    def pids(self) -> dict[str, int]:
        """Every process of the stack by name; a router's forked processes as router-1…"""
        out = {name: p.pid for name, p in self.procs.items() if p.poll() is None}
        if "router" in out:
            for i, child in enumerate(children(out["router"]), 1):
                out[f"router-{i}"] = child
        if self.kafka_pid is not None:
            out["kafka"] = self.kafka_pid
        return {**out, "loadgen": os.getpid()}

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            stop(self.procs[name])
        with contextlib.suppress(Exception):
            asyncio.run(_delete_topics(self.settings))
        if self.started_broker:
            kafka_local.down(self.settings)

    def log_tails(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.log"))


def worker_env(base: Settings, prefix: str, port: int, data_dir: Path) -> dict[str, str]:
    """A bench's processor: topics and consumer group of its own (``prefix``), its web port
    and data directory, quiet logs, ``base``'s broker."""
    return {
        "FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_APP_ID": f"foretoken-{prefix}bench",
        "FORETOKEN_WEB_PORT": str(port), "FORETOKEN_WORKER_DATA_DIR": str(data_dir),
        "FORETOKEN_LOG_LEVEL": "warn", "KAFKA_BOOTSTRAP_SERVERS": base.kafka.bootstrap_servers,
    }  # fmt: skip


def start_stack(tmp: Path, route_timeout_s: float, router_processes: int = 1,
                fleet: str | None = None) -> Stack:  # fmt: skip
    """The stack on the engine stub, or with ``fleet`` (a fleet name) on simulated engines."""
    base = load_settings()
    _status, started = kafka_local.up(base)  # none started when one answers
    prefix, port = f"rb{uuid.uuid4().hex[:8]}-", free_port()
    env = worker_env(base, prefix, port, tmp / "worker-data")
    stack = Stack(tmp, load_settings(env={**os.environ, **env}), started_broker=started)
    if not base.kafka.external:
        stack.kafka_pid = kafka_local.running_pid(kafka_local.layout_for(base))
    try:
        asyncio.run(ensure_topics(stack.settings))
        stack.procs["worker"] = spawn(foretoken_cmd("worker"), env, tmp / "worker.log")
        stack.worker_url = f"http://127.0.0.1:{port}"
        wait_http(f"{stack.worker_url}/healthz", START_TIMEOUT_S, stack.procs["worker"])
        engines_file = tmp / "engines.toml"
        if fleet is None:
            ports = ",".join(str(free_port()) for _ in range(STUB_ENGINES))
            stack.procs["stub"] = spawn(
                [sys.executable, "-m", "foretoken.bench.engine_stub", "--ports", ports,
                 "--model", STUB_MODEL, "--engines-out", str(engines_file)],
                env, tmp / "stub.log",
            )  # fmt: skip
        else:
            stack.procs["fleet"] = spawn(foretoken_cmd(
                "fleet", "run", fleet, "--base-port", "0", "--kv-base-port", "0",
                "--engines-out", str(engines_file),
            ), env, tmp / "fleet.log")  # fmt: skip
        engines_proc = stack.procs["stub" if fleet is None else "fleet"]
        _wait_for(engines_file.exists, engines_proc, "the engines file")
        stack.engines = load_engines(engines_file)
        ingest_cmd = foretoken_cmd("ingest", "-e", str(engines_file), "--port", str(free_port()))
        stack.procs["ingest"] = spawn(ingest_cmd, env, tmp / "ingest.log")
        router_port = free_port()
        router_env = {**env, "FORETOKEN_ROUTE_URL": stack.worker_url,
                      "FORETOKEN_ROUTE_TIMEOUT_S": str(route_timeout_s),
                      "FORETOKEN_ROUTER_PROCESSES": str(router_processes)}  # fmt: skip
        stack.procs["router"] = spawn(
            foretoken_cmd("router", "-e", str(engines_file), "--port", str(router_port)),
            router_env, tmp / "router.log",
        )  # fmt: skip
        stack.router_url = f"http://127.0.0.1:{router_port}"
        wait_http(f"{stack.router_url}/healthz", START_TIMEOUT_S, stack.procs["router"])
        cache_url = f"{stack.worker_url}/v1/cache/{stack.engines[0].model}"
        _wait_for(lambda: len(get_json(cache_url)["workers"]) == len(stack.engines),
                  stack.procs["ingest"], "the route service to know every engine")  # fmt: skip
        return stack
    except BaseException:
        print(stack.log_tails(), file=sys.stderr)
        stack.close()
        raise


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a router's forked processes)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return sorted(out)


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a process exited ({proc.returncode}) while waiting for {what}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            if ready():
                return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


async def _delete_topics(settings: Settings) -> None:
    """This run's topics, and the Faust worker's internal ones (named after its app id)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap_servers)
    await admin.start()
    try:
        ours = (settings.topic_prefix, settings.worker.app_id)
        mine = [t for t in await admin.list_topics() if t.startswith(ours)]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()
