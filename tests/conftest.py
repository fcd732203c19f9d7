"""Shared fixtures. Integration fixtures start real processes (a Kafka broker, the Faust
worker) and stop what they started; nothing here is mocked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from foretoken.adapters.ports import free_port
from foretoken.settings import Settings, load_settings

__all__ = ["free_port"]
WORKER_START_S = 120.0


@dataclass(frozen=True)
class PrivateBroker:
    """A broker of a test's own: its own port pair and state dir, started from nothing."""

    config: Path
    bootstrap: str
    env: dict[str, str]

    def cli(self, *args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "foretoken.cli", *args, "-c", str(self.config)],
            env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip


def private_broker_config(tmp: Path) -> PrivateBroker:
    """Settings for a private broker (not started): port P and controller P + 1 free."""
    port = free_port(count=2)
    config = tmp / "kafka.toml"
    config.write_text(
        f'state_dir = "{tmp / "state"}"\n[kafka]\nbootstrap_servers = "127.0.0.1:{port}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    return PrivateBroker(config, f"127.0.0.1:{port}", env)


def pytest_configure(config: pytest.Config) -> None:
    """The controlling process (pytest-xdist's, or the only one) notes whether a broker
    answered before the run: if one of its processes starts one, it stops it at the end."""
    if not hasattr(config, "workerinput"):
        from foretoken.ops.kafka_local import accepts_connections

        config.stash[_BROKER_WAS_UP] = accepts_connections(load_settings().kafka.bootstrap_servers)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_BROKER_WAS_UP, True):
        return
    from foretoken.ops import kafka_local

    kafka_local.down(load_settings())  # the local one the session started (none: a no-op)


_BROKER_WAS_UP = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A reachable broker: $KAFKA_BOOTSTRAP_SERVERS, one already running, or one started
    here (under a lock: pytest-xdist's processes share it), which the controlling process
    stops once every process is done (:func:`pytest_unconfigure`)."""
    import fcntl

    from foretoken.ops import kafka_local

    base = load_settings()
    lock_path = tmp_path_factory.getbasetemp().parent / "kafka-up.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kafka_local.up(base)  # none started when one answers
        fcntl.flock(lock, fcntl.LOCK_UN)
    return base


@pytest.fixture(scope="module")
def kafka_settings(kafka_broker: Settings) -> Iterator[Settings]:
    """Settings with topics of this test module's own (a fresh prefix), so that modules and
    runs never see each other's records; deleted after the module (with the Faust topics of
    workers whose app id holds the prefix), so that a broker kept across many runs does not
    pile up thousands of partitions (one that did stopped at start: too many open files)."""
    from foretoken.adapters.kafka.topics import ensure_topics

    prefix = f"t{uuid.uuid4().hex[:8]}-"
    settings = load_settings(env={**os.environ, "FORETOKEN_TOPIC_PREFIX": prefix})
    asyncio.run(ensure_topics(settings))
    yield settings
    asyncio.run(_delete_topics(settings.kafka.bootstrap_servers, prefix))


async def _delete_topics(bootstrap: str, marker: str) -> None:
    """Delete every topic whose name holds ``marker`` (best effort: a test's result never
    depends on it)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        names = [t for t in await admin.list_topics() if marker in t]
        if names:
            await admin.delete_topics(names)
    except Exception as exc:
        print(f"could not delete the topics of {marker}: {exc}")
    finally:
        await admin.close()


@dataclass(frozen=True)
class RunningWorker:
    settings: Settings
    url: str
    env: dict[str, str]
    log: Path


def worker_env(
    settings: Settings, tmp: Path, port: int, app_id: str | None = None
) -> dict[str, str]:
    return {
        "FORETOKEN_TOPIC_PREFIX": settings.topic_prefix,
        "FORETOKEN_APP_ID": app_id or f"foretoken-{settings.topic_prefix}{uuid.uuid4().hex[:4]}",
        "FORETOKEN_WEB_PORT": str(port),
        "FORETOKEN_WORKER_DATA_DIR": str(tmp / "worker-data"),
        "FORETOKEN_LOG_LEVEL": "warn",
        "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
    }


def launch_worker(
    settings: Settings, tmp: Path, app_id: str | None = None, **extra_env: str
) -> tuple[subprocess.Popen[bytes], RunningWorker]:
    """Start `foretoken worker` as a real process and wait for its /healthz."""
    from foretoken.adapters.processes import foretoken_cmd, spawn, stop, wait_http

    port = free_port()
    env = {**worker_env(settings, tmp, port, app_id), **extra_env}
    log = tmp / f"worker-{port}.log"
    proc = spawn(foretoken_cmd("worker"), env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", WORKER_START_S, proc)
    except Exception:
        stop(proc)
        print(log.read_text()[-4000:])
        raise
    return proc, RunningWorker(load_settings(env={**os.environ, **env}), url, env, log)


@pytest.fixture(scope="module")
def faust_worker(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningWorker]:
    from foretoken.adapters.processes import stop

    proc, worker = launch_worker(kafka_settings, tmp_path_factory.mktemp("worker"))
    yield worker
    stop(proc)


LAST_MODULES = ("test_aiperf.py", "test_llama_cpp.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The unit and contract suites first, then the integration suites, the aiperf and
    llama.cpp tests last: ``make test`` installs aiperf (~2.5 CPU-minutes) and builds
    llama-cpp-python (~7 CPU-minutes) in the background, at the lowest priority, when they
    are not there yet, and those two tests wait for them. The integration suites time real
    work (engines whose measured TTFTs the fits learn from), so they are better late, when
    the build is over or nearly. pytest-xdist hands modules out in this order."""
    items.sort(
        key=lambda item: (
            item.path.name in LAST_MODULES,
            item.get_closest_marker("integration") is not None,
        )
    )
