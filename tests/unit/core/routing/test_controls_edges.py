"""Issue 16's findings on the latency controls, on the core in virtual time: what feeds the
tail (requests that reached an engine only), a client's time already waited, a pending grant
that never gets an outcome, and one worker's stuck accounting against healthy workers."""

from __future__ import annotations

import dataclasses

import pytest

from foretoken.compose import control_settings
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.service import RouteService
from foretoken.core.types import ControlStage, RequestId, RouteQuery, WorkerId
from foretoken.settings import ControlSettings, WorkloadClass, load_settings
from foretoken.wire.records import (
    Grant,
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
# Budget 3 s: admission at a 3 s tail.
FAST = WorkloadClass(objective_ttft_s=4.0, non_queue_latency_s=0.5, margin_s=0.5)


def _settings(**kw: object) -> ControlSettings:
    base: dict[str, object] = {
        "classes": {"default": FAST}, "window_s": 20.0, "min_samples": 4, "breach_s": 2.0,
        "recovery_s": 4.0, "evaluate_every_s": 0.5, "corroborating_queue_tokens": 1,
    }  # fmt: skip
    base.update(kw)
    return ControlSettings(**base)  # type: ignore[arg-type]


def _service(controls: LatencyControls, n: int = 3) -> RouteService:
    index = PrefixIndex()
    service = RouteService(index, config=PredictorConfig(explore_fraction=0.0), controls=controls)
    for i in range(n):
        reg = WorkerRegistration(
            worker_id=WorkerId(f"w{i}"), model="m", engine="vllm", engine_version="x",
            block_size=16, scheduler=SchedulerSettings(max_num_batched_tokens=2048,
                                                       max_num_seqs=64),
            endpoints=WorkerEndpoints(http_url=f"http://w{i}"), config_hash="c", ts=0.0,
        )  # fmt: skip
        index.register_worker(reg.worker_id, reg.model, reg.block_size)
        service.on_registration(reg)
    return service


def _grant(rid: str, t: float, worker: WorkerId, **kw: object) -> Grant:
    fields: dict[str, object] = {
        "request_id": RequestId(rid), "ts": t, "model": "m", "workload_class": "default",
        "prompt_tokens": 8000, "worker_id": worker, "admitted": True, "prefill_s": 0.2,
        "predicted_ttft_s": 0.3,
    }  # fmt: skip
    fields.update(kw)
    return Grant(**fields)  # type: ignore[arg-type]


def _stages(c: LatencyControls) -> set[ControlStage]:
    tracks: list[dict[str, str]] = c.snapshot(0.0)["tracks"]  # type: ignore[assignment]
    return {ControlStage(t["stage"]) for t in tracks}


def test_route_answers_nobody_acted_on_never_put_idle_workers_into_admission() -> None:
    """Finding 8: 90 POSTs of prompt_tokens 8000 to /v1/route, no traffic behind them."""
    c = LatencyControls(_settings())
    service = _service(c)
    for i in range(90):
        query = RouteQuery(request_id=RequestId(f"probe{i}"), model="m", tokens=(),
                           prompt_tokens=8000)  # fmt: skip
        assert service.route(query, 0.0, 0.0).admitted
    deep = sum(q.queued_tokens_ahead for q in service.book.queues.values())
    assert deep > 8000 * 30  # the queue models took them at once (no herding)
    for t in range(0, 120):
        service.maintain(float(t))
    assert c.pending == {} and _stages(c) <= {ControlStage.OK}
    assert not any(c.sheds("default", w, 120.0) for w in (W0, W1, W2))
    # ... and once no grant came back for them, the queue models forgot them too.
    assert service.unconfirmed_expired == 90
    assert all(q.outstanding_count == 0 for q in service.book.queues.values())
    tight = RouteQuery(request_id=RequestId("after"), model="m", tokens=(), prompt_tokens=500,
                       max_queue_wait_s=5.0)  # fmt: skip
    assert service.route(tight, 120.0, 120.0).admitted
    # The same decisions acted on (their grants on `grants`) do count.
    for i in range(90):
        service.on_grant(service.decisions[RequestId(f"probe{i}")], 120.0)
    assert len(c.pending) == 90


def test_time_already_waited_counts_toward_the_bound_never_toward_the_tail() -> None:
    """Finding 8: `x-already-waited-s: 100` on a few requests put a worker into admission."""
    c = LatencyControls(_settings())
    t = 0.0
    for i in range(40):
        rid = f"waited{i}"
        c.observe_grant(_grant(rid, t, W0, already_waited_s=100.0), t)
        # The router's TTFT counts from the client's first try: 100 s + 0.3 s here.
        c.observe_outcome(Outcome(request_id=RequestId(rid), ts=t, kind="first_token",
                                  worker_id=W0, actual_ttft_s=100.3), t)  # fmt: skip
        c.tick(t)
        t += 0.5
    track = c.snapshot(t)["tracks"][0]  # type: ignore[index]
    assert track["tail_queue_s"] == pytest.approx(0.1, abs=1e-6)
    assert track["stage"] == "ok"


def test_a_stuck_pending_grant_expires_on_a_horizon_from_its_prediction() -> None:
    """Finding 8: a grant without an outcome counted in the tail for 900 s."""
    c = LatencyControls(_settings(min_samples=1, pending_horizon_min_s=10.0))
    c.observe_grant(_grant("stuck", 0.0, W0, predicted_ttft_s=2.0), 0.0)  # horizon 10 s
    c.tick(5.0)
    assert c.signals(W0, 5.0).queue_tokens == 8000
    assert c.snapshot(5.0)["tracks"][0]["tail_queue_s"] == pytest.approx(4.8)  # type: ignore[index]
    c.tick(10.5)
    assert c.pending == {} and c.expired == 1
    assert c.signals(W0, 10.5).queue_tokens == 0
    assert c.snapshot(10.5)["tracks"][0]["tail_queue_s"] is None  # type: ignore[index]
    # A first token that comes after all is still a sample (it did reach an engine).
    c.observe_outcome(Outcome(request_id=RequestId("stuck"), ts=12.0, kind="first_token",
                              worker_id=W0, actual_ttft_s=12.0), 12.0)  # fmt: skip
    c.tick(12.0)
    assert c.snapshot(12.0)["tracks"][0]["tail_queue_s"] == pytest.approx(11.8)  # type: ignore[index]
    # A long prediction gets a longer horizon, but never past the cap.
    klass = c.resolve("default")[1]
    assert c.settings.pending_horizon_s(20.0, klass) == pytest.approx(80.0)
    assert c.settings.pending_horizon_s(1e6, klass) == c.settings.pending_max_age_s


def test_the_processor_caps_the_horizon_at_the_routers_engine_timeout() -> None:
    settings = load_settings(env={"FORETOKEN__ROUTER__ENGINE_TIMEOUT_S": "20"})
    capped = control_settings(settings)
    assert capped.pending_max_age_s == 20.0 and capped.pending_horizon_min_s == 20.0
    default = control_settings(load_settings(env={}))
    assert default.pending_max_age_s == 600.0  # the router's default engine timeout
    assert default.pending_horizon_s(None, default.classes["default"]) == 120.0  # 4 x 30 s


def test_one_workers_stuck_accounting_never_turns_away_what_healthy_workers_can_serve() -> None:
    """Finding 8: one worker's queue was stuck at 24,041 tokens in the controls (the predictor
    saw 41) and every request got 429. Here that worker is at admission from grants that will
    never be answered; requests the predictor sends there go to a healthy worker instead —
    even one the controls' own verification (within the class's objective) would refuse, as
    long as the request's own bound is met."""
    klass = WorkloadClass(objective_ttft_s=0.2, non_queue_latency_s=0.05, margin_s=0.05)
    c = LatencyControls(_settings(classes={"default": klass}, min_samples=4, breach_s=1.0,
                                  pending_horizon_min_s=600.0))  # fmt: skip
    service = _service(c)
    query = RouteQuery(request_id=RequestId("q"), model="m", tokens=tuple(range(4096)),
                       prompt_tokens=4096, max_queue_wait_s=60.0)  # fmt: skip
    candidates = service.predict("m", query.tokens, 0.0, query.prompt_tokens)
    first = service.decider.choose(query, candidates).prediction.worker_id
    fastest = min(c.prediction.predicted_ttft_s for c in candidates)
    assert fastest > klass.objective_ttft_s - klass.margin_s  # no verified destination
    for i in range(30):  # answered never: the controls' stuck accounting on `first`
        c.observe_grant(_grant(f"lost{i}", 0.0, first, prompt_tokens=800), 0.0)
    t = 0.0
    while t < 10.0:
        c.tick(t)
        t += 0.5
    assert c.stage("default", first) == ControlStage.ADMISSION
    served = [
        service.route(dataclasses.replace(query, request_id=RequestId(f"r{i}")), t, t)
        for i in range(10)
    ]
    assert all(d.admitted for d in served), [d.reject_reason for d in served]
    assert all(d.worker_id != first for d in served)
