"""Real-time simulated engines: ``foretoken fleet run FLEET.toml``.

Each engine of the fleet file gets, in one asyncio process:

* an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``, streaming
  and not; ``/v1/models``, ``/healthz``, ``/metrics`` with vLLM's ``cache_config_info``);
  prompts may be text (the built-in tokenizer) or token ids; ``n``, ``logprobs`` and
  ``echo`` as vLLM takes them (``sampling.py``: the choices share the request's one prefill);
  SGLang's native ``/generate`` (``native.py``), vLLM's ``/tokenize`` and ``/detokenize``;
* the pure ``EngineModel`` stepped against a real clock: a step that the hidden truth says
  takes d seconds takes ``d × time_scale`` seconds of wall time;
* a ZMQ PUB socket sending the KV events in vLLM's 3-frame wire format, and a ROUTER replay
  socket that answers from a bounded buffer of recent batches.

The engines file written at start (``--engines-out``) tells ingest and the router where
everything listens; registrations also go to the ``workers`` topic when a broker answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.core.tokenizer import SimTokenizer, chat_to_text, generation_prompt
from foretoken.core.types import RequestId
from foretoken.sim.engine import EngineModel, RequestTooLarge, StepResult
from foretoken.sim.live import native
from foretoken.sim.live.sampling import Answer, FieldError, parse_sampling, prompt_echo
from foretoken.sim.live.vllm_wire import (
    decode_replay_request,
    encode_replay_stream,
    encode_vllm_frames,
)
from foretoken.sim.spec import EngineSpec, FleetSpec
from foretoken.wire.codec import DecodeError

log = logging.getLogger(__name__)

REPLAY_BUFFER = 10_000
DEFAULT_MAX_TOKENS = 16
IDLE_POLL_S = 0.05


@dataclass
class _Pending:
    """A request's token stream, filled by the step loop, drained by the HTTP handler."""

    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Ports:
    http: int
    kv: int
    replay: int


class SimEngine:
    def __init__(self, spec: EngineSpec, ports: Ports, host: str, time_scale: float) -> None:
        self.spec = spec
        self.ports = ports
        self.host = host
        self.time_scale = time_scale
        self.model = EngineModel(spec)
        self.tokenizer = SimTokenizer()
        self.pending: dict[RequestId, _Pending] = {}
        self.wakeup = asyncio.Event()
        self.t0 = time.monotonic()
        self.seq = itertools.count()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.topic = b""
        self.served = 0
        self.token_counter = itertools.count()
        self.ctx = zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)

    # ------------------------------------------------------------------ clock

    def now_s(self) -> float:
        return (time.monotonic() - self.t0) / self.time_scale

    async def sleep_until(self, sim_s: float) -> None:
        delay = (sim_s - self.now_s()) * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ config

    def config(self, advertise_host: str) -> EngineConfig:
        base = f"http://{advertise_host}:{self.ports.http}"
        return EngineConfig(
            worker_id=self.spec.id,
            model=self.spec.model,
            engine="sglang" if self.spec.engine == "sglang" else "vllm",
            engine_version=self.spec.engine_version,
            block_size=self.spec.block_size,
            http_url=base,
            kv_events_url=f"tcp://{advertise_host}:{self.ports.kv}",
            replay_url=f"tcp://{advertise_host}:{self.ports.replay}",
            metrics_url=f"{base}/metrics",
            tiers=self.spec.tiers,
            eagle=self.spec.eagle,
            kv_hash_algo=self.spec.kv_hash_algo,
            scheduler=self.spec.scheduler,
            gpu_blocks=self.spec.kv.gpu_blocks,
        )

    # ------------------------------------------------------------------ step loop

    async def run_steps(self) -> None:
        while True:
            if self.model.is_idle:
                self.wakeup.clear()
                await self.wakeup.wait()
            now = max(self.now_s(), self.model.busy_until_s)
            result = self.model.step(now)
            if result.duration_s <= 0:
                self._publish(result)
                # Nothing could be scheduled (e.g. waiting for blocks): wait for a change.
                self.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), IDLE_POLL_S)
                continue
            await self.sleep_until(result.end_s)
            self._deliver(result)
            self._publish(result)

    def _deliver(self, result: StepResult) -> None:
        for first in result.first_tokens:
            pending = self.pending.get(first.request_id)
            if pending is not None:
                pending.cached_tokens = first.cached_tokens
        for rid in result.tokens:
            pending = self.pending.get(rid)
            if pending is not None:
                pending.tokens.put_nowait(next(self.token_counter) % self.tokenizer.vocab_size)
        for fin in result.finished:
            pending = self.pending.get(fin.request_id)
            if pending is not None:
                pending.tokens.put_nowait(None)

    def _publish(self, result: StepResult) -> None:
        if not result.kv_events:
            return
        seq = next(self.seq)
        frames = encode_vllm_frames(
            self.topic, seq, time.time(), result.kv_events, block_size=self.spec.block_size
        )
        self.buffer.append((seq, frames[2]))
        self.pub.send_multipart(frames)

    async def serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            try:
                identity, start = decode_replay_request(frames)
            except DecodeError as exc:
                log.warning("%s: bad replay request: %s", self.spec.id, exc)
                continue
            for reply in encode_replay_stream(identity, list(self.buffer), start):
                await self.router.send_multipart(reply)

    # ------------------------------------------------------------------ HTTP

    async def generate(self, token_ids: list[int], max_tokens: int) -> tuple[RequestId, _Pending]:
        rid = RequestId(uuid.uuid4().hex)
        pending = _Pending(prompt_tokens=len(token_ids))
        self.pending[rid] = pending
        self.model.submit(rid, token_ids, max_tokens, self.now_s())
        self.wakeup.set()
        return rid, pending

    async def stream_tokens(self, rid: RequestId, pending: _Pending) -> AsyncIterator[int]:
        try:
            while True:
                token = await pending.tokens.get()
                if token is None:
                    return
                yield token
        finally:
            self.pending.pop(rid, None)
            if self.model.cancel(rid):
                self.wakeup.set()

    def metrics_text(self) -> str:
        s = self.model.stats()
        sched = self.spec.scheduler
        return "\n".join(
            [
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{self.spec.block_size}",'
                f'num_gpu_blocks="{self.spec.kv.gpu_blocks}",'
                f'enable_prefix_caching="True"}} 1.0',
                f'vllm:num_requests_waiting{{model_name="{self.spec.model}"}} {s.num_waiting}',
                f'vllm:num_requests_running{{model_name="{self.spec.model}"}} {s.num_running}',
                f'vllm:max_num_batched_tokens{{model_name="{self.spec.model}"}} '
                f"{sched.max_num_batched_tokens}",
                f"foretoken_sim_requests_served_total {self.served}",
                "",
            ]
        )


# ---------------------------------------------------------------------- HTTP handlers


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None) -> web.Response:  # fmt: skip
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _prompt_ids(engine: SimEngine, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        return engine.tokenizer.encode(
            chat_to_text(messages, generation_prompt=generation_prompt(body))
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return engine.tokenizer.encode(prompt)
    raise ValueError("prompt must be a non-empty string or a list of token ids")


def make_app(engine: SimEngine) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker_id": engine.spec.id})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=engine.metrics_text(), content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        data = [{"id": engine.spec.model, "object": "model", "owned_by": "foretoken-sim"}]
        return web.json_response({"object": "list", "data": data})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _complete(engine, request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _complete(engine, request, chat=True)

    async def tokenize(request: web.Request) -> web.Response:  # vLLM's shape
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            ids = _prompt_ids(engine, body, chat="messages" in body)
        except (ValueError, TypeError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        capacity = engine.spec.kv.gpu_blocks * engine.spec.block_size  # what fits at all
        return web.json_response({"count": len(ids), "max_model_len": capacity, "tokens": ids,
                                  "token_strs": None})  # fmt: skip

    async def detokenize(request: web.Request) -> web.Response:
        try:
            tokens = (await request.json())["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("tokens must be a list of token ids")
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
            return _error(400, f"bad body: {exc}")
        # the simulator's tokenizer cannot invert its hashes: stand-ins, as it generates
        return web.json_response({"prompt": "".join(map(engine.tokenizer.decode_one, tokens))})

    async def generate(request: web.Request) -> web.StreamResponse:  # SGLang's native API
        return await native.generate(engine, request)

    app.router.add_post("/generate", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _complete(engine: SimEngine, request: web.Request, chat: bool) -> web.StreamResponse:
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if body.get("model") not in (None, engine.spec.model):
            return _error(404, f"model {body.get('model')!r} is not served here", "not_found")
        token_ids = _prompt_ids(engine, body, chat)
        sampling = parse_sampling(body, chat)
        echo = (
            prompt_echo(engine.tokenizer, body.get("prompt"), token_ids) if sampling.echo else None
        )
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        stream = bool(body.get("stream"))
        answer = Answer(sampling, chat, engine.tokenizer, echo, stream=stream, collect=not stream)
        rid, pending = await engine.generate(token_ids, max_tokens)
    except FieldError as exc:
        return _error(400, str(exc), param=exc.param)
    except RequestTooLarge as exc:
        return _error(400, str(exc))
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        return _error(400, str(exc))
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    if stream:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        head = {"id": f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else kind,
                "created": created, "model": engine.spec.model}  # fmt: skip
        return await _stream(engine, request, rid, pending, answer, head, include_usage)
    async for token in engine.stream_tokens(rid, pending):
        answer.step(token)
    engine.served += 1
    return web.json_response(
        {
            "id": f"cmpl-{rid}", "object": kind, "created": created, "model": engine.spec.model,
            "choices": answer.whole(), "usage": _usage(pending, answer.completion_tokens),
        }
    )  # fmt: skip


def _usage(pending: _Pending, completion_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": pending.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": pending.prompt_tokens + completion_tokens,
    }
    if pending.cached_tokens:  # vLLM omits the details on a miss
        usage["prompt_tokens_details"] = {"cached_tokens": pending.cached_tokens}
    return usage


async def _stream(
    engine: SimEngine,
    request: web.Request,
    rid: RequestId,
    pending: _Pending,
    answer: Answer,
    head: dict[str, Any],
    include_usage: bool,
) -> web.StreamResponse:
    """One event per choice per token (each choice's first chat event is its role), then
    each choice's finish event, the usage event when asked for, ``[DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    async for token in engine.stream_tokens(rid, pending):
        await resp.write(_events(head, answer.step(token)))
    await resp.write(_events(head, answer.finals()))
    if include_usage:
        usage = _usage(pending, answer.completion_tokens)
        await resp.write(_events(head, [], usage))
    await resp.write(b"data: [DONE]\n\n")
    engine.served += 1
    await resp.write_eof()
    return resp


def _events(head: dict[str, Any], choices: list[dict[str, Any]],
            usage: dict[str, Any] | None = None) -> bytes:  # fmt: skip
    """SSE events: one per choice, or (``usage``) the usage event without choices."""
    docs = [{**head, "choices": [c]} for c in choices] if usage is None else [
        {**head, "choices": [], "usage": usage}]  # fmt: skip
    return b"".join(b"data: " + json.dumps(doc).encode() + b"\n\n" for doc in docs)


# ---------------------------------------------------------------------- the fleet


def assign_ports(n: int, base_port: int, kv_base_port: int) -> list[Ports]:
    """Fixed ports from the bases; 0 where a base is 0: the socket is bound to a port the
    system picks when the fleet starts (tests — no probe-then-bind race with other processes)."""
    out = []
    for i in range(n):
        http = base_port + i if base_port else 0
        kv = kv_base_port + 2 * i if kv_base_port else 0
        replay = kv_base_port + 2 * i + 1 if kv_base_port else 0
        out.append(Ports(http, kv, replay))
    return out


def _bind_zmq(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    if port:
        sock.bind(f"tcp://{host}:{port}")
        return port
    return sock.bind_to_random_port(f"tcp://{host}")


def _bind_http(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Fleet:
    def __init__(
        self,
        fleet: FleetSpec,
        *,
        host: str = "127.0.0.1",
        base_port: int = 8100,
        kv_base_port: int = 5557,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        ports = assign_ports(len(fleet.engines), base_port, kv_base_port)
        self.engines = [
            SimEngine(s, p, host, time_scale) for s, p in zip(fleet.engines, ports, strict=True)
        ]
        self.host = host
        self.runners: list[web.AppRunner] = []
        self.tasks: list[asyncio.Task[None]] = []

    def configs(self, advertise_host: str | None = None) -> list[EngineConfig]:
        advertise = advertise_host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
        return [e.config(advertise) for e in self.engines]

    async def start(self) -> None:
        for engine in self.engines:
            kv = _bind_zmq(engine.pub, self.host, engine.ports.kv)
            replay = _bind_zmq(engine.router, self.host, engine.ports.replay)
            http = _bind_http(self.host, engine.ports.http)
            engine.ports = Ports(http.getsockname()[1], kv, replay)
            runner = web.AppRunner(make_app(engine), access_log=None)
            await runner.setup()
            await web.SockSite(runner, http).start()
            self.runners.append(runner)
            self.tasks.append(asyncio.create_task(engine.run_steps()))
            self.tasks.append(asyncio.create_task(engine.serve_replay()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for runner in self.runners:
            await runner.cleanup()
        for engine in self.engines:
            engine.pub.close(0)
            engine.router.close(0)


async def run_fleet(
    fleet: FleetSpec,
    *,
    host: str,
    base_port: int,
    kv_base_port: int,
    time_scale: float,
    engines_out: Path | None,
    settings: Any | None,
    stop: asyncio.Event | None = None,
    advertise_host: str | None = None,
) -> None:
    """Start every engine, write the engines file, register on ``workers``, run until stopped."""
    from foretoken.adapters.engines.engines_file import dump_engines

    sim = Fleet(fleet, host=host, base_port=base_port, kv_base_port=kv_base_port,
                time_scale=time_scale)  # fmt: skip
    await sim.start()
    configs = sim.configs(advertise_host)
    if engines_out is not None:
        engines_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = engines_out.with_suffix(".tmp")
        tmp.write_text(dump_engines(configs))
        tmp.rename(engines_out)
    if settings is not None:
        await _register(settings, configs)
    for c in configs:
        log.warning("engine %s (%s) on %s, kv events %s", c.worker_id, c.model, c.http_url,
                    c.kv_events_url)  # fmt: skip
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await sim.stop()


async def _register(settings: Any, configs: list[EngineConfig]) -> None:
    from foretoken.adapters.kafka.producer import RecordProducer
    from foretoken.adapters.kafka.readiness import StartupError, wait_for_topics
    from foretoken.adapters.ports import accepts_connections

    if not accepts_connections(settings.kafka.bootstrap_servers):
        log.warning("no broker at %s: engines not registered on workers (ingest will do it)",
                    settings.kafka.bootstrap_servers)  # fmt: skip
        return
    try:
        await wait_for_topics(settings, ("workers",), service="the fleet")
    except StartupError as exc:
        log.warning("%s: engines not registered on workers (ingest will do it)", exc)
        return
    async with RecordProducer(settings) as producer:
        for config in configs:
            await producer.send("workers", config.registration())
        await producer.flush()
