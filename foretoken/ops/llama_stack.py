"""The live pipeline in front of real llama.cpp engines, as real processes: llama.cpp
servers (``fleet/llama_server.py``), the Faust worker (route service), ``ingest`` (which only
registers them: they publish no KV events) and the router. Used by the integration test,
``foretoken bench real-engine`` and ``make demo ENGINES=llama``."""

from __future__ import annotations

import json
import random
import string
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from foretoken.adapters.engines.engines_file import EngineConfig, dump_engines
from foretoken.adapters.ports import free_port
from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.sim.live.gguf_model import TinyLlamaSpec
from foretoken.sim.live.llama_server import LlamaServerConfig, RunningLlama, start_servers

START_S = 120.0
ALPHABET = string.ascii_lowercase + " "


@dataclass
class LlamaStack:
    worker_url: str
    router_url: str
    engines: list[EngineConfig]
    llamas: list[RunningLlama]
    env: dict[str, str]
    run_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.engines[0].model

    def fits(self) -> dict[str, dict[str, object]]:
        """The worker's current fit per worker id (``GET /v1/fits``)."""
        rows = get_json(f"{self.worker_url}/v1/fits")["fits"]
        return {r["worker_id"]: r for r in rows if r["current"]}

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs.values())):
            stop(proc)
        for llama in self.llamas:
            stop(llama.proc)

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.run_dir.glob("*.log")))  # fmt: skip


def start_llama_stack(
    env: dict[str, str], run_dir: Path, *, count: int = 1,
    cfg: LlamaServerConfig = LlamaServerConfig(), spec: TinyLlamaSpec = TinyLlamaSpec(),
    router_port: int | None = None, route_timeout_s: float = 1.0,
) -> LlamaStack:  # fmt: skip
    """Start everything; ``env`` carries the topic prefix and the worker's app id (and may
    carry ``FORETOKEN_WEB_PORT``). Stops what it started if anything fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {"FORETOKEN_APP_ID": f"foretoken-llama-{uuid.uuid4().hex[:6]}",
           "FORETOKEN_WORKER_DATA_DIR": str(run_dir / "worker-data"),
           "FORETOKEN_WEB_PORT": str(free_port()), **env}  # fmt: skip
    worker_url = f"http://127.0.0.1:{env['FORETOKEN_WEB_PORT']}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    llamas: list[RunningLlama] = []
    stack = LlamaStack(worker_url, "", [], llamas, env, run_dir, procs)
    try:
        procs["worker"] = spawn(foretoken_cmd("worker"), env, run_dir / "worker.log")
        ports = [free_port() for _ in range(count)]
        llamas[:], stack.engines = start_servers(count, ports, run_dir, spec=spec, cfg=cfg)
        wait_http(f"{worker_url}/healthz", START_S, procs["worker"])
        engines_file = run_dir / "engines.toml"
        engines_file.write_text(dump_engines(stack.engines))
        ingest_cmd = foretoken_cmd("ingest", "-e", str(engines_file), "--port", str(free_port()))
        procs["ingest"] = spawn(ingest_cmd, env, run_dir / "ingest.log")
        port = router_port or free_port()
        router_env = {**env, "FORETOKEN_ROUTE_URL": worker_url,
                      "FORETOKEN_ROUTE_TIMEOUT_S": str(route_timeout_s)}  # fmt: skip
        router_cmd = foretoken_cmd("router", "-e", str(engines_file), "--port", str(port))
        procs["router"] = spawn(router_cmd, router_env, run_dir / "router.log")
        stack.router_url = f"http://127.0.0.1:{port}"
        wait_http(f"{stack.router_url}/healthz", START_S, procs["router"])
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:  # the route service knows every engine
            page = get_json(f"{worker_url}/v1/cache/{stack.model}")
            if len(page["workers"]) == count:
                return stack
            time.sleep(0.3)
        raise TimeoutError("the worker never saw the llama.cpp engines' registrations")
    except BaseException as exc:
        stack.stop_all()
        exc.add_note(f"logs of the stack's processes ({run_dir}):\n{stack.logs()}")
        raise


# ---------------------------------------------------------------------- clients


def random_text(rng: random.Random, n_tokens: int) -> str:
    """ASCII text of exactly ``n_tokens`` tokens for the byte-level model (1 byte = 1 token)."""
    return "".join(rng.choice(ALPHABET) for _ in range(n_tokens))


@dataclass(frozen=True, slots=True)
class Timed:
    """One streamed completion as a client saw it."""

    ttft_s: float | None
    e2e_s: float
    text: str
    usage: dict[str, Any]
    headers: dict[str, str]


def stream_completion(
    base_url: str, model: str, prompt: str, *, max_tokens: int = 1,
    headers: dict[str, str] | None = None, timeout_s: float = 300.0,
    path: str = "/v1/completions",
) -> Timed:  # fmt: skip
    """POST a streaming completion; TTFT = first SSE chunk with non-empty text."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    req = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )  # fmt: skip
    started = time.monotonic()
    ttft: float | None = None
    texts: list[str] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        got = dict(resp.headers.items())
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            text = ""
            if choices:
                text = (
                    choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
                )
            if text:
                texts.append(text)
                if ttft is None:
                    ttft = time.monotonic() - started
    return Timed(ttft, time.monotonic() - started, "".join(texts), usage, got)


def fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a·N + b·N²`` (non-negative, relative errors) over (N, seconds):
    the engine's own cold curve, measured directly, as the baseline for the learned fit."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    design = np.stack([n, n * n], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if b < 0:  # no curvature measured: a line through the origin
        a, b = float(np.sum(n * t) / np.sum(n * n)), 0.0
    return float(max(a, 0.0)), float(b)
