"""A real ZMQ publisher emitting vLLM-format batches — with a repaired gap, an unrepairable
gap and an engine restart — through `foretoken ingest`, the real broker and the Faust
worker's cache index; `/v1/cache` shows what the events imply."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from foretoken.adapters.processes import foretoken_cmd, get_json, spawn, stop
from foretoken.sim.live.vllm_wire import (
    decode_replay_request,
    encode_replay_stream,
    encode_vllm_frames,
)
from foretoken.wire.records import BlockStored
from tests.conftest import RunningWorker, free_port

pytestmark = pytest.mark.integration
MODEL = "ingest-model"
WORKER = "zmq-w0"
BLOCK = 16
WAIT_S = 60.0


class FakeEngine:
    """Real PUB + ROUTER sockets speaking vLLM's KV-event protocol; the replay buffer can be
    told to forget a batch, which makes that gap unrepairable."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.buffer: dict[int, bytes] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def _serve_replay(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        while not self.stopping.is_set():
            if not router.poll(100):
                continue
            identity, start = decode_replay_request(router.recv_multipart())
            for reply in encode_replay_stream(identity, sorted(self.buffer.items()), start):
                router.send_multipart(reply)
        router.close(0)

    def stored(self, seq: int, tokens: list[int], *, publish: bool = True, buffer: bool = True,
               base_hash: int = 0) -> None:  # fmt: skip
        n = len(tokens) // BLOCK
        event = BlockStored(
            block_hashes=tuple(base_hash + seq * 1000 + i for i in range(n)),
            token_ids=tuple(tokens[: n * BLOCK]),
            block_size=BLOCK,
        )
        frames = encode_vllm_frames(b"", seq, time.time(), [event], block_size=BLOCK)
        if buffer:
            self.buffer[seq] = frames[2]
        if publish:
            self.pub.send_multipart(frames)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.pub.close(0)
        self.ctx.term()


def prompt(k: int) -> list[int]:
    return [10_000 * (k + 1) + i for i in range(4 * BLOCK)]


def lookup(worker: RunningWorker, tokens: list[int]) -> int:
    req = urllib.request.Request(
        f"{worker.url}/v1/cache/{MODEL}",
        data=json.dumps({"token_ids": tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        hits = json.loads(resp.read())["hits"]
    return int(hits.get(WORKER, {}).get("tokens", 0))


def wait_until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    eng = FakeEngine()
    yield eng
    eng.close()


def test_gap_replay_reset_and_restart_reach_the_index(
    engine: FakeEngine, faust_worker: RunningWorker, tmp_path: Path
) -> None:
    engines = tmp_path / "engines.toml"
    engines.write_text(
        f'[[engines]]\nworker_id = "{WORKER}"\nmodel = "{MODEL}"\nblock_size = {BLOCK}\n'
        f'http_url = "http://127.0.0.1:9"\n'
        f'kv_events_url = "tcp://127.0.0.1:{engine.pub_port}"\n'
        f'replay_url = "tcp://127.0.0.1:{engine.replay_port}"\n'
    )
    ingest = spawn(foretoken_cmd("ingest", "--engines", str(engines)), faust_worker.env,
                   tmp_path / "ingest.log")  # fmt: skip
    try:
        page = f"{faust_worker.url}/v1/cache/{MODEL}"
        wait_until(lambda: WORKER in get_json(page)["workers"], "the registration")
        time.sleep(1.0)  # the SUB connection settles; earlier batches would be replayed anyway
        engine.stored(0, prompt(0))
        engine.stored(1, prompt(1))
        wait_until(lambda: lookup(faust_worker, prompt(1)) == 4 * BLOCK, "seq 0-1")
        # seq 2 is never published but stays in the replay buffer: the gap is repaired.
        engine.stored(2, prompt(2), publish=False)
        engine.stored(3, prompt(3))
        wait_until(lambda: lookup(faust_worker, prompt(3)) == 4 * BLOCK, "seq 3")
        assert lookup(faust_worker, prompt(2)) == 4 * BLOCK  # came through replay
        assert get_json(page)["workers"][WORKER]["resets"] == 0
        # seq 4 is lost for good: ingest resets the worker's index, then applies seq 5.
        engine.stored(4, prompt(4), publish=False, buffer=False)
        engine.stored(5, prompt(5))
        wait_until(lambda: lookup(faust_worker, prompt(5)) == 4 * BLOCK, "seq 5")
        assert lookup(faust_worker, prompt(0)) == 0  # forgotten by the reset
        assert get_json(page)["workers"][WORKER]["resets"] == 1
        # The engine restarts: seq 0 again, with an empty cache.
        engine.buffer.clear()
        engine.stored(0, prompt(6), base_hash=77_000_000)
        wait_until(lambda: lookup(faust_worker, prompt(6)) == 4 * BLOCK, "the restart")
        state = get_json(page)["workers"][WORKER]
        assert state["resets"] == 2
        assert lookup(faust_worker, prompt(5)) == 0
        assert state["blocks"]["GPU"] == 4
    finally:
        stop(ingest)
