"""Records a stranger (or a broken clock) puts on the input topics must not poison the
processor's state or stop an agent (found by a review, each reproduced against a live
worker first): a time stamped in the future held a worker's queue model for a day, grant
fields without bounds failed every route call for 15 minutes or pushed the latency
controls, and a dead letter carrying a whole oversized record was itself refused."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import pytest

from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.adapters.kafka.producer import fitted_dead_letter
from foretoken.settings import load_settings
from foretoken.wire.codec import decode, encode
from foretoken.wire.records import (
    DeadLetter,
    Grant,
    Outcome,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest


def _state(tmp_path: Path) -> ProcessorState:
    return ProcessorState(load_settings(env={"FORETOKEN_WORKER_DATA_DIR": str(tmp_path)}))


def _feed(state: ProcessorState, logical: str, record: object, offset: int) -> object:
    raw = record if isinstance(record, bytes) else encode(record)  # type: ignore[arg-type]
    return state.dispatcher.consume(logical, logical, b"k", raw, 0, offset)


def _predicted(state: ProcessorState, rid: str) -> float:
    request = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(1, 501)))
    grant = msgspec.json.decode(state.route(request))["grant"]
    return float(grant["predicted_ttft_s"])


def test_a_record_stamped_in_the_future_does_not_hold_the_queue_model(tmp_path: Path) -> None:
    state = _state(tmp_path)
    now = time.time()
    registration = WorkerRegistration(
        worker_id="w1", model="m", engine="vllm", engine_version="x", block_size=16,
        config_hash="h", ts=now, endpoints=WorkerEndpoints(http_url="http://127.0.0.1:1"),
    )  # fmt: skip
    _feed(state, "workers", registration, 1)
    before = _predicted(state, "p0")
    grant = Grant(request_id="evil", ts=now + 86_400, model="m", prompt_tokens=10,
                  worker_id="w1", admitted=True)  # fmt: skip
    assert _feed(state, "grants", grant, 2).dead_letter is None  # type: ignore[attr-defined]
    outcome = Outcome(request_id="evil", ts=4.0e9, kind="first_token", worker_id="w1",
                      actual_ttft_s=0.01)  # fmt: skip
    _feed(state, "outcomes", outcome, 3)
    after = _predicted(state, "p1")
    assert after < before + 5.0, f"one future record made the prediction {after:.0f} s"
    assert state.stats()["future_ts_clamped"] == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("expected_output_tokens", 1 << 62),  # every route call then failed for 15 minutes
        ("prefill_s", -1e308),  # pushed the latency controls to admission control
        ("queue_wait_s", math.inf),
        ("already_waited_s", math.nan),
        ("cached_tokens", (1 << 64) - 1),  # overflowed at the lake write instead
        ("request_id", "\x01" * 200_000),  # its graded record was too big to send
    ],
)
def test_a_grant_out_of_bounds_is_dead_lettered_naming_the_field(
    tmp_path: Path, field: str, value: object
) -> None:
    fields = {"request_id": "r1", "ts": time.time(), "model": "m", "prompt_tokens": 10,
              "worker_id": "w1", "admitted": True, field: value}  # fmt: skip
    raw = msgspec.msgpack.encode(fields)
    consumed = _state(tmp_path).dispatcher.consume("grants", "grants", b"k", raw, 0, 1)
    assert consumed.record is None and consumed.dead_letter is not None
    assert field in consumed.dead_letter.reason


def test_a_dead_letter_is_cut_to_fit_a_record() -> None:
    letter = DeadLetter(source="grants", reason="x" * 10_000, ts=1.0, key=b"k" * 5_000,
                        payload=b"\xff" * 2_000_000, partition=3, offset=9)  # fmt: skip
    for wire in ("json", "msgpack"):
        value = fitted_dead_letter(letter, 100_000, wire)  # type: ignore[arg-type]
        assert value is not None and len(value) <= 100_000
        got = decode(value, DeadLetter)
        assert got.payload_size == 2_000_000 and 0 < len(got.payload) < 100_000
        assert (got.partition, got.offset, got.source) == (3, 9, "grants")
        assert len(got.key or b"") <= 1024 and len(got.reason) <= 2000
    small = fitted_dead_letter(DeadLetter(source="s", reason="r", ts=1.0, payload=b"ab"),
                               100_000, "json")  # fmt: skip
    assert small is not None and decode(small, DeadLetter).payload == b"ab"


def test_a_worker_whose_prediction_fails_is_left_out_not_every_route_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one worker's queue model that raised (a grant with 2^62 output tokens) made
    every route call for its model a 500 until the entry aged out (15 minutes)."""
    state = _state(tmp_path)
    now = time.time()
    for i, wid in enumerate(("w1", "w2")):
        url = f"http://127.0.0.1:{i + 1}"
        _feed(state, "workers", WorkerRegistration(
            worker_id=wid, model="m", engine="vllm", engine_version="x", block_size=16,
            config_hash="h", ts=now, endpoints=WorkerEndpoints(http_url=url),
        ), i + 1)  # fmt: skip
    queue = state.core.service.predictions.book.queues["w1"]

    def broken(*args: object, **kwargs: object) -> object:
        raise ValueError("an unbounded stretch needs a time bound")

    monkeypatch.setattr(queue, "predict", broken)
    request = RouteRequest(request_id="q", model="m", token_ids=tuple(range(1, 501)))
    grant = msgspec.json.decode(state.route(request))["grant"]
    assert grant["admitted"] and grant["worker_id"] == "w2"
    stats = state.stats()
    assert stats["failed_predictions"] == 1 and "unbounded" in stats["last_failed_prediction"]["w1"]
