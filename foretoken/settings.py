"""One typed settings object for every foretoken process (house rule 6).

Precedence, lowest first: the defaults (they work on a laptop), a TOML file named by
``FORETOKEN_CONFIG`` (or passed explicitly), then environment variables: the named ones of
``ENV_VARS`` (docker-compose.yml and the docs are checked against it by a test), and for
every other setting ``FORETOKEN__<SECTION>__<KEY>`` (double underscores between the parts
of its dotted path, e.g. ``FORETOKEN__PREDICTOR__EXPLORE_FRACTION=0.05`` or
``FORETOKEN__FITS__PREFILL__WINDOW=128``). The core's own configuration types (predictor,
fits, join, controls) are nested here as they are; the core never imports this module.

Errors name the key and where its value came from; an unknown key is an error, not a typo
silently ignored; cross-field rules are checked in :meth:`Settings.__post_init__`.
:func:`describe_settings` gives every effective value with its source
(``foretoken config show``). The sections of foretoken's own processes (Kafka, topics,
worker, router, route, ingest, dashboard, lake) are defined in
:mod:`foretoken.settings_sections` and imported from here.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from foretoken.core.cost.fit import FitConfig, RobustFitConfig
from foretoken.core.grading.join import JoinConfig
from foretoken.core.index.protocol import IndexConfig
from foretoken.core.routing.classes import ControlSettings, WorkloadClass
from foretoken.core.routing.config import PredictorConfig
from foretoken.settings_sections import (
    ROUTE_ENVELOPE_BYTES,
    DashboardSettings,
    IngestSettings,
    KafkaSettings,
    LakeSettings,
    RouterSettings,
    RouteSettings,
    TopicLayout,
    TopicNames,
    WorkerSettings,
    derived_route_body_bytes,
)

__all__ = [
    "ENV_VARS",
    "ControlSettings",
    "FitConfig",
    "JoinConfig",
    "PredictorConfig",
    "RobustFitConfig",
    "Settings",
    "SettingsError",
    "WorkloadClass",
    "describe_settings",
    "load_settings",
    "load_settings_with_sources",
]
GENERIC_ENV_PREFIX = "FORETOKEN__"
# A kv-events record's envelope and key next to its value (aiokafka counts both).
RECORD_OVERHEAD_BYTES = 16 * 1024


class SettingsError(ValueError):
    """A settings file or variable that cannot be used, with what is wrong in the message."""


# Which backend of the cache index the processor runs, and the cross-tier rule's bound
# (core.index.protocol.IndexConfig: backend "native" or "python").
IndexSettings = IndexConfig


class Settings(msgspec.Struct, kw_only=True, frozen=True):
    kafka: KafkaSettings = KafkaSettings()
    topics: TopicNames = TopicNames()
    topic_prefix: str = ""
    layout: TopicLayout = TopicLayout()
    worker: WorkerSettings = WorkerSettings()
    router: RouterSettings = RouterSettings()
    route: RouteSettings = RouteSettings()
    ingest: IngestSettings = IngestSettings()
    dashboard: DashboardSettings = DashboardSettings()
    lake: LakeSettings = LakeSettings()
    controls: ControlSettings = ControlSettings()
    # The route service's decisions, the fits of the cost models, the grading join's timings.
    predictor: PredictorConfig = msgspec.field(default_factory=PredictorConfig)
    fits: FitConfig = msgspec.field(default_factory=FitConfig)
    join: JoinConfig = msgspec.field(default_factory=JoinConfig)
    index: IndexConfig = IndexConfig()
    wire_format: Literal["json", "msgpack"] = "json"
    state_dir: str = "~/.local/state/foretoken"
    cache_dir: str = "~/.cache/foretoken"
    # Where the traces live (empty: the ones shipped in the repository, data/traces).
    traces_dir: str = ""
    # "model": kv-events, grants, outcomes, graded and workers are partitioned by a stable
    # hash of the model (the key stays the worker or request id), and route-role processors
    # sharing one consumer group each own the models of their partitions.
    sharding: Literal["none", "model"] = "none"

    def __post_init__(self) -> None:
        """Rules that span fields (each message names its keys)."""
        r, w = self.router, self.worker
        token = self.route.token
        if token != token.strip() or any(ord(c) < 32 or ord(c) == 127 for c in token):
            raise ValueError("route.token must not have surrounding whitespace or control "
                             "characters: HTTP strips them, no caller could match it")  # fmt: skip
        if not 0 < r.min_queue_wait_s <= r.max_queue_wait_s:
            raise ValueError(
                f"router.min_queue_wait_s ({r.min_queue_wait_s}) must be > 0 and <= "
                f"router.max_queue_wait_s ({r.max_queue_wait_s})"
            )
        if 4 * r.max_prompt_tokens + ROUTE_ENVELOPE_BYTES > r.max_body_bytes:
            raise ValueError(
                f"router.max_prompt_tokens ({r.max_prompt_tokens}) packed at 4 bytes a token "
                f"must fit router.max_body_bytes ({r.max_body_bytes}) with "
                f"{ROUTE_ENVELOPE_BYTES} bytes to spare: the route call carries the prompt"
            )
        if r.processes < 1 or r.body_read_timeout_s <= 0 or r.max_output_tokens < 1:
            raise ValueError("router.processes, router.body_read_timeout_s and "
                             "router.max_output_tokens must be positive")  # fmt: skip
        if not 0 < w.heartbeat_interval_s < w.session_timeout_s:
            raise ValueError(
                f"worker.heartbeat_interval_s ({w.heartbeat_interval_s}) must be > 0 and below "
                f"worker.session_timeout_s ({w.session_timeout_s})"
            )
        if self.join.expiry_interval_s >= self.predictor.outstanding_max_age_s:
            raise ValueError(
                f"join.expiry_interval_s ({self.join.expiry_interval_s}) must be below "
                f"predictor.outstanding_max_age_s ({self.predictor.outstanding_max_age_s})"
            )
        if self.layout.partitions < 1 or self.layout.replication_factor < 1:
            raise ValueError("layout.partitions and layout.replication_factor must be >= 1")
        if w.ready_lag_records < 0 or min(w.lag_interval_s, w.member_interval_s) <= 0:
            raise ValueError("worker.ready_lag_records must be >= 0, worker.lag_interval_s "
                             "and worker.member_interval_s > 0")  # fmt: skip
        if w.catch_up_horizon_s <= 0 or w.lagging_after_s <= 0:
            raise ValueError("worker.catch_up_horizon_s and worker.lagging_after_s must be > 0")
        if r.route_health_interval_s <= 0:
            raise ValueError("router.route_health_interval_s must be > 0")
        unknown = set(self.layout.compacted) - set(self.topics.__struct_fields__)
        if unknown:
            raise ValueError(f"layout.compacted names unknown topics: {sorted(unknown)}")
        self._check_limits()

    def _check_limits(self) -> None:
        i, route, kafka = self.ingest, self.route, self.kafka
        if i.max_record_bytes + RECORD_OVERHEAD_BYTES > kafka.max_request_bytes:
            raise ValueError(
                f"ingest.max_record_bytes ({i.max_record_bytes}) + {RECORD_OVERHEAD_BYTES} must "
                f"not exceed kafka.max_request_bytes ({kafka.max_request_bytes})"
            )
        if kafka.fetch_min_bytes < 1 or kafka.fetch_max_wait_ms < 0:
            raise ValueError("kafka.fetch_min_bytes must be >= 1, kafka.fetch_max_wait_ms >= 0")
        if min(i.max_message_bytes, i.receive_hwm, i.offload_bytes, i.max_undecodable_run) < 1:
            raise ValueError(
                "ingest.max_message_bytes, receive_hwm, offload_bytes and max_undecodable_run "
                "must be >= 1"
            )
        if not 0 < i.restart_backoff_s <= i.restart_backoff_max_s or i.backfill_timeout_s <= 0:
            raise ValueError(
                "need 0 < ingest.restart_backoff_s <= ingest.restart_backoff_max_s and "
                "ingest.backfill_timeout_s > 0"
            )
        if i.reconnect_grace_s <= 0:
            raise ValueError("ingest.reconnect_grace_s must be > 0")
        if min(route.max_prompt_tokens, route.max_output_tokens) < 1:
            raise ValueError("route.max_prompt_tokens and route.max_output_tokens must be >= 1")
        if route.max_prompt_tokens < self.router.max_prompt_tokens:
            raise ValueError(
                f"route.max_prompt_tokens ({route.max_prompt_tokens}) must be at least "
                f"router.max_prompt_tokens ({self.router.max_prompt_tokens}): the route service "
                "must take every prompt the router accepts"
            )
        derived = derived_route_body_bytes(route.max_prompt_tokens)
        if route.max_body_bytes and route.max_body_bytes < derived:
            raise ValueError(
                f"route.max_body_bytes ({route.max_body_bytes}) must hold a prompt of "
                f"route.max_prompt_tokens ({route.max_prompt_tokens}): at least {derived} "
                "(or 0 to derive it)"
            )
        if route.read_timeout_s <= 0 or route.offload_bytes < 1:
            raise ValueError("route.read_timeout_s must be > 0 and route.offload_bytes >= 1")

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
    def route_urls(self) -> list[str]:
        """The route services a router asks (``router.route_urls``, else the one)."""
        urls = [u.rstrip("/") for u in self.router.route_urls if u]
        return urls or [self.route_url]

    @property
    def instance_id(self) -> str:
        import socket

        return self.worker.instance_id or f"{socket.gethostname()}-{self.worker.web_port}"

    @property
    def advertise_url(self) -> str:
        if self.worker.advertise_url:
            return self.worker.advertise_url.rstrip("/")
        host = self.worker.web_host if self.worker.web_host != "0.0.0.0" else "127.0.0.1"
        return f"http://{host}:{self.worker.web_port}"

    @property
    def group_id(self) -> str:
        """The processor's consumer group (and Faust app id): the primary's is the app id;
        a route replica has one of its own, route instances sharded by model share one."""
        if self.worker.role == "primary":
            return self.worker.app_id
        if self.sharding == "model":
            return f"{self.worker.app_id}-route"
        return f"{self.worker.app_id}-route-{self.instance_id}"

    @property
    def snapshot_path(self) -> Path:
        """The directory of the primary's snapshots (index + offsets, fits)."""
        if self.worker.snapshot_dir:
            return Path(self.worker.snapshot_dir).expanduser().resolve()
        if self.worker.role == "primary":
            return self.worker_data_path
        return (self.state_path / "worker" / self.worker.app_id).resolve()

    @property
    def binds_loopback_only(self) -> bool:
        """Whether the processor's web server listens on a loopback address only."""
        return is_loopback(self.worker.web_host)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()

    @property
    def worker_data_path(self) -> Path:
        """The worker's data directory (snapshots, Faust's files), absolute."""
        if self.worker.data_dir:
            return Path(self.worker.data_dir).expanduser().resolve()
        if self.worker.role == "route":  # one per process, also when shards share a group
            name = f"{self.worker.app_id}-route-{self.instance_id}"
            return (self.state_path / "worker" / name).resolve()
        return (self.state_path / "worker" / self.worker.app_id).resolve()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1; anything else (0.0.0.0, a name, an address) is not."""
    import ipaddress

    if host.strip().lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    "FORETOKEN_ROUTE_URLS": "router.route_urls",
    "FORETOKEN_ROUTE_MEMBERS": "router.route_members",
    "FORETOKEN_ROLE": "worker.role",
    "FORETOKEN_INSTANCE_ID": "worker.instance_id",
    "FORETOKEN_ADVERTISE_URL": "worker.advertise_url",
    "FORETOKEN_SNAPSHOT_DIR": "worker.snapshot_dir",
    "FORETOKEN_READY_LAG_RECORDS": "worker.ready_lag_records",
    "FORETOKEN_CATCH_UP_HORIZON_S": "worker.catch_up_horizon_s",
    "FORETOKEN_SHARDING": "sharding",
    "FORETOKEN_ROUTER_PROCESSES": "router.processes",
    "FORETOKEN_ROUTER_MAX_BODY_BYTES": "router.max_body_bytes",
    "FORETOKEN_ROUTER_API_KEYS_FILE": "router.api_keys_file",
    "FORETOKEN_ROUTE_TOKEN": "route.token",
    "FORETOKEN_INGEST_HOST": "ingest.host",
    "FORETOKEN_INGEST_PORT": "ingest.port",
    "FORETOKEN_DASHBOARD_HOST": "dashboard.host",
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
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SettingsError(f"setting {dotted}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flatten(value, path) if isinstance(value, dict) else {path: value})
    return out


def _fields_of(kind: Any) -> dict[str, Any] | None:
    """Field name → type of a Struct or dataclass; None for anything else."""
    import dataclasses
    import typing

    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        hints = typing.get_type_hints(kind)
        return {f: hints[f] for f in kind.__struct_fields__}
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return {f.name: hints[f.name] for f in dataclasses.fields(kind)}
    return None


def _check_known(tree: dict[str, Any], kind: Any, prefix: str = "") -> None:
    """Every key of ``tree`` names a field of ``kind`` (recursively): a typo is an error."""
    import typing

    fields = _fields_of(kind)
    if fields is None:
        return
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise SettingsError(f"unknown setting {path!r} (known: {', '.join(sorted(fields))})")
        sub = fields[key]
        if typing.get_origin(sub) is dict and isinstance(value, dict):
            _, item = typing.get_args(sub)
            for name, entry in value.items():
                if isinstance(entry, dict):
                    _check_known(entry, item, f"{path}.{name}.")
        elif isinstance(value, dict):
            _check_known(value, sub, f"{path}.")


def _field_type(dotted: str) -> Any:
    """The type of the setting at ``dotted`` (None: no such setting)."""
    kind: Any = Settings
    for part in dotted.split("."):
        fields = _fields_of(kind)
        if fields is None or part not in fields:
            return None
        kind = fields[part]
    return kind


def _is_field(dotted: str) -> bool:
    return _field_type(dotted) is not None


def _env_value(dotted: str, value: str) -> Any:
    """A variable's text as the setting takes it: a list setting is comma-separated."""
    import typing

    kind = _field_type(dotted)
    if kind is None:
        return value
    if typing.get_origin(kind) in (tuple, list):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _generic_env(env: Mapping[str, str]) -> dict[str, str]:
    """``FORETOKEN__A__B=value`` → ``{"a.b": value}`` (every setting has such a variable)."""
    out: dict[str, str] = {}
    for var, value in env.items():
        if var.startswith(GENERIC_ENV_PREFIX) and value != "":
            parts = var[len(GENERIC_ENV_PREFIX) :].lower().split("__")
            if all(parts):
                out[".".join(parts)] = value
    return out


def _error_path(exc: msgspec.ValidationError) -> str | None:
    text = str(exc)
    marker = " - at `$."
    if marker in text:
        return text.rsplit(marker, 1)[1].rstrip("`").split("[")[0]
    return None


def load_settings_with_sources(
    path: str | Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[Settings, dict[str, str]]:
    """The settings and, per dotted key set by a file or the environment, where it came
    from (``"file <path>"`` or ``"env <VAR>"``); every other key is a default."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file = path or env.get("FORETOKEN_CONFIG")
    if file:
        try:
            tree = tomllib.loads(Path(file).read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read settings file {file}: {exc}") from exc
        sources.update(dict.fromkeys(_flatten(tree), f"file {file}"))
    for dotted, value in _generic_env(env).items():
        _set_path(tree, dotted, _env_value(dotted, value))
        sources[dotted] = f"env {GENERIC_ENV_PREFIX}{dotted.upper().replace('.', '__')}"
    for var, dotted in ENV_VARS.items():
        if env.get(var):
            _set_path(tree, dotted, _env_value(dotted, env[var]))
            sources[dotted] = f"env {var}"
    if env.get("KAFKA_BOOTSTRAP_SERVERS"):
        _set_path(tree, "kafka.external", True)
        sources["kafka.external"] = "env KAFKA_BOOTSTRAP_SERVERS"
    _check_known(tree, Settings)
    try:
        return msgspec.convert(tree, Settings, strict=False), sources
    except msgspec.ValidationError as exc:
        where = _error_path(exc)
        named = str(exc).split(" ", 1)[0]  # a section's own check names its field first
        if where and _is_field(f"{where}.{named}"):
            where = f"{where}.{named}"
        origin = next((src for key, src in sources.items() if where and key.startswith(where)),
                      None)  # fmt: skip
        suffix = f" (from {origin})" if origin else ""
        what = f"invalid setting {where}" if where else "invalid settings"
        raise SettingsError(f"{what}: {exc}{suffix}") from exc
    except ValueError as exc:  # cross-field rules
        raise SettingsError(f"invalid settings: {exc}") from exc


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from defaults, an optional TOML file, and the environment."""
    return load_settings_with_sources(path, env)[0]


def describe_settings(settings: Settings, sources: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """Every effective setting as (dotted key, value, source), sorted by key."""
    flat = _flatten(msgspec.to_builtins(settings))
    rows = []
    for key in sorted(flat):
        source = sources.get(key) or next(
            (src for k, src in sources.items() if key.startswith(k + ".")), "default"
        )
        rows.append((key, flat[key], source))
    return rows
