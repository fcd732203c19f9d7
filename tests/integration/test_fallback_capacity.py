"""Issue 16, finding 7: when the route service timed out on a burst of 40 prompts of 12k
tokens, the router's fallback sent them to a worker whose KV cache holds 8k tokens, and 11
valid requests failed. Here the route service is a socket that never answers (every
decision is the fallback's), the fleet is the simulator's `small` (two engines of 16k
tokens of KV, `small-offload` of 8k), and the same burst goes through the real router."""

from __future__ import annotations

import json
import socket
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop, wait_http
from foretoken.settings import Settings
from tests.conftest import free_port

pytestmark = pytest.mark.integration
MODEL = "sim-small"


class BlackHole:
    """A TCP listener that accepts connections and never answers (a route service that
    times out)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", free_port()))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def hole() -> Iterator[BlackHole]:
    h = BlackHole()
    yield h
    h.close()


def served(engine: dict[str, str]) -> int:
    with urllib.request.urlopen(engine["metrics_url"], timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("foretoken_sim_requests_served_total"):
                return int(float(line.split()[-1]))
    raise AssertionError("no served counter")


def test_a_burst_of_12k_prompts_never_goes_to_the_8k_worker(
    kafka_settings: Settings, hole: BlackHole, tmp_path: Path
) -> None:
    env = {"FORETOKEN_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.kafka.bootstrap_servers}  # fmt: skip
    engines_file = tmp_path / "engines.toml"
    fleet = spawn(foretoken_cmd("fleet", "run", "small", "--base-port", "0", "--kv-base-port",
                                "0", "--engines-out", str(engines_file), "--time-scale", "0.25",
                                "--no-register"), env, tmp_path / "fleet.log")  # fmt: skip
    router = None
    try:
        deadline = time.monotonic() + 60
        while not engines_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        engines = tomllib.loads(engines_file.read_text())["engines"]
        small = [e for e in engines if e["gpu_blocks"] * e["block_size"] < 12_000]
        assert [e["worker_id"] for e in small] == ["small-offload"]
        port = free_port()
        router_env = {**env, "FORETOKEN_ROUTE_URL": f"http://127.0.0.1:{hole.port}",
                      "FORETOKEN_ROUTE_TIMEOUT_S": "0.05"}  # fmt: skip
        router = spawn(foretoken_cmd("router", "-e", str(engines_file), "--port", str(port)),
                       router_env, tmp_path / "router.log")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", 60, router)

        def one(i: int) -> int:
            prompt = [(i * 7919 + j) % 30_000 + 1 for j in range(12_000)]
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
            req = urllib.request.Request(
                f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=240) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        with ThreadPoolExecutor(40) as pool:
            statuses = list(pool.map(one, range(40)))
        assert statuses == [200] * 40
        assert served(small[0]) == 0
        assert sum(served(e) for e in engines) == 40
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        fallbacks = sum(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("foretoken_router_fallbacks_total"))  # fmt: skip
        assert fallbacks == 40  # every decision was the fallback's
        # A prompt no worker can hold is a clear 400, not a failed request at an engine.
        body = json.dumps({"model": MODEL, "prompt": list(range(1, 20_000)), "max_tokens": 2})
        req = urllib.request.Request(
            f"{url}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"]["code"] == "context_length_exceeded"
        assert get_json(f"{url}/healthz")["status"] == "ok"
    finally:
        if router is not None:
            stop(router)
        stop(fleet)
