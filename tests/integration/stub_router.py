"""A router in front of the engine stub, as real processes: for the tests of the router's
edges (SDKs, bad input, broken streams, big bodies, headers, keys, fuzzing), which need
engines that answer at once but not the processor. The route URL points at a port where
nothing listens, so the router decides with its fallback (the route service's own answers
are tested in test_router.py); grants and outcomes go to the real broker."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from foretoken.adapters.processes import foretoken_cmd, spawn, stop, wait_http
from foretoken.settings import Settings
from tests.conftest import free_port

MODEL = "stub-model"
START_S = 60.0


@dataclass
class StubRouter:
    url: str
    engines_file: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def stub_engines(tmp: Path, count: int = 2) -> Iterator[Path]:
    engines_file = tmp / "engines.toml"
    ports = ",".join(str(free_port()) for _ in range(count))
    proc = spawn(
        [
            sys.executable,
            "-m",
            "foretoken.bench.engine_stub",
            "--ports",
            ports,
            "--model",
            MODEL,
            "--engines-out",
            str(engines_file),
        ],
        {},
        tmp / "stub.log",
    )
    try:
        deadline = time.monotonic() + START_S
        while not engines_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the stub did not start"
            time.sleep(0.05)
        yield engines_file
    finally:
        stop(proc)


@contextmanager
def stub_router(
    settings: Settings, tmp: Path, engines_file: Path, **env: str
) -> Iterator[StubRouter]:
    port = free_port()
    log = tmp / f"router-{port}.log"
    full = {
        "FORETOKEN_TOPIC_PREFIX": settings.topic_prefix,
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "FORETOKEN_ROUTE_URL": f"http://127.0.0.1:{free_port()}",
        **env,
    }
    proc = spawn(foretoken_cmd("router", "-e", str(engines_file), "--port", str(port)), full, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", START_S, proc)
        yield StubRouter(f"http://127.0.0.1:{port}", engines_file, log, proc)
    finally:
        stop(proc)
