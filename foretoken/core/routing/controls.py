"""Staged latency controls per workload class (issue #8): pure, no I/O.

For every (workload class, worker) the controller keeps a sliding window of **queue
times** and compares their tail (the class's percentile, p95 or p99) with thresholds
derived from the class's queue-time budget
``B = objective_ttft_s − non_queue_latency_s − margin_s``:

    warn at ``warn_fraction·B``, reroute at ``reroute_fraction·B``, admission at
    ``admission_fraction·B``.

**What feeds it: requests that reached an engine.** A request enters the controls when its
grant comes on ``grants`` (:meth:`LatencyControls.observe_grant`) — the router publishes a
grant for what it forwards to an engine; the route service's own answer to ``/v1/route`` is
not enough (a decision nobody acted on, e.g. a caller that only asks, never reaches an
engine and must not make a worker look deep). **Queue time of a request** = its measured
TTFT − the time the client had already waited before this attempt (``already_waited_s``
counts toward the client's bound, never toward the worker's tail) − its non-queue part,
where the non-queue part is the own prefill the predictor predicted for it on that worker
(the grant's ``prefill_s``), or the class's ``non_queue_latency_s`` when the grant has none
(a fallback decision). Requests still waiting at their engine count too, as lower bounds
(``now − sent − non-queue part``), and so do failed or cancelled ones (their age at the
end): a worker that has stopped answering breaches instead of going silent. A request
without any outcome counts only until its **horizon** (``ControlSettings.pending_horizon_s``:
a multiple of its predicted TTFT, within a floor and the router's engine timeout); then it
is taken as lost — it leaves the worker's queued tokens and the tail, and an outcome that
comes later still gives its sample. Stuck accounting therefore cannot grow a tail for ever.

**States** ``ok → warn → reroute → admission`` and back, one stage at a time. A stage is
entered when the tail has stayed at or above its threshold for ``breach_s``; reroute and
admission also need a *corroborating signal* of the worker (a queue of prompt tokens at
some point in the window, arrivals outpacing first tokens, or timeouts/cancellations), so
a tail made by one slow prompt on an idle worker only warns. A stage is left when the tail
has stayed below ``recovery_fraction`` × its threshold for ``recovery_s`` (hysteresis:
between the two nothing changes). With too few samples in the window the tail is unknown,
which counts as calm (traffic moved away: the worker gets tried again after the window
drains).

**Actions**, consulted by :class:`foretoken.core.routing.service.Predictor`:

* ``avoid(class, worker)``: at reroute or above, the route service moves the class's request
  to a *verified* alternative (healthy for that class, same model, capacity, projected
  latency within the class's budget) — and stays put when none exists;
* ``sheds(class, worker)``: admission control. When some class ``b`` is at admission on a
  worker, best-effort (unprotected) classes of priority ≤ ``b``'s are rejected there (every
  best-effort class, when ``b`` is protected). Protected classes are kept: the controls
  never reject them (the predictor's own bound still applies), so they are never rejected
  before best-effort ones.

Every stage change is a :class:`~foretoken.wire.records.ControlEvent` with the objective, the
remaining budget, the tail and the signals; :meth:`LatencyControls.drain` hands them to the
worker, which writes them on the ``controls`` topic.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from foretoken.core.routing.classes import ControlSettings, WorkloadClass
from foretoken.core.types import (
    ControlChange,
    ControlSignals,
    ControlStage,
    RejectReason,
    RequestId,
    RequestOutcome,
    RouteDecision,
    WorkerId,
)

STAGES: tuple[ControlStage, ...] = tuple(ControlStage)
OK, WARN, REROUTE, ADMISSION = range(4)
REJECT_REASON = RejectReason.ADMISSION_CONTROL
HISTORY = 10_000
DONE_MEMORY = 100_000


@dataclass(slots=True)
class _Pending:
    klass: str
    worker: WorkerId
    sent_s: float
    non_queue_s: float
    queued_tokens: int
    already_waited_s: float = 0.0
    horizon_s: float = float("inf")


@dataclass(slots=True)
class _Track:
    """One (class, worker): its queue-time samples and its stage machine."""

    samples: deque[tuple[float, float]] = field(default_factory=deque)
    stage: int = OK
    breach_since: float | None = None
    calm_since: float | None = None
    tail_s: float | None = None
    count: int = 0


@dataclass(slots=True)
class _WorkerSignals:
    arrivals: deque[float] = field(default_factory=deque)
    services: deque[float] = field(default_factory=deque)
    timeouts: deque[float] = field(default_factory=deque)
    cancellations: deque[float] = field(default_factory=deque)
    queue_tokens: int = 0
    # (time, queued tokens) after each admission: the window's peak depth.
    depth: deque[tuple[float, int]] = field(default_factory=deque)


def _trim(values: deque[float], since_s: float) -> None:
    while values and values[0] < since_s:
        values.popleft()


class LatencyControls:
    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self.pending: dict[RequestId, _Pending] = {}
        self.tracks: dict[tuple[str, WorkerId], _Track] = {}
        self.workers: dict[WorkerId, _WorkerSignals] = {}
        self.events: list[ControlChange] = []  # not yet handed out (drain)
        self.history: deque[ControlChange] = deque(maxlen=HISTORY)
        self.transitions = 0
        # Requests already resolved: a grant re-delivered on ``grants`` is not new work.
        self.done: OrderedDict[RequestId, None] = OrderedDict()
        # Requests past their horizon without an outcome: a late outcome still gives a sample.
        self.lost: OrderedDict[RequestId, _Pending] = OrderedDict()
        self.expired = 0
        self._last_eval_s: float | None = None

    # ------------------------------------------------------------------ classes

    def resolve(self, name: str | None) -> tuple[str, WorkloadClass]:
        return self.settings.workload_class(name)

    def thresholds(self, klass: WorkloadClass) -> tuple[float, float, float]:
        b, s = klass.queue_budget_s, self.settings
        return (s.warn_fraction * b, s.reroute_fraction * b, s.admission_fraction * b)

    # ------------------------------------------------------------------ observations

    def _signals(self, worker: WorkerId) -> _WorkerSignals:
        sig = self.workers.get(worker)
        if sig is None:
            sig = self.workers[worker] = _WorkerSignals()
        return sig

    def _track(self, klass: str, worker: WorkerId) -> _Track:
        track = self.tracks.get((klass, worker))
        if track is None:
            track = self.tracks[(klass, worker)] = _Track()
        return track

    def observe_grant(self, grant: RouteDecision, now_s: float) -> None:
        """An admitted grant from ``grants`` (idempotent by request id): a request the router
        sent to an engine now waits there."""
        rid = grant.request_id
        if not grant.admitted or grant.worker_id is None or rid in self.pending or rid in self.done:
            return
        name, klass = self.resolve(grant.workload_class)
        non_queue = grant.prefill_s if grant.prefill_s is not None else klass.non_queue_latency_s
        queued = max(0, grant.prompt_tokens - grant.cached_tokens)
        sent_s = min(grant.ts, now_s)  # the decision's time on the same clock, never later
        horizon = self.settings.pending_horizon_s(grant.predicted_ttft_s, klass)
        self.pending[rid] = _Pending(name, grant.worker_id, sent_s, non_queue, queued,
                                     max(0.0, grant.already_waited_s), horizon)  # fmt: skip
        self._track(name, grant.worker_id)
        sig = self._signals(grant.worker_id)
        sig.arrivals.append(now_s)
        sig.queue_tokens += queued
        sig.depth.append((now_s, sig.queue_tokens))

    def observe_outcome(self, outcome: RequestOutcome, now_s: float) -> None:
        """A first token gives a queue-time sample; a failure before it, a lower bound."""
        rid = outcome.request_id
        late = rid not in self.pending
        found = self.lost.get(rid) if late else self.pending.get(rid)
        if found is None:
            return
        pending = found
        sig = self._signals(pending.worker)
        if outcome.actual_ttft_s is not None and outcome.status == "ok":
            # the router's TTFT includes what the client waited before: not this worker's
            waited = outcome.actual_ttft_s - pending.already_waited_s
            queue_s = max(0.0, waited - pending.non_queue_s)
            sig.services.append(now_s)
        elif outcome.kind == "completion":  # ended without a first token
            age = outcome.e2e_s if outcome.e2e_s is not None else now_s - pending.sent_s
            queue_s = max(0.0, age - pending.non_queue_s)
            cancelled = outcome.status == "cancelled"
            (sig.cancellations if cancelled else sig.timeouts).append(now_s)
        else:
            return
        if late:
            del self.lost[rid]  # its queued tokens left when it expired
        else:
            self._resolve(rid)
            sig.queue_tokens = max(0, sig.queue_tokens - pending.queued_tokens)
        self._track(pending.klass, pending.worker).samples.append((now_s, queue_s))

    # ------------------------------------------------------------------ evaluation

    def signals(self, worker: WorkerId, now_s: float) -> ControlSignals:
        sig = self._signals(worker)
        since = now_s - self.settings.window_s
        for values in (sig.arrivals, sig.services, sig.timeouts, sig.cancellations):
            _trim(values, since)
        while sig.depth and sig.depth[0][0] < since:
            sig.depth.popleft()
        span = self.settings.window_s
        return ControlSignals(
            queue_tokens=sig.queue_tokens,
            peak_queue_tokens=max(max((d for _, d in sig.depth), default=0), sig.queue_tokens),
            arrival_rps=len(sig.arrivals) / span,
            service_rps=len(sig.services) / span,
            timeouts=len(sig.timeouts),
            cancellations=len(sig.cancellations),
        )

    def corroborated(self, signals: ControlSignals) -> bool:
        """Whether the worker itself shows pressure (not one slow prompt on an idle box):
        a queue of at least ``corroborating_queue_tokens`` prompt tokens at some point in
        the window, arrivals outpacing first tokens, or timeouts/cancellations."""
        return (
            signals.peak_queue_tokens >= self.settings.corroborating_queue_tokens
            or signals.arrival_rps > signals.service_rps
            or signals.timeouts + signals.cancellations > 0
        )

    def tick(self, now_s: float) -> list[ControlChange]:
        """Re-evaluate every (class, worker) at most every ``evaluate_every_s``; returns the
        stage changes made now (also queued for :meth:`drain`)."""
        if not self.settings.enabled:
            return []
        last = self._last_eval_s
        if last is not None and now_s - last < self.settings.evaluate_every_s:
            return []
        self._last_eval_s = now_s
        self._forget_lost(now_s)
        lower_bounds: dict[tuple[str, WorkerId], list[float]] = {}
        for p in self.pending.values():
            bound = now_s - p.sent_s - p.non_queue_s
            if bound > 0:
                lower_bounds.setdefault((p.klass, p.worker), []).append(bound)
        changes: list[ControlChange] = []
        signals = {w: self.signals(w, now_s) for w in self.workers}
        for (name, worker), track in self.tracks.items():
            since = now_s - self.settings.window_s
            while track.samples and track.samples[0][0] < since:
                track.samples.popleft()
            values = [q for _, q in track.samples] + lower_bounds.get((name, worker), [])
            klass = self.resolve(name)[1]
            track.count = len(values)
            track.tail_s = (
                float(np.percentile(values, klass.percentile))
                if len(values) >= self.settings.min_samples
                else None
            )
            sig = signals.get(worker) or ControlSignals()
            event = self._step(name, klass, worker, track, sig, now_s)
            if event is not None:
                changes.append(event)
        self.events.extend(changes)
        self.history.extend(changes)
        self.transitions += len(changes)
        return changes

    def _step(
        self,
        name: str,
        klass: WorkloadClass,
        worker: WorkerId,
        track: _Track,
        sig: ControlSignals,
        now_s: float,
    ) -> ControlChange | None:
        s = self.settings
        thr = self.thresholds(klass)
        tail = track.tail_s
        stage = track.stage
        if stage < ADMISSION and tail is not None and tail >= thr[stage]:
            needs_signal = stage + 1 >= REROUTE
            if needs_signal and not self.corroborated(sig):
                track.breach_since = None
                return None
            track.calm_since = None
            if track.breach_since is None:
                track.breach_since = now_s
            if now_s - track.breach_since >= s.breach_s:
                track.breach_since = None
                return self._change(
                    name,
                    klass,
                    worker,
                    track,
                    stage + 1,
                    thr[stage],
                    sig,
                    now_s,
                    f"tail {tail:.2f}s >= {thr[stage]:.2f}s for {s.breach_s:g}s",
                )
            return None
        track.breach_since = None
        if stage > OK:
            recover_below = s.recovery_fraction * thr[stage - 1]
            if tail is None or tail < recover_below:
                if track.calm_since is None:
                    track.calm_since = now_s
                if now_s - track.calm_since >= s.recovery_s:
                    track.calm_since = None
                    why = "too few samples" if tail is None else f"tail {tail:.2f}s"
                    return self._change(
                        name,
                        klass,
                        worker,
                        track,
                        stage - 1,
                        recover_below,
                        sig,
                        now_s,
                        f"{why} < {recover_below:.2f}s for {s.recovery_s:g}s",
                    )
                return None
        track.calm_since = None
        return None

    def _change(
        self,
        name: str,
        klass: WorkloadClass,
        worker: WorkerId,
        track: _Track,
        to: int,
        threshold_s: float,
        sig: ControlSignals,
        now_s: float,
        reason: str,
    ) -> ControlChange:
        before = track.stage
        track.stage = to
        tail = track.tail_s
        return ControlChange(
            ts=now_s,
            workload_class=name,
            worker_id=worker,
            from_stage=STAGES[before],
            to_stage=STAGES[to],
            reason=reason,
            objective_ttft_s=klass.objective_ttft_s,
            percentile=klass.percentile,
            queue_budget_s=klass.queue_budget_s,
            tail_queue_s=tail,
            remaining_budget_s=None if tail is None else klass.queue_budget_s - tail,
            threshold_s=threshold_s,
            samples=track.count,
            signals=sig,
        )

    def _resolve(self, rid: RequestId) -> _Pending:
        pending = self.pending.pop(rid)
        self.done[rid] = None
        if len(self.done) > DONE_MEMORY:
            self.done.popitem(last=False)
        return pending

    def _forget_lost(self, now_s: float) -> None:
        """Requests past their horizon without an outcome leave the tail and the queue."""
        lost = [r for r, p in self.pending.items() if now_s - p.sent_s > p.horizon_s]
        for rid in lost:
            p = self._resolve(rid)
            self.expired += 1
            self.lost[rid] = p
            if len(self.lost) > DONE_MEMORY:
                self.lost.popitem(last=False)
            sig = self._signals(p.worker)
            sig.queue_tokens = max(0, sig.queue_tokens - p.queued_tokens)

    # ------------------------------------------------------------------ actions

    def stage(self, klass: str, worker: WorkerId) -> ControlStage:
        track = self.tracks.get((self.resolve(klass)[0], worker))
        return STAGES[track.stage] if track is not None else ControlStage.OK

    def avoid(self, klass: str, worker: WorkerId) -> bool:
        """Whether requests of the class should leave this worker (reroute or above)."""
        if not self.settings.enabled:
            return False
        track = self.tracks.get((self.resolve(klass)[0], worker))
        return track is not None and track.stage >= REROUTE

    def sheds(self, klass: str, worker: WorkerId, now_s: float) -> bool:
        """Whether admission control turns this class away on this worker: an unprotected
        class, when some class at admission there has at least its priority or is
        protected. Protected classes are kept (never shed)."""
        if not self.settings.enabled:
            return False
        me = self.resolve(klass)[1]
        if me.protected:
            return False
        for (other, w), track in self.tracks.items():
            if w != worker or track.stage < ADMISSION:
                continue
            breaching = self.resolve(other)[1]
            if breaching.protected or me.priority <= breaching.priority:
                return True
        return False

    def healthy(self, klass: str, worker: WorkerId, now_s: float) -> bool:
        """A possible reroute destination for the class: below reroute for that class,
        not shedding it, and no timeouts there in the window."""
        if self.avoid(klass, worker) or self.sheds(klass, worker, now_s):
            return False
        timeouts = self._signals(worker).timeouts
        _trim(timeouts, now_s - self.settings.window_s)
        return not timeouts

    # ------------------------------------------------------------------ output

    def drain(self) -> list[ControlChange]:
        out, self.events = self.events, []
        return out

    def snapshot(self, now_s: float) -> dict[str, object]:
        """The state for ``/v1/controls`` and the dashboard."""
        classes = {}
        for name, klass in self.settings.classes.items():
            warn, reroute, admission = self.thresholds(klass)
            classes[name] = {
                "objective_ttft_s": klass.objective_ttft_s,
                "percentile": klass.percentile,
                "queue_budget_s": klass.queue_budget_s,
                "priority": klass.priority,
                "protected": klass.protected,
                "max_queue_wait_s": klass.max_queue_wait_s,
                "thresholds_s": {"warn": warn, "reroute": reroute, "admission": admission},
            }
        tracks = [
            {
                "workload_class": name,
                "worker_id": worker,
                "stage": STAGES[t.stage],
                "tail_queue_s": t.tail_s,
                "samples": t.count,
            }
            for (name, worker), t in sorted(self.tracks.items())
        ]
        workers = {w: _signals_dict(self.signals(w, now_s)) for w in sorted(self.workers)}
        return {
            "enabled": self.settings.enabled,
            "default_class": self.settings.default_class,
            "classes": classes,
            "tracks": tracks,
            "signals": workers,
            "transitions": self.transitions,
            "pending": len(self.pending),
            "expired": self.expired,
        }


def _signals_dict(sig: ControlSignals) -> dict[str, float | int]:
    return {
        "queue_tokens": sig.queue_tokens,
        "peak_queue_tokens": sig.peak_queue_tokens,
        "arrival_rps": round(sig.arrival_rps, 4),
        "service_rps": round(sig.service_rps, 4),
        "timeouts": sig.timeouts,
        "cancellations": sig.cancellations,
    }
