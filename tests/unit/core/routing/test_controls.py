"""The staged latency controls (predictor/controls.py): no flapping, staged escalation and
recovery, corroboration, best-effort shed before protected, reroute only to verified
destinations."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.controls import LatencyControls
from foretoken.core.routing.service import RouteService
from foretoken.core.types import RequestId, RouteDecision, WorkerId
from foretoken.settings import ControlSettings, SettingsError, WorkloadClass, load_settings
from foretoken.wire.codec import decode, encode
from foretoken.wire.records import (
    ControlEvent,
    Grant,
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
    as_record,
)
from foretoken.wire.route_rpc import RouteRequest

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
INTERACTIVE = WorkloadClass(objective_ttft_s=5.0, non_queue_latency_s=1.0, margin_s=0.0,
                            priority=10, protected=True)  # fmt: skip  # budget 4 s
BATCH = WorkloadClass(objective_ttft_s=60.0, non_queue_latency_s=5.0, margin_s=5.0, priority=0)


def _settings(**kw: object) -> ControlSettings:
    base: dict[str, object] = {
        "default_class": "interactive",
        "classes": {"interactive": INTERACTIVE, "batch": BATCH},
        "window_s": 10.0,
        "min_samples": 3,
        "breach_s": 5.0,
        "recovery_s": 8.0,
        "evaluate_every_s": 1.0,
    }
    base.update(kw)
    return ControlSettings(**base)  # type: ignore[arg-type]


_IDS = itertools.count()


class Driver:
    """Feeds a controller grants and first tokens with chosen queue times, on a fake clock."""

    def __init__(self, controls: LatencyControls) -> None:
        self.c = controls
        self.ids = _IDS  # request ids unique across drivers of one controller
        self.events: list[ControlEvent] = []

    def request(
        self,
        t: float,
        queue_s: float,
        klass: str = "interactive",
        worker: WorkerId = W0,
        prefill_s: float = 0.5,
    ) -> None:
        rid = RequestId(f"r{next(self.ids)}")
        self._grant(rid, t, klass, worker, prompt_tokens=1000, prefill_s=prefill_s)
        ttft = queue_s + prefill_s
        self.c.observe_outcome(
            Outcome(request_id=rid, ts=t, kind="first_token", worker_id=worker, actual_ttft_s=ttft),
            t,
        )

    def backlog(self, t: float, klass: str = "interactive", worker: WorkerId = W0) -> None:
        """A request sent and not answered: queued tokens, the corroborating signal."""
        rid = RequestId(f"pending{next(self.ids)}")
        self._grant(rid, t, klass, worker, prompt_tokens=10_000, prefill_s=1e8)

    def _grant(
        self,
        rid: RequestId,
        t: float,
        klass: str,
        worker: WorkerId,
        *,
        prompt_tokens: int,
        prefill_s: float,
    ) -> None:
        """An admitted grant of model ``m``, observed at ``t``."""
        grant = Grant(request_id=rid, ts=t, model="m", workload_class=klass,
                      prompt_tokens=prompt_tokens, worker_id=worker, admitted=True,
                      prefill_s=prefill_s)  # fmt: skip
        self.c.observe_grant(grant, t)

    def run(self, start: float, end: float, queue_of: object, **kw: object) -> None:
        t = start
        while t < end:
            self.request(t, queue_of(t), **kw)  # type: ignore[operator, arg-type]
            self.events += self.c.tick(t)
            t += 0.5


def test_thresholds_come_from_the_class_budget() -> None:
    c = LatencyControls(_settings())
    assert INTERACTIVE.queue_budget_s == pytest.approx(4.0)
    assert c.thresholds(INTERACTIVE) == pytest.approx((2.0, 3.0, 4.0))
    assert BATCH.queue_budget_s == pytest.approx(50.0)


def test_no_flapping_when_queue_time_oscillates_around_a_threshold() -> None:
    c = LatencyControls(_settings(window_s=1.0))  # a short window: the tail follows the input
    d = Driver(c)
    d.backlog(0.0)
    # Around the warn threshold (2 s), switching every 2 s (< breach_s): never escalates.
    d.run(0.0, 60.0, lambda t: 2.4 if int(t / 2) % 2 else 1.6)
    assert d.events == []
    # Held above it: one step to warn. Then oscillating ±20% around the threshold (inside the
    # hysteresis band, above 0.7 × 2 s) never leaves warn, nor do dips below the recovery
    # threshold that are shorter than recovery_s.
    d.run(60.0, 80.0, lambda t: 2.5)
    assert [e.to_stage for e in d.events] == ["warn"]
    d.run(80.0, 200.0, lambda t: 2.4 if int(t / 7) % 2 else 1.6)
    d.run(200.0, 300.0, lambda t: 2.4 if int(t) % 8 < 3 else 0.5)
    assert [e.to_stage for e in d.events] == ["warn"]
    assert c.stage("interactive", W0) == "warn"


def test_staged_escalation_and_recovery_one_stage_at_a_time() -> None:
    c = LatencyControls(_settings())
    d = Driver(c)
    d.backlog(0.0)
    d.run(0.0, 40.0, lambda t: 9.0)  # far past the admission threshold (4 s)
    ups = [(e.from_stage, e.to_stage) for e in d.events]
    assert ups == [("ok", "warn"), ("warn", "reroute"), ("reroute", "admission")]
    times = [e.ts for e in d.events]
    assert all(b - a >= 5.0 for a, b in itertools.pairwise(times))  # each stage its own breach
    top = d.events[-1]
    assert top.objective_ttft_s == 5.0 and top.queue_budget_s == pytest.approx(4.0)
    assert top.tail_queue_s is not None and top.tail_queue_s >= 4.0
    assert top.remaining_budget_s == pytest.approx(4.0 - top.tail_queue_s)
    assert top.signals.queue_tokens > 0 and top.reason
    d.events.clear()
    d.run(40.0, 120.0, lambda t: 0.2)
    downs = [(e.from_stage, e.to_stage) for e in d.events]
    assert downs == [("admission", "reroute"), ("reroute", "warn"), ("warn", "ok")]
    times = [e.ts for e in d.events]
    assert all(b - a >= 8.0 for a, b in itertools.pairwise(times))
    assert all(decode(encode(e), ControlEvent) == as_record(ControlEvent, e) for e in d.events)


def test_a_slow_tail_without_pressure_on_the_worker_only_warns() -> None:
    c = LatencyControls(_settings())
    d = Driver(c)  # no backlog: nothing queued, first tokens keep up with arrivals
    d.run(0.0, 60.0, lambda t: 9.0)
    assert [e.to_stage for e in d.events] == ["warn"]
    assert not c.avoid("interactive", W0)


def test_requests_stuck_without_a_first_token_count_as_queue_time() -> None:
    c = LatencyControls(_settings())
    d = Driver(c)
    for i in range(5):
        rid = RequestId(f"stuck{i}")
        c.observe_grant(
            Grant(
                request_id=rid,
                ts=0.0,
                model="m",
                workload_class="interactive",
                prompt_tokens=2000,
                worker_id=W1,
                admitted=True,
                prefill_s=0.1,
            ),
            0.0,
        )
    for t in range(0, 40):
        d.events += c.tick(float(t))
    assert [e.to_stage for e in d.events][:3] == ["warn", "reroute", "admission"]
    assert c.avoid("interactive", W1)


def test_controls_off_never_acts() -> None:
    c = LatencyControls(_settings(enabled=False))
    d = Driver(c)
    d.backlog(0.0)
    d.run(0.0, 60.0, lambda t: 9.0)
    assert d.events == [] and not c.avoid("interactive", W0)
    assert not c.sheds("batch", W0, 60.0)


def _drive(c: LatencyControls, pairs: list[tuple[str, WorkerId]], start: float = 0.0) -> float:
    """Drive every (class, worker) of ``pairs`` to admission at the same time, through
    observations; returns the clock after."""
    d = Driver(c)
    for klass, worker in pairs:
        d.backlog(start, klass, worker)
    t = start
    while t < start + 40.0:
        for klass, worker in pairs:
            d.request(t, 1000.0, klass=klass, worker=worker)
        c.tick(t)
        t += 0.5
    assert all(c.stage(klass, w) == "admission" for klass, w in pairs)
    return t


def _at_admission(
    c: LatencyControls, klass: str, worker: WorkerId, also: tuple[WorkerId, ...] = ()
) -> float:
    return _drive(c, [(klass, w) for w in (worker, *also)])


def test_best_effort_is_shed_and_a_protected_class_is_kept() -> None:
    c = LatencyControls(_settings())
    clock = _at_admission(c, "interactive", W0)
    assert c.sheds("batch", W0, clock)
    assert not c.sheds("interactive", W0, clock)  # protected: kept, even at admission itself
    assert not c.sheds("batch", W1, clock)  # only on the breaching worker


def test_a_low_priority_breach_does_not_shed_higher_priority_work() -> None:
    c = LatencyControls(_settings())
    _at_admission(c, "batch", W0)
    assert c.sheds("batch", W0, 40.0)
    assert not c.sheds("interactive", W0, 40.0)


names = st.sampled_from(["a", "b", "c", "d"])


@settings(max_examples=60, deadline=None)
@given(
    spec=st.dictionaries(names, st.tuples(st.integers(0, 3), st.booleans()), min_size=2),
    breaching=st.sets(names, min_size=1),
)
def test_protected_classes_are_never_rejected_before_best_effort_ones(
    spec: dict[str, tuple[int, bool]], breaching: set[str]
) -> None:
    classes = {
        n: WorkloadClass(
            objective_ttft_s=5.0, non_queue_latency_s=1.0, margin_s=0.0, priority=p, protected=prot
        )
        for n, (p, prot) in spec.items()
    }
    default = sorted(classes)[0]
    c = LatencyControls(_settings(classes=classes, default_class=default))
    clock = _drive(c, [(name, W0) for name in sorted(breaching & set(classes))])
    shed = {n: c.sheds(n, W0, clock) for n in classes}
    best_effort = [n for n, k in classes.items() if not k.protected]
    at_admission = [classes[n] for n in breaching & set(classes)]
    for name, klass in classes.items():
        if klass.protected:
            assert not shed[name], (shed, spec)  # kept, whatever breaches
        elif any(b.protected or klass.priority <= b.priority for b in at_admission):
            assert shed[name], (shed, spec)  # best-effort at or below a breach: shed
        else:
            assert not shed[name], (shed, spec)  # above every breaching best-effort class
    if any(b.protected for b in at_admission):
        assert all(shed[b] for b in best_effort)  # a protected breach sheds all best-effort


# ---------------------------------------------------------------------- with the RouteService

BLOCK = 16


def _reg(wid: str) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=wid,
        model="m",
        engine="vllm",
        engine_version="x",
        block_size=BLOCK,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
        endpoints=WorkerEndpoints(http_url=f"http://{wid}"),
        config_hash="c",
        ts=0.0,
    )


def _predictor(controls: LatencyControls, n: int = 3) -> RouteService:
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0), controls=controls)
    for i in range(n):
        reg = _reg(f"w{i}")
        index.register_worker(reg.worker_id, reg.model, reg.block_size)
        p.on_registration(reg)
    return p


def _route(
    p: RouteService, rid: str, t: float, klass: str = "interactive", n: int = 256
) -> RouteDecision:
    req = RouteRequest(
        request_id=RequestId(rid),
        model="m",
        token_ids=tuple(range(n)),  # type: ignore[arg-type]
        workload_class=klass,
    )
    return p.route(req.query(), t, t)


def test_reroute_goes_only_to_a_verified_destination() -> None:
    c = LatencyControls(_settings())
    p = _predictor(c)
    first = _route(p, "probe", 0.0).worker_id
    assert first is not None
    others = [w for w in (W0, W1, W2) if w != first]
    clock = _at_admission(c, "interactive", first, also=(others[0],))  # others[0]: unhealthy
    # The one remaining worker's projected latency is far past the class's budget.
    for i in range(4):
        p.book.queues[others[1]].add(RequestId(f"pin{i}"), clock, 60_000, 0, 10)
    g = _route(p, "stays", clock)
    # No verified alternative: it stays put (protected: kept, not shed).
    assert g.rerouted_from is None and g.admitted
    assert g.worker_id in (first, others[0])
    for i in range(4):
        p.book.queues[others[1]].finished(RequestId(f"pin{i}"), clock)
    # Now a little busier than the avoided workers (so not the first choice), but within
    # the class's budget: a verified destination.
    p.book.queues[others[1]].add(RequestId("small"), clock, 2000, 0, 10)
    g = _route(p, "moves", clock)
    assert g.admitted and g.worker_id == others[1] and g.rerouted_from in (first, others[0])


def test_admission_control_rejects_best_effort_with_a_reason_and_retry_after() -> None:
    c = LatencyControls(_settings())
    p = _predictor(c, n=1)
    _at_admission(c, "interactive", W0)
    g = _route(p, "b1", 40.0, klass="batch")
    assert not g.admitted and g.reject_reason == "admission_control"
    assert g.retry_after_s == c.settings.admission_retry_after_s and not g.explore


def test_unknown_class_falls_back_to_the_default_and_its_bound_applies() -> None:
    klass = WorkloadClass(objective_ttft_s=20.0, max_queue_wait_s=15.0)
    c = LatencyControls(_settings(classes={"std": klass}, default_class="std"))
    p = _predictor(c, n=1)
    g = _route(p, "x", 0.0, klass="nope")
    assert g.workload_class == "std" and g.max_queue_wait_s == 15.0


def test_settings_classes_from_toml(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "s.toml"
    path.write_text(
        '[controls]\ndefault_class = "chat"\n'
        "[controls.classes.chat]\nobjective_ttft_s = 3\nnon_queue_latency_s = 1\n"
        "margin_s = 0.5\npriority = 5\nprotected = true\nmax_queue_wait_s = 10\n"
    )
    s = load_settings(path, env={})
    name, chat = s.controls.workload_class(None)
    assert name == "chat" and chat.queue_budget_s == pytest.approx(1.5) and chat.protected
    path.write_text('[controls]\ndefault_class = "missing"\n')
    with pytest.raises(SettingsError, match="default_class"):
        load_settings(path, env={})
    path.write_text("[controls.classes.default]\nobjective_ttft_s = 1\n")
    with pytest.raises(SettingsError, match="budget"):
        load_settings(path, env={})
