"""A bounded fuzz suite against the real route service (the processor's /v1/route and
/v1/cache) and the real ingest (vLLM- and SGLang-protocol publishers on real ZMQ sockets):
garbage, oversized, valid-but-huge, truncated msgpack, wrong types, deep nesting, invalid
UTF-8, out-of-range numbers (issue 16, "Done when").

Hypothesis draws each batch's plan; a seeded generator builds its inputs
(``tests/integration/fuzz_inputs.py``). What must hold: no response ≥ 500 (every 4xx is a
JSON error naming the field), no listener dies, memory growth stays bounded, and normal
traffic is served afterwards. The totals (inputs, time, RSS) are printed at the end."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from foretoken.adapters.processes import get_json, stop
from foretoken.settings import Settings
from tests.conftest import RunningWorker, launch_worker
from tests.integration import fuzz_inputs as fz
from tests.integration import test_router_fuzz as router_fuzz
from tests.integration.zmq_engine import (
    BLOCK,
    FakeEngine,
    RunningIngest,
    cached,
    prompt,
    rss_kib,
    wait_until,
)

pytestmark = pytest.mark.integration
MODEL = "fuzz-model"
ENGINES = {"fz-vllm": "vllm", "fz-sglang": "sglang"}
MAX_MESSAGE = 2 * 1024 * 1024
LIMITS = {
    "FORETOKEN__INGEST__MAX_MESSAGE_BYTES": str(MAX_MESSAGE),
    "FORETOKEN__INGEST__MAX_RECORD_BYTES": str(64 * 1024),  # splits happen often
    "FORETOKEN__INGEST__OFFLOAD_BYTES": str(32 * 1024),  # and the off-loop path runs
    "FORETOKEN__ROUTE__READ_TIMEOUT_S": "1.0",
    "FORETOKEN__ROUTE__MAX_PROMPT_TOKENS": "262144",  # a 1.4 MB body limit
    "FORETOKEN__ROUTER__MAX_PROMPT_TOKENS": "262144",
}
# With the router's own fuzz suite (tests/integration/test_router_fuzz.py), >= 10^5 inputs.
ROUTER_INPUTS = router_fuzz.EXAMPLES * router_fuzz.BATCH
EXAMPLES = int(os.environ.get("FORETOKEN_FUZZ_EXAMPLES", 0)) or -(
    -(100_000 - ROUTER_INPUTS) // (2 * fz.PER_EXAMPLE)
)
RSS_GROWTH_LIMIT_KIB = 150 * 1024


@dataclass
class Fuzz:
    worker: RunningWorker
    worker_proc: subprocess.Popen[bytes]
    engines: dict[str, FakeEngine]
    ingest: RunningIngest
    loop: asyncio.AbstractEventLoop
    makers: dict[str, fz.FrameMaker] = field(default_factory=dict)
    sent: Counter[str] = field(default_factory=Counter)
    inputs: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    rss_start: dict[str, int] = field(default_factory=dict)
    cpu_start: dict[str, float] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)

    def rss(self) -> dict[str, int]:
        return {"ingest": self.ingest.rss_kib(), "processor": rss_kib(self.worker_proc.pid)}

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each process (wall time is noisy on a shared machine)."""
        own = os.times()
        return {"ingest": cpu_s(self.ingest.proc.pid), "processor": cpu_s(self.worker_proc.pid),
                "pytest": own.user + own.system}  # fmt: skip


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def fuzz(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    tmp = tmp_path_factory.mktemp("fuzz")
    proc, worker = launch_worker(kafka_settings, tmp, **LIMITS)
    engines = {name: FakeEngine(name) for name in ENGINES}
    engines_file = tmp / "engines.toml"
    engines_file.write_text("".join(
        e.engines_toml(MODEL, f'engine = "{ENGINES[name]}"') for name, e in engines.items()
    ))  # fmt: skip
    ingest = RunningIngest(engines_file, {**worker.env, **LIMITS}, tmp / "ingest.log")
    loop = asyncio.new_event_loop()
    state = Fuzz(worker, proc, engines, ingest, loop)
    state.makers = {name: fz.FrameMaker() for name in engines}
    try:
        page = f"{worker.url}/v1/cache/{MODEL}"
        wait_until(lambda: set(ENGINES) <= set(get_json(page)["workers"]), "registrations")
        ingest.wait_listening(*ENGINES)
        yield state
    finally:
        loop.close()
        ingest.stop()
        for engine in engines.values():
            engine.close()
        stop(proc)
        print(ingest.log.read_text()[-1500:] if ingest.log.exists() else "")


def _settle(f: Fuzz, timeout_s: float = 60.0) -> None:
    """Wait until ingest has taken every message sent to each engine."""

    def caught_up() -> bool:
        assert f.ingest.proc.poll() is None, "ingest exited"
        engines = f.ingest.health()[1]["engines"]
        return all(engines[name]["messages"] >= f.sent[name] for name in ENGINES)

    deadline = time.monotonic() + timeout_s
    while not caught_up():
        assert time.monotonic() < deadline, "ingest did not take every message"
        time.sleep(0.05)


def test_warm_up_and_normal_traffic_first(fuzz: Fuzz) -> None:
    for name, engine in fuzz.engines.items():
        maker = fuzz.makers[name]
        engine.raw([b"", maker.seq.to_bytes(8, "big"), fz.valid_payload(random.Random(1))])
        maker.seq += 1
        fuzz.sent[name] += 1
    _settle(fuzz)
    status, _ = _post(fuzz, "/v1/route", fz.body("valid", 1, MODEL)[0], "application/json")
    assert status == 200
    fuzz.rss_start = fuzz.rss()
    fuzz.cpu_start = fuzz.cpu()


def test_oversized_and_valid_but_huge_messages(fuzz: Fuzz) -> None:
    for name, engine in fuzz.engines.items():
        health = fuzz.ingest.engine(name)
        engine.raw([b"", (2**40).to_bytes(8, "big"), os.urandom(MAX_MESSAGE + 4096)])
        fuzz.inputs["frame:oversized"] += 1
        wait_until(lambda n=name, r=health["resubscribes"]: fuzz.ingest.engine(n)["resubscribes"]
                   > r and fuzz.ingest.engine(n)["connected"], "a new socket")  # fmt: skip
        fuzz.sent[name] = fuzz.ingest.engine(name)["messages"]  # the dropped one never came
        for k in range(3):  # ~1.6 MB each: valid, under the message limit, many records
            maker = fuzz.makers[name]
            payload = fz.valid_payload(random.Random(k), blocks=6_000)
            assert len(payload) < MAX_MESSAGE
            engine.raw([b"", maker.seq.to_bytes(8, "big"), payload])
            maker.seq += 1
            fuzz.sent[name] += 1
            fuzz.inputs["frame:huge"] += 1
    _settle(fuzz, 120.0)
    for name in ENGINES:
        state = fuzz.ingest.engine(name)
        assert state["listening"] and state["split_batches"] >= 1, state


Request = tuple[str, bytes, str]  # path, body, content type


async def _pipelined(f: Fuzz, requests: list[Request]) -> list[tuple[int, bytes]]:
    """HTTP/1.1 requests sent back to back on one keep-alive connection, their answers read
    in order (a client that costs next to nothing, so the server's work is what is timed)."""
    host, port = f.worker.url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def send() -> None:
        for path, data, content_type in requests:
            writer.write(b"POST %s HTTP/1.1\r\nHost: fuzz\r\nContent-Type: %s\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (path.encode(), content_type.encode(),
                                                          len(data), data))  # fmt: skip
            await writer.drain()

    async def receive() -> list[tuple[int, bytes]]:
        answers = []
        for _ in requests:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
            answer = await reader.readexactly(int(headers["content-length"]))
            answers.append((int(lines[0].split()[1]), answer))
        return answers

    try:
        return (await asyncio.gather(send(), receive()))[1]
    finally:
        writer.close()


def _run(f: Fuzz, requests: list[Request], connections: int = 2) -> list[tuple[int, bytes]]:
    async def run() -> list[tuple[int, bytes]]:
        parts = await asyncio.gather(*(_pipelined(f, requests[i::connections])
                                       for i in range(connections)))  # fmt: skip
        answers: list[tuple[int, bytes]] = [(0, b"")] * len(requests)
        for i, part in enumerate(parts):
            answers[i::connections] = part
        return answers

    return f.loop.run_until_complete(run())


def _post(f: Fuzz, path: str, data: bytes, content_type: str) -> tuple[int, bytes]:
    return _run(f, [(path, data, content_type)], connections=1)[0]


def _check(status: int, answer: bytes, data: bytes) -> None:
    assert status < 500, (status, answer[:300], data[:300])
    if status >= 400:
        error = json.loads(answer)["error"]
        assert error["param"] and error["message"], answer[:300]


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate),
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(frames=fz.frame_plans, bodies=fz.body_plans)
def test_fuzz_ingest_frames_and_route_service_bodies(
    fuzz: Fuzz, frames: fz.Plan, bodies: fz.Plan
) -> None:
    """One example: 450 ZMQ messages across both engines, then 450 bodies to the route
    service while ingest works through the messages (two processes, in parallel)."""
    for i, (kind, seed) in enumerate(frames.items(fz.FRAME_KINDS)):
        name = "fz-vllm" if i % 2 else "fz-sglang"
        fuzz.engines[name].raw(fuzz.makers[name].frames(kind, seed))
        fuzz.sent[name] += 1
        fuzz.inputs[f"frame:{kind}"] += 1
    requests = []
    for i, (kind, seed) in enumerate(bodies.items(fz.BODY_KINDS)):
        path = f"/v1/cache/{MODEL}" if i % 10 == 0 else "/v1/route"
        data, content_type = fz.body(kind, seed, MODEL)
        requests.append((path, data, content_type))
        fuzz.inputs[f"body:{kind}"] += 1
    answers = _run(fuzz, requests)
    for (status, answer), (_, data, _) in zip(answers, requests, strict=True):
        fuzz.statuses[status] += 1
        _check(status, answer, data)
    _settle(fuzz)


def test_slow_and_oversized_bodies_are_4xx(fuzz: Fuzz) -> None:
    host, port = fuzz.worker.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"request_id\"")  # fmt: skip
        started = time.monotonic()
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5
    fuzz.inputs["body:slow"] += 1
    big = b'{"request_id": "big", "model": "m", "token_ids": [' + b"1," * 1_000_000 + b"1]}"
    status, answer = _post(fuzz, "/v1/route", big, "application/json")
    assert status == 413 and json.loads(answer)["error"]["param"] == "body"
    fuzz.inputs["body:oversized"] += 1


def test_after_the_fuzz_normal_traffic_is_served_and_memory_is_bounded(fuzz: Fuzz) -> None:
    for name, engine in fuzz.engines.items():
        maker = fuzz.makers[name]
        tokens = prompt(900 + len(name))
        engine.stored(maker.seq + 10**6, tokens)  # a restart or a gap: either way indexed
        wait_until(lambda n=name, t=tokens: cached(fuzz.worker, MODEL, n, t) == 4 * BLOCK,
                   f"{name} indexed after the fuzz")  # fmt: skip
    status, answer = _post(fuzz, "/v1/route", fz.body("valid", 7, MODEL)[0], "application/json")
    assert status == 200 and len(json.loads(answer)["grant"]["candidates"]) == len(ENGINES)
    status, health = fuzz.ingest.health()
    assert status == 200 and health["status"] == "ok"
    for name in ENGINES:
        assert health["engines"][name]["listener_restarts"] == 0
    assert get_json(f"{fuzz.worker.url}/healthz")["status"] == "ok"
    rss = fuzz.rss()
    growth = {k: rss[k] - fuzz.rss_start[k] for k in rss}
    total = sum(fuzz.inputs.values())
    elapsed = time.monotonic() - fuzz.started_s
    print(f"\nfuzz: {total} inputs in {elapsed:.0f} s; {dict(sorted(fuzz.inputs.items()))}")
    print(f"fuzz: statuses {dict(sorted(fuzz.statuses.items()))}")
    print(f"fuzz: RSS KiB start {fuzz.rss_start} end {rss} growth {growth}")
    cpu = {k: round(v - fuzz.cpu_start[k], 1) for k, v in fuzz.cpu().items()}
    print(f"fuzz: CPU s {cpu}; load average {os.getloadavg()}")
    Path(os.environ.get("FORETOKEN_FUZZ_REPORT", "/dev/null")).write_text(json.dumps({
        "inputs": total, "by_kind": fuzz.inputs, "statuses": fuzz.statuses,
        "elapsed_s": round(elapsed, 1), "rss_start_kib": fuzz.rss_start, "rss_end_kib": rss,
        "cpu_s": cpu,
    }, default=dict))  # fmt: skip
    assert total + ROUTER_INPUTS >= 100_000, (total, ROUTER_INPUTS)
    assert all(g < RSS_GROWTH_LIMIT_KIB for g in growth.values()), growth
