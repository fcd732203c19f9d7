"""The sections of the settings for foretoken's own processes and parts: Kafka, topics,
the processor (worker), the router, the route service, ingest, the dashboard and the lake.

Plain frozen Structs with their defaults (the comments say what each key does);
:class:`foretoken.settings.Settings` nests them, checks the rules that span them, and is
where every other module imports them from (``from foretoken.settings import ...``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# What a route call holds besides the packed prompt (ids, bound, class...), at most.
ROUTE_ENVELOPE_BYTES = 64 * 1024
# Ranges checked when the settings are read (a file, the environment): an interval of 0
# spun a timer at full speed, a NaN timeout disabled it, a port of 70000 failed deep in a
# library. The error names the key and where its value came from.
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]  # an interval or a timeout
Duration = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # 0 allowed
Signed = Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)]  # finite; < 0 switches it off
Positive = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Retention = Annotated[int, msgspec.Meta(ge=-1)]  # Kafka's -1: keep for ever


class KafkaSettings(msgspec.Struct, kw_only=True, frozen=True):
    # When set (KAFKA_BOOTSTRAP_SERVERS), that broker is used and no local one is managed.
    bootstrap_servers: str = "127.0.0.1:9092"
    external: bool = False
    kafka_version: str = "4.1.1"
    # 512m ran out with ~15,000 partitions (topics of many test runs accumulated in one
    # broker); the heap is committed only as it is used.
    heap: str = "-Xms256m -Xmx1g"
    start_timeout_s: Seconds = 240.0
    # Every service waits this long at start for its topics to exist and have leaders
    # (streams/readiness.py), then stops with an error naming what it waited for.
    startup_timeout_s: Seconds = 60.0
    # The producers' largest request (aiokafka max_request_size; the broker's default
    # message.max.bytes is about the same): a bigger record is refused at send time.
    max_request_bytes: Positive = 1_048_576
    # The processor's consumer: the broker answers a fetch once it has fetch_min_bytes or
    # fetch_max_wait_ms has passed (Faust's values by default: a fetch for every few records
    # under load). 65536 / 10 cut a busy route replica's CPU per request, but an idle
    # consumer then polls every 10 ms (5.9% of a core idle against 1.1%): docs/BENCHMARKS.md.
    fetch_min_bytes: Positive = 1
    fetch_max_wait_ms: Count = 1500


class TopicNames(msgspec.Struct, kw_only=True, frozen=True):
    workers: str = "workers"
    kv_events: str = "kv-events"
    grants: str = "grants"
    outcomes: str = "outcomes"
    graded: str = "graded"
    dead_letter: str = "dead-letter"
    controls: str = "controls"
    # Who runs where (compacted, keyed by instance id): each processor's role, URL, owned
    # partitions and readiness (adapters/kafka/members.py); routers may discover from it.
    members: str = "members"


class TopicLayout(msgspec.Struct, kw_only=True, frozen=True):
    partitions: Positive = 4
    replication_factor: Positive = 1
    # Compacted topics keep the newest record per key forever (worker registrations).
    compacted: tuple[str, ...] = ("workers", "members")
    retention_ms: Retention = 24 * 3600 * 1000


class WorkerSettings(msgspec.Struct, kw_only=True, frozen=True):
    # "primary": the processor (route service, grading join, lake sink, snapshots, controls
    # events); "route": a read replica answering /v1/route from the same state, emitting
    # nothing (docs/ARCHITECTURE.md "Scale-out").
    role: Literal["primary", "route"] = "primary"
    app_id: str = "foretoken"
    web_host: str = "127.0.0.1"
    web_port: Port = 6066
    # Snapshots (index, fits) and Faust's own files; empty = <state_dir>/worker/<app_id>.
    # A relative path is taken from the working directory; parents are created.
    data_dir: str = ""
    # Create missing topics at start (the local default); false = only wait for them.
    create_topics: bool = True
    log_level: Literal["crit", "error", "warn", "info", "debug"] = "warn"
    # The event loop Faust runs on: uvloop (libuv: the socket reads and writes of the route
    # page and the Kafka clients in C) or Python's own asyncio loop.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # The cache index is snapshotted this often (plus on a clean stop).
    snapshot_interval_s: Seconds = 10.0
    # Kafka consumer-group session: how long a killed worker's partitions stay assigned.
    session_timeout_s: Seconds = 10.0
    heartbeat_interval_s: Seconds = 3.0
    # Approximate cache mode (engines without KV events, predictor/approx.py): a routed
    # prompt counts as cached this long after it was last served, and at most this many
    # tokens per worker when its registration gives no gpu_blocks.
    approx_cache_ttl_s: Seconds = 300.0
    approx_cache_default_tokens: Count = 65_536
    # This process among the members (its route replica's consumer group, its members
    # record); empty = <host>-<web_port>.
    instance_id: str = ""
    # The URL others reach this processor at (members record, forwarding); empty =
    # http://<web_host or 127.0.0.1>:<web_port>.
    advertise_url: str = ""
    # Where the primary writes its snapshots (index + offsets, fits) and route replicas
    # read the latest one; empty = the primary's data directory (for a replica: the default
    # one, <state_dir>/worker/<app_id>).
    snapshot_dir: str = ""
    # A route replica is ready (/healthz 200) once every input topic's lag (records between
    # what it applied and the end of its partitions) is at most this.
    ready_lag_records: Count = 500
    # Past readiness, it reports "lagging" (503) when the lag stays above the bound this long.
    lagging_after_s: Seconds = 10.0
    # How often the lag (end offsets) is measured.
    lag_interval_s: Seconds = 0.5
    # A replica replays grants and outcomes from this far back (Kafka offsets for times), so
    # that the requests still in flight are in its queue models.
    catch_up_horizon_s: Duration = 300.0
    # The members record is refreshed this often; one older than 3 intervals is gone.
    member_interval_s: Seconds = 1.0
    # This long after start, what the started processor holds is frozen out of the garbage
    # collector's full passes (foretoken.adapters.heap); negative: never.
    freeze_heap_after_s: Signed = 5.0


class RouterSettings(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    # The route service (on the Faust worker); empty = the worker's own web address.
    route_url: str = ""
    # Several route services (read replicas, shards): each request goes to a ready one,
    # fails over to the next within route_timeout_s, then to the fallback policy
    # (adapters/http/route_client.py). Empty = route_url alone.
    route_urls: tuple[str, ...] = ()
    # Also discover route services from the members topic (role route, ready, alive).
    route_members: bool = False
    # How often each route service's /healthz is checked.
    route_health_interval_s: Seconds = 1.0
    # Past this the router decides alone (fallback policy) and marks the grant `fallback`.
    route_timeout_s: Seconds = 0.25
    # After a failed route call, use the fallback for this long before asking again.
    route_retry_after_failure_s: Duration = 0.5
    # The longest an engine may stay silent: to connect, before its first token, or between
    # two reads of its stream (an idle timeout: a long answer that keeps coming is not cut).
    engine_timeout_s: Seconds = 600.0
    # An engine that did not answer at all (connection refused, or silent that long) gets no
    # request from this router for this long: a grant for it is replaced by the fallback's
    # among the others (a dead engine looks idle, and an idle engine attracts work).
    engine_down_s: Duration = 5.0
    # Request bodies: the largest the router reads (413 past it; the route service takes the
    # same limit), and how long one may take to arrive (408 after).
    max_body_bytes: Positive = 32 * 1024 * 1024
    body_read_timeout_s: Seconds = 30.0
    # Prompts over this many tokens get a 400; 4 bytes a token in the route call, so it must
    # fit router.max_body_bytes (checked). max_tokens / max_completion_tokens at most this.
    max_prompt_tokens: Positive = 2 * 1024 * 1024
    max_output_tokens: Positive = 1024 * 1024
    # A /v1/completions prompt that is a batch (a list of prompts): each prompt is routed,
    # measured and graded as its own request; more prompts than this in one body get a 400.
    max_batch_prompts: Positive = 256
    # Bodies of at least this many bytes are decoded, and texts of at least this many
    # characters tokenized, in a worker thread instead of on the event loop.
    decode_off_loop_bytes: Count = 1024 * 1024
    tokenize_off_loop_chars: Count = 32_768
    # Request headers passed on to the engine (case-insensitive), e.g. add "x-api-key" or
    # "openai-organization" for engines that check them.
    # (x-request-id is always the router's own id of the request: listing it changes nothing)
    forward_headers: tuple[str, ...] = ("authorization", "traceparent")
    # When set, /v1/* needs one of these keys (Authorization: Bearer KEY, or x-api-key: KEY);
    # api_keys_file: one key per line (kept out of the settings file and the environment).
    api_keys: tuple[str, ...] = ()
    api_keys_file: str = ""
    # Browser origins allowed to call the router (CORS; "*" for any); none by default.
    cors_origins: tuple[str, ...] = ()
    # Router processes on one port (SO_REUSEPORT); each has its own connections and buffer.
    processes: Positive = 1
    min_queue_wait_s: Seconds = 5.0
    max_queue_wait_s: Seconds = 300.0
    # Grants/outcomes waiting for Kafka; past this, new ones are dropped and counted.
    publish_buffer: Positive = 100_000
    # Fallback policy: answer 429 when every worker has this many prompt tokens outstanding.
    fallback_overload_tokens: Count = 2_000_000
    fallback_retry_after_s: Duration = 1.0
    # model -> path of a Hugging Face tokenizer.json; other models use the built-in one.
    tokenizers: dict[str, str] = {}
    # model -> its chat template (Jinja, or JSON holding chat_template); default: the engines
    # file's, else the one beside the model's tokenizer.json.
    chat_templates: dict[str, str] = {}


class IngestSettings(msgspec.Struct, kw_only=True, frozen=True):
    """``foretoken ingest``: engines' ZMQ KV events to ``kv-events`` (adapters/engines)."""

    # Its HTTP page (/healthz: every engine's listener; /metrics); port 0 = no page.
    host: str = "127.0.0.1"
    port: Port = 6068
    # ZMQ_MAXMSGSIZE of every SUB and replay socket: ZMQ drops a bigger message (and the
    # connection it came on; the sequence gap is then repaired through replay, or reset).
    max_message_bytes: Positive = 16 * 1024 * 1024
    # ZMQ_RCVHWM: messages queued per socket before ZMQ drops (a gap, repaired or reset).
    receive_hwm: Count = 1000
    # A kv-events record bigger than this is split into several records of the same seq
    # (events, and the block hashes of one event, in order); below kafka.max_request_bytes.
    max_record_bytes: Positive = 900 * 1024
    # Payloads and batches bigger than this are decoded / encoded off the event loop.
    offload_bytes: Count = 256 * 1024
    # An undecodable batch at the expected seq is taken as lost (not a reset); more than
    # this many in a row (no decodable one between) reset the worker's index.
    max_undecodable_run: Count = 16
    # How long the engine's replay socket may take per reply while a gap is repaired.
    backfill_timeout_s: Seconds = 2.0
    # A disconnect that ZMQ does not follow with a reconnect attempt within this long (a
    # protocol error, e.g. an oversized message) gets a new socket.
    reconnect_grace_s: Duration = 1.0
    # A listener that dies is restarted after this, doubling up to the max.
    restart_backoff_s: Seconds = 0.5
    restart_backoff_max_s: Seconds = 30.0


class RouteSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The route service (``POST /v1/route`` on the processor): who may call it, and the
    limits its requests are decoded with (a violation is a 4xx naming the field)."""

    # Shared token: when set, POST /v1/route and POST /v1/cache need it in header
    # x-foretoken-route-token; the processor refuses to start on a web_host that is not
    # loopback without one. The router sends it.
    token: str = ""
    # The longest prompt (token ids or prompt_tokens) a route request may carry.
    max_prompt_tokens: Positive = 2_097_152
    # expected_output_tokens (the request's max_tokens) within 1..this.
    max_output_tokens: Positive = 1_048_576
    # Largest body; 0 = derived from max_prompt_tokens (packed 32-bit ids, base64 in JSON).
    max_body_bytes: Count = 0
    # The whole body must arrive within this long (else 408).
    read_timeout_s: Seconds = 10.0
    # Bodies bigger than this are decoded off the event loop.
    offload_bytes: Count = 1_048_576

    @property
    def body_limit(self) -> int:
        """The body size accepted: a prompt of ``max_prompt_tokens`` always fits."""
        return self.max_body_bytes or derived_route_body_bytes(self.max_prompt_tokens)


def derived_route_body_bytes(max_prompt_tokens: int) -> int:
    """Packed ids take 4 bytes a token, 4/3 of that as base64 in JSON, plus the fields."""
    return -(-16 * max_prompt_tokens // 3) + ROUTE_ENVELOPE_BYTES


class DashboardSettings(msgspec.Struct, kw_only=True, frozen=True):
    """``foretoken dashboard`` (Streamlit)."""

    host: str = "127.0.0.1"


class LakeSettings(msgspec.Struct, kw_only=True, frozen=True):
    """The worker's sink of ``graded`` into the Parquet lake (``streams/lake_sink.py``)."""

    # The lake's directory; empty = no sink (the worker still grades onto the topic).
    dir: str = ""
    # A batch is written (one file per hour touched) at this many records or after this long.
    batch_records: Positive = 5_000
    batch_s: Seconds = 1.0
    # Hours closed for this long are compacted to one file, checked this often.
    compact_interval_s: Seconds = 60.0
    compact_after_s: Signed = 300.0
