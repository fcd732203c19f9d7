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
    # Every service waits this long at start for its topics to exist and have leaders
    # (streams/readiness.py), then stops with an error naming what it waited for.
    startup_timeout_s: float = 60.0


class TopicNames(msgspec.Struct, kw_only=True, frozen=True):
    workers: str = "workers"
    kv_events: str = "kv-events"
    grants: str = "grants"
    outcomes: str = "outcomes"
    graded: str = "graded"
    dead_letter: str = "dead-letter"
    controls: str = "controls"


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
    # Snapshots (index, fits) and Faust's own files; empty = <state_dir>/worker/<app_id>.
    # A relative path is taken from the working directory; parents are created.
    data_dir: str = ""
    # Create missing topics at start (the local default); false = only wait for them.
    create_topics: bool = True
    log_level: Literal["crit", "error", "warn", "info", "debug"] = "warn"
    # The cache index is snapshotted this often (plus on a clean stop).
    snapshot_interval_s: float = 10.0
    # Kafka consumer-group session: how long a killed worker's partitions stay assigned.
    session_timeout_s: float = 10.0
    heartbeat_interval_s: float = 3.0
    # Approximate cache mode (engines without KV events, predictor/approx.py): a routed
    # prompt counts as cached this long after it was last served, and at most this many
    # tokens per worker when its registration gives no gpu_blocks.
    approx_cache_ttl_s: float = 300.0
    approx_cache_default_tokens: int = 65_536


class RouterSettings(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # The route service (on the Faust worker); empty = the worker's own web address.
    route_url: str = ""
    # Past this the router decides alone (fallback policy) and marks the grant `fallback`.
    route_timeout_s: float = 0.25
    # After a failed route call, use the fallback for this long before asking again.
    route_retry_after_failure_s: float = 0.5
    engine_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024
    min_queue_wait_s: float = 5.0
    max_queue_wait_s: float = 300.0
    # Grants/outcomes waiting for Kafka; past this, new ones are dropped and counted.
    publish_buffer: int = 100_000
    # Fallback policy: answer 429 when every worker has this many prompt tokens outstanding.
    fallback_overload_tokens: int = 2_000_000
    fallback_retry_after_s: float = 1.0
    # model -> path of a Hugging Face tokenizer.json; other models use the built-in one.
    tokenizers: dict[str, str] = {}


class LakeSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The worker's sink of ``graded`` into the Parquet lake (``streams/lake_sink.py``)."""

    # The lake's directory; empty = no sink (the worker still grades onto the topic).
    dir: str = ""
    # A batch is written (one file per hour touched) at this many records or after this long.
    batch_records: int = 5_000
    batch_s: float = 1.0
    # Hours closed for this long are compacted to one file, checked this often.
    compact_interval_s: float = 60.0
    compact_after_s: float = 300.0


class WorkloadClass(msgspec.Struct, kw_only=True, frozen=True):
    """A workload class (issue #8): its TTFT objective at a percentile, the latency it
    expects outside the queue (own prefill, network) and a safety margin give its
    queue-time budget; plus the bound its requests get by default, and its priority."""

    objective_ttft_s: float = 30.0
    percentile: float = 95.0
    non_queue_latency_s: float = 2.0
    margin_s: float = 1.0
    # Applied when a request of this class names no max_queue_wait_s (None: no bound).
    max_queue_wait_s: float | None = None
    # Higher = more important; admission control rejects lower priorities first.
    priority: int = 0
    # Protected classes are never rejected by the admission control of the latency controls.
    protected: bool = False

    def __post_init__(self) -> None:
        if not 50.0 <= self.percentile < 100.0:
            raise ValueError(f"percentile must be within [50, 100), got {self.percentile}")
        if self.queue_budget_s <= 0:
            raise ValueError(
                f"objective_ttft_s ({self.objective_ttft_s}) leaves no queue-time budget "
                f"after non_queue_latency_s + margin_s"
            )

    @property
    def queue_budget_s(self) -> float:
        """objective − non-queue latency − margin: what the queue may take at the tail."""
        return self.objective_ttft_s - self.non_queue_latency_s - self.margin_s


class ControlSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The staged latency controls (``predictor/controls.py``); thresholds are fractions of
    each class's queue budget."""

    enabled: bool = True
    default_class: str = "default"
    classes: dict[str, WorkloadClass] = msgspec.field(
        default_factory=lambda: {"default": WorkloadClass()}
    )
    window_s: float = 60.0
    min_samples: int = 20
    warn_fraction: float = 0.5
    reroute_fraction: float = 0.75
    admission_fraction: float = 1.0
    # A stage is left when the tail stays below this fraction of its threshold (hysteresis).
    recovery_fraction: float = 0.7
    # A breach (or a recovery) must last this long before the stage changes.
    breach_s: float = 10.0
    recovery_s: float = 20.0
    evaluate_every_s: float = 1.0
    # Reroute and admission need pressure on the worker: at least this many prompt tokens
    # queued there at some point in the window (or arrivals > first tokens, or timeouts).
    corroborating_queue_tokens: int = 8192
    # Retry-After of a request turned away by admission control.
    admission_retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not among the classes")
        if not 0 < self.warn_fraction <= self.reroute_fraction <= self.admission_fraction:
            raise ValueError("need 0 < warn_fraction <= reroute_fraction <= admission_fraction")
        if not 0 < self.recovery_fraction < 1:
            raise ValueError("recovery_fraction must be within (0, 1)")
        if self.window_s <= 0 or self.min_samples < 1:
            raise ValueError("window_s must be > 0 and min_samples >= 1")

    def workload_class(self, name: str | None) -> tuple[str, WorkloadClass]:
        """The class of that name; unknown or empty names fall back to the default class."""
        if name and name in self.classes:
            return name, self.classes[name]
        return self.default_class, self.classes[self.default_class]


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    kafka: KafkaSettings = KafkaSettings()
    topics: TopicNames = TopicNames()
    topic_prefix: str = ""
    layout: TopicLayout = TopicLayout()
    worker: WorkerSettings = WorkerSettings()
    router: RouterSettings = RouterSettings()
    lake: LakeSettings = LakeSettings()
    controls: ControlSettings = ControlSettings()
    wire_format: Literal["json", "msgpack"] = "json"
    state_dir: str = "~/.local/state/foretoken"
    cache_dir: str = "~/.cache/foretoken"
    # Where the traces live (empty: the ones shipped in the repository, data/traces).
    traces_dir: str = ""

    def topic(self, name: str) -> str:
        """The full topic name for a logical topic (``kv_events`` → ``<prefix>kv-events``)."""
        return self.topic_prefix + getattr(self.topics, name)

    def all_topics(self) -> dict[str, str]:
        """Logical name → full topic name, for every topic of PRODUCT.md §2."""
        return {field: self.topic(field) for field in self.topics.__struct_fields__}

    @property
    def route_url(self) -> str:
        if self.router.route_url:
            return self.router.route_url.rstrip("/")
        host = self.worker.web_host if self.worker.web_host != "0.0.0.0" else "127.0.0.1"
        return f"http://{host}:{self.worker.web_port}"

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()

    @property
    def worker_data_path(self) -> Path:
        """The worker's data directory (snapshots, Faust's files), absolute."""
        if self.worker.data_dir:
            return Path(self.worker.data_dir).expanduser().resolve()
        return (self.state_path / "worker" / self.worker.app_id).resolve()

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
    "FORETOKEN_CREATE_TOPICS": "worker.create_topics",
    "FORETOKEN_STARTUP_TIMEOUT_S": "kafka.startup_timeout_s",
    "FORETOKEN_LOG_LEVEL": "worker.log_level",
    "FORETOKEN_SNAPSHOT_INTERVAL_S": "worker.snapshot_interval_s",
    "FORETOKEN_WIRE_FORMAT": "wire_format",
    "FORETOKEN_ROUTER_HOST": "router.host",
    "FORETOKEN_ROUTER_PORT": "router.port",
    "FORETOKEN_ROUTE_URL": "router.route_url",
    "FORETOKEN_ROUTE_TIMEOUT_S": "router.route_timeout_s",
    "FORETOKEN_STATE_DIR": "state_dir",
    "FORETOKEN_CACHE_DIR": "cache_dir",
    "FORETOKEN_TRACES_DIR": "traces_dir",
    "FORETOKEN_LAKE_DIR": "lake.dir",
    "FORETOKEN_LAKE_BATCH_RECORDS": "lake.batch_records",
    "FORETOKEN_LAKE_BATCH_S": "lake.batch_s",
    "FORETOKEN_LAKE_COMPACT_INTERVAL_S": "lake.compact_interval_s",
    "FORETOKEN_LAKE_COMPACT_AFTER_S": "lake.compact_after_s",
    "FORETOKEN_CONTROLS_ENABLED": "controls.enabled",
    "FORETOKEN_DEFAULT_WORKLOAD_CLASS": "controls.default_class",
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
    except (msgspec.ValidationError, ValueError) as exc:
        raise SettingsError(f"invalid settings: {exc}") from exc
