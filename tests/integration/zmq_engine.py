"""A vLLM-protocol KV-event publisher on real ZMQ sockets (the GPU engine's stand-in for
ingest tests), and `foretoken ingest` as a real process in front of it."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from foretoken.adapters.processes import foretoken_cmd, spawn, stop
from foretoken.sim.live.vllm_wire import (
    decode_replay_request,
    encode_replay_stream,
    encode_vllm_frames,
    seq_bytes,
)
from foretoken.wire.records import BlockRemoved, BlockStored, KvEvent
from tests.conftest import RunningWorker, free_port

BLOCK = 16
WAIT_S = 60.0


class FakeEngine:
    """Real PUB + ROUTER sockets speaking vLLM's KV-event protocol; the replay buffer can be
    told to forget a batch, which makes that gap unrepairable."""

    def __init__(self, worker_id: str = "zmq-w0") -> None:
        self.worker_id = worker_id
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub_port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the tests count what arrives
        self.pub.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self.buffer: dict[int, bytes] = {}
        self.lock = threading.Lock()
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
            with self.lock:
                buffered = sorted(self.buffer.items())
            for reply in encode_replay_stream(identity, buffered, start):
                router.send_multipart(reply)
        router.close(0)

    def engines_toml(self, model: str, extra: str = "") -> str:
        return (
            f'[[engines]]\nworker_id = "{self.worker_id}"\nmodel = "{model}"\n'
            f'block_size = {BLOCK}\nhttp_url = "http://127.0.0.1:9"\n'
            f'kv_events_url = "tcp://127.0.0.1:{self.pub_port}"\n'
            f'replay_url = "tcp://127.0.0.1:{self.replay_port}"\n{extra}\n'
        )

    def events(self, seq: int, events: Sequence[KvEvent], *, publish: bool = True,
               buffer: bool = True) -> None:  # fmt: skip
        frames = encode_vllm_frames(b"", seq, time.time(), list(events), block_size=BLOCK)
        if buffer:
            with self.lock:
                self.buffer[seq] = frames[2]
        if publish:
            self.pub.send_multipart(frames)

    def stored(self, seq: int, tokens: list[int], *, publish: bool = True, buffer: bool = True,
               base_hash: int = 0) -> None:  # fmt: skip
        self.events(seq, [stored_event(tokens, base_hash + seq * 1000)], publish=publish,
                    buffer=buffer)  # fmt: skip

    def removed(self, seq: int, hashes: Sequence[int]) -> None:
        self.events(seq, [BlockRemoved(block_hashes=tuple(hashes))])

    def raw(self, frames: Sequence[bytes], *, buffer_seq: int | None = None) -> None:
        """Any frames, as they are (garbage included); optionally also in the replay buffer."""
        if buffer_seq is not None and len(frames) == 3:
            with self.lock:
                self.buffer[buffer_seq] = frames[2]
        self.pub.send_multipart(list(frames))

    def garbage(self, seq: int, payload: bytes, *, buffer: bool = True) -> None:
        """A message at ``seq`` whose payload no decoder reads."""
        self.raw([b"", seq_bytes(seq), payload], buffer_seq=seq if buffer else None)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.pub.close(0)
        self.ctx.term()


def stored_event(tokens: list[int], first_hash: int) -> BlockStored:
    n = len(tokens) // BLOCK
    return BlockStored(
        block_hashes=tuple(first_hash + i for i in range(n)),
        token_ids=tuple(tokens[: n * BLOCK]),
        block_size=BLOCK,
    )


def prompt(k: int, blocks: int = 4) -> list[int]:
    return [10_000 * (k + 1) + i for i in range(blocks * BLOCK)]


def lookup(worker: RunningWorker, model: str, tokens: list[int]) -> dict[str, Any]:
    """Every worker's hit for ``tokens`` (``/v1/cache/{model}`` POST)."""
    req = urllib.request.Request(
        f"{worker.url}/v1/cache/{model}",
        data=json.dumps({"token_ids": tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        hits: dict[str, Any] = json.loads(resp.read())["hits"]
    return hits


def cached(worker: RunningWorker, model: str, worker_id: str, tokens: list[int]) -> int:
    return int(lookup(worker, model, tokens).get(worker_id, {}).get("tokens", 0))


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class RunningIngest:
    """`foretoken ingest` as a real process, with its health page on a free port."""

    def __init__(self, engines_file: Path, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] = spawn(
            foretoken_cmd("ingest", "-e", str(engines_file), "--port", str(self.port)), env, log
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def health(self, timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def engine(self, worker_id: str) -> dict[str, Any]:
        engines: dict[str, Any] = self.health()[1]["engines"]
        return dict(engines[worker_id])

    def wait_listening(self, *worker_ids: str) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"ingest exited: {self.log.read_text()[-3000:]}")
            try:
                engines = self.health()[1]["engines"]
            except (urllib.error.URLError, OSError, ValueError):
                return False
            return all(engines[w]["listening"] and engines[w]["connected"] for w in worker_ids)

        wait_until(up, "ingest's listeners")

    def rss_kib(self) -> int:
        """Resident memory of the ingest process (its own, not the CLI wrapper's children)."""
        return rss_kib(self.proc.pid)

    def stop(self) -> None:
        stop(self.proc)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")
