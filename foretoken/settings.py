"""One typed settings object for every foretoken process (house rule 6).

Precedence, lowest first: the defaults below (they work on a laptop), a TOML file named by
``FORETOKEN_CONFIG`` (or passed explicitly), then environment variables. Every environment
variable is listed in ``ENV_VARS`` so that docker-compose.yml and the docs can be checked
against it by a test.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec


class SettingsError(ValueError):
    """A settings file or variable that cannot be used, with what is wrong in the message."""


class KafkaSettings(msgspec.Struct, kw_only=True, frozen=True):
    # When set (KAFKA_BOOTSTRAP_SERVERS), that broker is used and no local one is managed.
    bootstrap_servers: str = "127.0.0.1:9092"
    external: bool = False
    kafka_version: str = "4.1.1"
    heap: str = "-Xms256m -Xmx512m"
    start_timeout_s: float = 90.0


class TopicNames(msgspec.Struct, kw_only=True, frozen=True):
    workers: str = "workers"
    kv_events: str = "kv-events"
    grants: str = "grants"
    outcomes: str = "outcomes"
    graded: str = "graded"
    dead_letter: str = "dead-letter"


class TopicLayout(msgspec.Struct, kw_only=True, frozen=True):
    partitions: int = 4
    replication_factor: int = 1
    # Compacted topics keep the newest record per key forever (worker registrations).
    compacted: tuple[str, ...] = ("workers",)
    retention_ms: int = 24 * 3600 * 1000


class WorkerSettings(msgspec.Struct, kw_only=True, frozen=True):
    app_id: str = "foretoken"
    web_host: str = "127.0.0.1"
    web_port: int = 6066
    data_dir: str = ".run/worker"
    log_level: Literal["crit", "error", "warn", "info", "debug"] = "warn"


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    kafka: KafkaSettings = KafkaSettings()
    topics: TopicNames = TopicNames()
    topic_prefix: str = ""
    layout: TopicLayout = TopicLayout()
    worker: WorkerSettings = WorkerSettings()
    wire_format: Literal["json", "msgpack"] = "json"
    state_dir: str = "~/.local/state/foretoken"
    cache_dir: str = "~/.cache/foretoken"

    def topic(self, name: str) -> str:
        """The full topic name for a logical topic (``kv_events`` → ``<prefix>kv-events``)."""
        return self.topic_prefix + getattr(self.topics, name)

    def all_topics(self) -> dict[str, str]:
        """Logical name → full topic name, for every topic of PRODUCT.md §2."""
        return {field: self.topic(field) for field in self.topics.__struct_fields__}

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


# Environment variable → dotted settings path. The single list of every variable we read.
ENV_VARS: dict[str, str] = {
    "KAFKA_BOOTSTRAP_SERVERS": "kafka.bootstrap_servers",
    "FORETOKEN_KAFKA_VERSION": "kafka.kafka_version",
    "FORETOKEN_KAFKA_HEAP": "kafka.heap",
    "FORETOKEN_TOPIC_PREFIX": "topic_prefix",
    "FORETOKEN_PARTITIONS": "layout.partitions",
    "FORETOKEN_APP_ID": "worker.app_id",
    "FORETOKEN_WEB_HOST": "worker.web_host",
    "FORETOKEN_WEB_PORT": "worker.web_port",
    "FORETOKEN_WORKER_DATA_DIR": "worker.data_dir",
    "FORETOKEN_LOG_LEVEL": "worker.log_level",
    "FORETOKEN_WIRE_FORMAT": "wire_format",
    "FORETOKEN_STATE_DIR": "state_dir",
    "FORETOKEN_CACHE_DIR": "cache_dir",
}


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from defaults, an optional TOML file, and the environment."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    file = path or env.get("FORETOKEN_CONFIG")
    if file:
        try:
            tree = tomllib.loads(Path(file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read settings file {file}: {exc}") from exc
    for var, dotted in ENV_VARS.items():
        if env.get(var):
            _set_path(tree, dotted, env[var])
    if env.get("KAFKA_BOOTSTRAP_SERVERS"):
        _set_path(tree, "kafka.external", True)
    try:
        return msgspec.convert(tree, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid settings: {exc}") from exc
