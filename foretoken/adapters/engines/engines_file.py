"""The engines config file: which engines foretoken listens to, and what they report.

TOML, one ``[[engines]]`` table each::

    [[engines]]
    worker_id = "w0"
    model = "kimi-sim"
    engine = "vllm"            # vllm | sglang | llamacpp
    engine_version = "0.11.0"
    tokenizer = "/path/tokenizer.json"   # optional: how the router counts this model's tokens
    chat_template = "/path/template.jinja"   # optional: default, the one beside the tokenizer
    lora_adapters = ["sql-lora"]   # optional: LoRA adapters it serves (clients name them as model)
    block_size = 16
    http_url = "http://127.0.0.1:8101"
    kv_events_url = "tcp://127.0.0.1:5557"   # absent (or kv_events = false): no KV events
    replay_url = "tcp://127.0.0.1:5558"
    metrics_url = "http://127.0.0.1:8101/metrics"
    tiers = ["GPU", "CPU"]
    eagle = false
    [engines.scheduler]
    max_num_batched_tokens = 8192
    max_num_seqs = 256
    long_prefill_token_threshold = 0

Each engine becomes a ``WorkerRegistration`` on the ``workers`` topic.

A serial engine (llama.cpp: one request at a time, each prompt prefilled whole) is described
by its scheduler settings alone — ``max_num_seqs = 1``, ``chunked_prefill = false`` — so the
queue replay models it like any other engine (see ``fleet/llama_server.py``)::

    [[engines]]
    worker_id = "llama0"
    model = "tiny-llama"
    engine = "llamacpp"
    http_url = "http://127.0.0.1:8201"
    kv_events = false
    reports_cached_tokens = false
    [engines.scheduler]
    max_num_batched_tokens = 17408   # the context: a whole prompt fits one step
    max_num_seqs = 1
    chunked_prefill = false
"""

from __future__ import annotations

import hashlib
import time
import tomllib
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

import msgspec

from foretoken.core.types import (
    EngineReport,
    ModelName,
    WorkerId,
    prompt_fits,
    unknown_scheduler_keys,
)
from foretoken.wire.records import Tier, WorkerEndpoints, WorkerRegistration

EngineKind = Literal["vllm", "sglang", "llamacpp"]


class EngineConfig(EngineReport, kw_only=True, frozen=True, forbid_unknown_fields=True):
    worker_id: str
    model: str
    engine: EngineKind = "vllm"
    http_url: str
    kv_events_url: str | None = None
    replay_url: str | None = None
    metrics_url: str | None = None
    kv_topic: str = ""
    tiers: tuple[Tier, ...] = ("GPU",)
    # False: the engine publishes no KV events (llama.cpp, TGI, vLLM without
    # --kv-events-config); the index then credits it approximately from routed prompts.
    kv_events: bool = True
    # The engine reports usage.prompt_tokens_details.cached_tokens (and omits it on a miss).
    reports_cached_tokens: bool = True
    gpu_blocks: int | None = None
    # The engine's context length (vLLM --max-model-len); with gpu_blocks, what the router's
    # fallback checks a prompt against.
    max_model_len: int | None = None
    # False: the router sends this engine no x-request-id (llama-cpp-python's server answers
    # 400, with an empty body, to any x-request-id that is not a UUID).
    request_id_header: bool = True
    # A Hugging Face tokenizer.json for this model, or the model's directory holding one (the
    # router counts tokens with it, and renders chats with the chat template beside it).
    tokenizer: str | None = None
    # The model's chat template (a Jinja file, or JSON holding chat_template), as the engine
    # was started with; default: the one beside the tokenizer.json (tokenizer_config.json).
    chat_template: str | None = None
    # LoRA adapters the engine serves (vLLM --lora-modules / SGLang --lora-paths names): a
    # request whose model names one goes to an engine that has it, credited with its blocks
    # when the engine's KV events name the adapter (vLLM's lora_name, since PR #27577);
    # SGLang's events do not, so an adapter's requests there are credited nothing.
    lora_adapters: tuple[str, ...] = ()

    def fits_prompt(self, prompt_tokens: int) -> bool:
        """Whether this engine can take a prompt at all (KV capacity and context length)."""
        return prompt_fits(prompt_tokens, self.block_size, self.gpu_blocks, self.max_model_len)

    def config_hash(self) -> str:
        """Changes whenever anything that shapes the engine's cost does (a fresh fit)."""
        relevant = (
            self.model, self.engine, self.engine_version, self.block_size,
            self.eagle, self.kv_hash_algo, self.scheduler,
        )  # fmt: skip
        return hashlib.sha256(msgspec.json.encode(relevant)).hexdigest()[:16]

    def registration(self, ts: float | None = None) -> WorkerRegistration:
        return WorkerRegistration(
            worker_id=WorkerId(self.worker_id),
            model=ModelName(self.model),
            engine=self.engine,
            engine_version=self.engine_version,
            block_size=self.block_size,
            scheduler=self.scheduler,
            kv_hash_algo=self.kv_hash_algo,
            tiers=self.tiers,
            endpoints=WorkerEndpoints(
                http_url=self.http_url,
                kv_events_url=self.kv_events_url,
                replay_url=self.replay_url,
                metrics_url=self.metrics_url,
            ),
            eagle=self.eagle,
            has_kv_events=self.kv_events and self.kv_events_url is not None,
            reports_cached_tokens=self.reports_cached_tokens,
            gpu_blocks=self.gpu_blocks,
            max_model_len=self.max_model_len,
            lora_adapters=self.lora_adapters,
            config_hash=self.config_hash(),
            ts=time.time() if ts is None else ts,
        )


class EnginesFile(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    engines: tuple[EngineConfig, ...]


class EnginesConfigError(ValueError):
    pass


_SCHEMES: Final = {
    "http_url": ("http://", "https://"),
    "metrics_url": ("http://", "https://"),
    "kv_events_url": ("tcp://", "ipc://", "inproc://"),
    "replay_url": ("tcp://", "ipc://", "inproc://"),
}


def load_engines(path: str | Path) -> list[EngineConfig]:
    """The engines of the file, every mistake a one-line error naming the file, the engine
    and the key (a misspelled key, a value the registration refuses, a URL of the wrong
    kind, a tokenizer that is not there) — at load, not later deep in a service."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
        for index, entry in enumerate(raw.get("engines", ()) if isinstance(raw, dict) else ()):
            unknown = unknown_scheduler_keys(entry.get("scheduler") if isinstance(entry, dict)
                                             else None)  # fmt: skip
            if unknown:
                raise EnginesConfigError(f"unknown scheduler setting(s) {unknown} - at "
                                         f"`$.engines[{index}].scheduler`")  # fmt: skip
        engines = list(msgspec.convert(raw, EnginesFile).engines)
        if not engines:
            raise EnginesConfigError("no engines (add an [[engines]] table per engine)")
        for index, engine in enumerate(engines):
            _check_engine(engine, index)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, msgspec.ValidationError,
            EnginesConfigError) as exc:  # fmt: skip
        raise EnginesConfigError(f"engines file {path}: {exc}") from exc
    ids = [e.worker_id for e in engines]
    if len(set(ids)) != len(ids):
        raise EnginesConfigError(f"engines file {path}: duplicate worker_id")
    models = {e.model for e in engines}
    for e in engines:
        base = {a: e.model for a in e.lora_adapters}
        for other in engines:
            clash = next((a for a in other.lora_adapters if a in base
                          and base[a] != other.model), None)  # fmt: skip
            if clash is not None:
                raise EnginesConfigError(f"engines file {path}: LoRA adapter {clash!r} is "
                                         "served on two base models")  # fmt: skip
        named = models & set(e.lora_adapters)
        if named:
            raise EnginesConfigError(f"engines file {path}: LoRA adapter {sorted(named)[0]!r} "
                                     "is also a base model's name")  # fmt: skip
    return engines


def _check_engine(engine: EngineConfig, index: int) -> None:
    where = f"$.engines[{index}]"
    for name in ("worker_id", "model"):
        if not getattr(engine, name).strip():
            raise EnginesConfigError(f"{name} must not be empty - at `{where}.{name}`")
    adapters = engine.lora_adapters
    if (any(not a or len(a) > 256 or not a.isprintable() or a != a.strip() for a in adapters)
            or len(set(adapters)) < len(adapters)):  # fmt: skip
        raise EnginesConfigError("lora_adapters must be distinct printable names of 1 to 256 "
                                 "characters, without leading or trailing spaces - at "
                                 f"`{where}.lora_adapters`")  # fmt: skip
    for name, schemes in _SCHEMES.items():
        url = getattr(engine, name)
        if url is not None and not url.startswith(schemes):
            raise EnginesConfigError(f"{name} must start with {' or '.join(schemes)}, got "
                                     f"{url[:80]!r} - at `{where}.{name}`")  # fmt: skip
        if url is not None and not _has_host_and_port(url):
            raise EnginesConfigError(
                f"{name} {url[:80]!r} needs a host and a valid port (an "
                f"http URL may leave the port out) - at `{where}.{name}`"
            )
    for name in ("tokenizer", "chat_template"):
        path = getattr(engine, name)
        if path is None:
            continue
        found = Path(path).expanduser()
        if name == "tokenizer" and found.is_dir():  # a model's directory
            found = found / "tokenizer.json"
        if not found.is_file():
            raise EnginesConfigError(f"{name} {path!r} is not a file (nor a directory holding "
                                     f"tokenizer.json) - at `{where}.{name}`")  # fmt: skip
    try:
        engine.registration(ts=0.0)  # what the workers topic will hold, checked now
    except ValueError as exc:
        raise EnginesConfigError(f"{exc} - at `{where}` (worker {engine.worker_id})") from exc


def _has_host_and_port(url: str) -> bool:
    """A URL with a host (no space) and, when it names one, a port within 1..65535; a
    ``tcp://`` endpoint must name its port (ZMQ has no default)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError:
        return False
    if not parts.hostname or " " in url:
        return False
    if port is None:
        return parts.scheme in ("http", "https")
    return 1 <= port <= 65535


def dump_engines(engines: list[EngineConfig]) -> str:
    """TOML text for an engines file (the fleet simulator writes one for what it runs)."""
    lines: list[str] = []
    for e in engines:
        lines.append("[[engines]]")
        for name in e.__struct_fields__:
            value = getattr(e, name)
            if value is None or name == "scheduler":
                continue
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("[engines.scheduler]")
        for name in e.scheduler.__struct_fields__:
            lines.append(f"{name} = {_toml_value(getattr(e.scheduler, name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return msgspec.json.encode(str(value)).decode()
