"""A local Apache Kafka broker (KRaft, one combined broker+controller) owned by the project.

The jars come from Maven Central through ``ops/kafka/pom.xml`` (fetched once into the cache
directory); storage is formatted once; the broker runs in the background with a small heap
and a pid file. If ``KAFKA_BOOTSTRAP_SERVERS`` is set, that broker is used and nothing here
starts or stops anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from foretoken.adapters.ports import accepts_connections, host_port
from foretoken.adapters.processes import port_taken
from foretoken.settings import Settings

__all__ = ["KafkaError", "accepts_connections", "down", "status", "up"]

OPS_KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
CLUSTER_ID_FILE = "cluster.id"
STOP_GRACE_S = 30.0
POLL_S = 0.25


class KafkaError(RuntimeError):
    """A broker that cannot be set up or started, with what to do about it."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the broker's jars, data, config, log and pid live."""

    libs: Path
    home: Path

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def config(self) -> Path:
        return self.home / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.home / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "kafka.log"


def layout_for(settings: Settings) -> Layout:
    version = settings.kafka.kafka_version
    return Layout(
        libs=settings.cache_path / "kafka" / version / "libs",
        home=settings.state_path / "kafka",
    )


def _require(tool: str, what: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise KafkaError(
            f"`{tool}` was not found: install {what} (Debian: apt-get install {what}), "
            "or run Kafka with `docker compose up kafka` and set KAFKA_BOOTSTRAP_SERVERS."
        )
    return path


def fetch_jars(layout: Layout, version: str) -> Path:
    """Copy Kafka and its runtime dependencies from Maven Central into the cache, once."""
    marker = layout.libs / ".complete"
    if marker.exists():
        return layout.libs
    mvn = _require("mvn", "maven")
    _require("java", "openjdk-17-jre-headless")
    layout.libs.mkdir(parents=True, exist_ok=True)
    cmd = [
        mvn, "-q", "-B", "-f", str(OPS_KAFKA_DIR / "pom.xml"),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={layout.libs}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KafkaError(f"maven could not fetch the Kafka jars:\n{proc.stdout}\n{proc.stderr}")
    marker.write_text(version)
    return layout.libs


def _classpath(layout: Layout) -> str:
    return os.pathsep.join(str(p) for p in sorted(layout.libs.glob("*.jar")))


def _java_cmd(layout: Layout, settings: Settings, main: str, *args: str) -> list[str]:
    java = _require("java", "openjdk-17-jre-headless")
    return [
        java,
        *settings.kafka.heap.split(),
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={OPS_KAFKA_DIR / 'log4j2.properties'}",
        "-cp",
        _classpath(layout),
        main,
        *args,
    ]


def write_config(layout: Layout, settings: Settings) -> None:
    host, port = host_port(settings.kafka.bootstrap_servers)
    controller_port = port + 1
    # (SO_REUSEADDR, as the broker binds: a port a stopped broker left in TIME_WAIT is free)
    taken = port_taken(host, controller_port)
    if taken is not None:
        raise KafkaError(
            f"port {controller_port} (the local broker's controller listens on the bootstrap "
            f"port + 1): {taken}; choose another bootstrap port"
        )
    text = (OPS_KAFKA_DIR / "server.properties").read_text()
    text = text.replace("127.0.0.1:9092", f"{host}:{port}")
    text = text.replace("127.0.0.1:9093", f"{host}:{controller_port}")
    layout.home.mkdir(parents=True, exist_ok=True)
    layout.config.write_text(text + f"log.dirs={layout.data}\n")


def format_storage(layout: Layout, settings: Settings) -> None:
    """Format KRaft storage once (``StorageTool format … --standalone``)."""
    if (layout.data / "meta.properties").exists():
        return
    id_file = layout.home / CLUSTER_ID_FILE
    if not id_file.exists():
        out = subprocess.run(
            _java_cmd(layout, settings, "kafka.tools.StorageTool", "random-uuid"),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        id_file.write_text(out.stdout.strip().splitlines()[-1])
    cluster_id = id_file.read_text().strip()
    proc = subprocess.run(
        _java_cmd(layout, settings, "kafka.tools.StorageTool", "format",
                  "-t", cluster_id, "-c", str(layout.config), "--standalone"),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise KafkaError(f"formatting Kafka storage failed:\n{proc.stdout}\n{proc.stderr}")


def running_pid(layout: Layout) -> int | None:
    try:
        pid = int(layout.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


@dataclass(frozen=True, slots=True)
class Status:
    bootstrap: str
    external: bool
    reachable: bool
    pid: int | None

    def describe(self) -> str:
        if self.external:
            state = "reachable" if self.reachable else "NOT reachable"
            return f"external broker {self.bootstrap}: {state}"
        if self.pid and self.reachable:
            return f"local broker running (pid {self.pid}) on {self.bootstrap}"
        if self.reachable:
            return f"a broker not started by foretoken answers on {self.bootstrap}"
        if self.pid:
            return f"local broker process {self.pid} is up but {self.bootstrap} does not answer"
        return "no broker running"


def status(settings: Settings) -> Status:
    layout = layout_for(settings)
    bootstrap = settings.kafka.bootstrap_servers
    return Status(
        bootstrap=bootstrap,
        external=settings.kafka.external,
        reachable=accepts_connections(bootstrap),
        pid=None if settings.kafka.external else running_pid(layout),
    )


def up(settings: Settings) -> tuple[Status, bool]:
    """Start the local broker unless one answers already. Returns (status, started_now)."""
    bootstrap = settings.kafka.bootstrap_servers
    if settings.kafka.external or accepts_connections(bootstrap):
        return status(settings), False
    layout = layout_for(settings)
    if running_pid(layout) is not None:
        _wait_ready(layout, settings)
        return status(settings), False
    fetch_jars(layout, settings.kafka.kafka_version)
    write_config(layout, settings)
    format_storage(layout, settings)
    log = layout.log_file.open("ab")
    proc = subprocess.Popen(
        _java_cmd(layout, settings, "kafka.Kafka", str(layout.config)),
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    layout.pid_file.write_text(str(proc.pid))
    _wait_ready(layout, settings)
    return status(settings), True


def _wait_ready(layout: Layout, settings: Settings) -> None:
    deadline = time.monotonic() + settings.kafka.start_timeout_s
    while time.monotonic() < deadline:
        if accepts_connections(settings.kafka.bootstrap_servers):
            return
        if running_pid(layout) is None:
            tail = layout.log_file.read_text(errors="replace")[-3000:]
            raise KafkaError(f"the Kafka broker exited during start-up; its log ends:\n{tail}")
        time.sleep(POLL_S)
    tail = layout.log_file.read_text(errors="replace")[-4000:] if layout.log_file.exists() else ""
    raise KafkaError(
        f"the Kafka broker did not accept connections within {settings.kafka.start_timeout_s} s "
        f"(log: {layout.log_file}); its log ends:\n{tail}"
    )


def down(settings: Settings) -> bool:
    """Stop the local broker cleanly (SIGTERM, then SIGKILL after a grace period)."""
    if settings.kafka.external:
        return False
    layout = layout_for(settings)
    pid = running_pid(layout)
    if pid is None:
        layout.pid_file.unlink(missing_ok=True)
        return False
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and running_pid(layout) is not None:
        _reap(pid)
        time.sleep(POLL_S)
    if running_pid(layout) is not None:
        os.killpg(pid, signal.SIGKILL)
        _reap(pid)
    layout.pid_file.unlink(missing_ok=True)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
