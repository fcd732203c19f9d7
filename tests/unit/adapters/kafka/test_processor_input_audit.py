"""Records on the input topics that decoded but then broke a timer or the join (found by an
audit, each reproduced against a live worker first): a grant the graded record could not
carry crashed the join's expiry timer — and with it the whole processor, again after every
restart (its ack was held) —, a grant naming the worker "" crashed the latency controls'
timer, and grants naming made-up workers grew the controls and their metrics without bound."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from foretoken.adapters.kafka.processor import ProcessorState
from foretoken.core.grading.join import GradingJoin
from foretoken.settings import load_settings
from foretoken.wire.codec import encode
from foretoken.wire.records import Grant, Outcome, WorkerEndpoints, WorkerRegistration


def _state(tmp_path: Path) -> ProcessorState:
    state = ProcessorState(load_settings(env={"FORETOKEN_WORKER_DATA_DIR": str(tmp_path)}))
    registration = WorkerRegistration(
        worker_id="w1", model="m", engine="vllm", engine_version="x", block_size=16,
        config_hash="h", ts=time.time(), endpoints=WorkerEndpoints(http_url="http://127.0.0.1:1"),
    )  # fmt: skip
    state.dispatcher.consume("workers", "workers", b"w1", encode(registration), 0, 0)
    return state


BAD_FIT = {"a": 0.0, "b": 1e-3, "samples": -1, "version": 0, "default": True}


def _grant_fields(rid: str, **kw: object) -> dict[str, object]:
    fields: dict[str, object] = {"request_id": rid, "ts": time.time(), "model": "m",
                                 "prompt_tokens": 10, "worker_id": "w1", "admitted": True,
                                 "predicted_ttft_s": 0.1}  # fmt: skip
    return fields | kw


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("fit.samples", {"fit": BAD_FIT}),
        ("reject_reason", {"reject_reason": "x" * 2000}),
        ("worker_id", {"worker_id": ""}),
        ("rerouted_from", {"rerouted_from": ""}),
    ],
)
def test_a_grant_its_graded_record_or_control_event_cannot_carry_is_dead_lettered(
    tmp_path: Path, field: str, fields: dict[str, object]
) -> None:
    state = _state(tmp_path)
    raw = msgspec.msgpack.encode(_grant_fields("bad", **fields))
    consumed = state.dispatcher.consume("grants", "grants", b"bad", raw, 0, 1)
    assert consumed.record is None and consumed.dead_letter is not None
    assert field in consumed.dead_letter.reason
    assert "bad" not in state.core.join.pending


def test_an_ungradable_request_is_dropped_not_raised_with_the_others_of_the_pass() -> None:
    """Before: the expiry pass raised at the first request it could not grade, losing the
    grades of those it had settled before it; in the processor's timer that crashed the app."""
    sizes = {"w1": 16, "bad": -1}  # a block size no graded record can carry
    join = GradingJoin(block_size_of=sizes.get, timeout_s=10.0)
    for rid, worker in (("good1", "w1"), ("bad", "bad"), ("good2", "w1")):
        grant = Grant(request_id=rid, ts=1.0, model="m", prompt_tokens=10, worker_id=worker,
                      admitted=True, predicted_ttft_s=0.1)  # fmt: skip
        assert join.on_grant(grant, 0.0) == []
    graded = join.expire(100.0)
    assert sorted(g.request_id for g in graded) == ["good1", "good2"]
    assert join.counters.ungradable == 1 and not join.pending
    # and a completion that settles such a request is not dead-lettered for it
    grant = Grant(request_id="bad2", ts=1.0, model="m", prompt_tokens=10, worker_id="bad",
                  admitted=True)  # fmt: skip
    join.on_grant(grant, 200.0)
    done = Outcome(request_id="bad2", ts=2.0, kind="completion", worker_id="bad",
                   actual_ttft_s=0.1)  # fmt: skip
    assert join.on_outcome(done, 201.0) == [] and join.counters.ungradable == 2


def test_grants_naming_made_up_workers_leave_no_state_in_the_controls(tmp_path: Path) -> None:
    """Before: 30,000 grants under made-up worker ids made 30,000 controls tracks and metric
    label sets for ever; every evaluation (each second, on the event loop) then took 7 s."""
    state = _state(tmp_path)
    for i in range(200):
        raw = encode(Grant(**_grant_fields(f"r{i}", worker_id=f"fake{i}")))  # type: ignore[arg-type]
        assert state.dispatcher.consume("grants", "grants", b"k", raw, 0, i + 1).dead_letter is None
    raw = encode(Grant(**_grant_fields("real")))  # type: ignore[arg-type]
    state.dispatcher.consume("grants", "grants", b"k", raw, 0, 500)
    controls = state.controls
    assert controls is not None
    assert set(controls.workers) == {"w1"} and list(controls.pending) == ["real"]
    state.control_events()
    assert {w for _, w in controls.tracks} == {"w1"}
