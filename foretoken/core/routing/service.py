"""The predictor (pure): for every worker that could serve a request, predicted TTFT = queue
wait + own prefill, and the routing and admission decision built on it (PRODUCT.md §1, §3).

It composes the cache index (what is cached where), the per-worker fits (how fast each
worker prefills, learned online from graded cold samples) and the per-worker queue models
(what is ahead, replayed through the engine's step scheduler with the settings the worker
reported). It learns only from what the real pipeline observes — registrations, KV events,
grants, outcomes and graded records — never from a simulator's truth.

Decision policy (``route``):

* candidates: every registered worker of the model; each gets a full prediction;
* choice: the lowest predicted TTFT; a conversation stays on its previous worker while that
  costs at most ``stickiness_margin_s`` more than the best alternative (its history is
  cached there: moving means a cold prefill elsewhere); a client that prefers cache hits gets
  the worker with the most cached tokens among those that meet its bound;
* admission: with a bound B (``max_queue_wait_s``), admitted iff already waited + predicted
  TTFT ≤ B; without a bound, rejected only when even the best worker's predicted queue wait
  exceeds ``overload_wait_s`` (severe overload);
* Retry-After: when the best worker's queue will have drained enough for the request to fit
  its bound (the excess of the predicted wait over what the bound leaves), clamped;
* explore: a configured fraction of would-be rejections is admitted anyway and flagged, so
  that false alarms can be measured directly;
* latency controls (optional, ``predictor/controls.py``): the request's workload class gets
  its default bound when it names none; when the class is at reroute (or shed) on the chosen
  worker, the request moves to the best *verified* alternative (healthy for the class, same
  model, capacity, projected latency within the class's budget), else stays; when the class
  is still shed there, it is rejected (``admission_control``), never explored;
* the decision is applied to the chosen worker's queue at once (concurrent requests do not
  herd onto one idle worker) and remembered by request id (a repeated call gets the same
  decision; the grant arriving later on ``grants`` does not count twice).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from foretoken.core.cost.registry import FitRegistry, prefill_sample_cached, time_per_output_token_s
from foretoken.core.index.approx import cache_source
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.queue.scheduler import CurveStepCost, NewRequest
from foretoken.core.queue.worker_queue import WorkerQueue
from foretoken.core.routing.controls import REJECT_REASON, LatencyControls
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.wire.records import (
    CandidatePrediction,
    Graded,
    Grant,
    Outcome,
    RouteRequest,
    RouteResponse,
    Tier,
    WorkerRegistration,
)

LOWER_TIERS: tuple[Tier, ...] = ("CPU", "DISK", "SHARED")
# A rejection that waiting cannot cure: the request's own prefill exceeds what its bound
# leaves. Its grant carries no Retry-After and the router tells clients not to retry.
NEVER_FITS = "prefill_exceeds_bound"
TOO_LARGE = "prompt_exceeds_kv_capacity"  # no worker of the model can hold it at all
NO_WORKER = "no_worker_for_model"
LEARNER_MAX_CACHED_SHARE = 2  # the learner rule stands aside when > 1/2 is cached elsewhere


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    explore_fraction: float = 0.02
    overload_wait_s: float = 120.0
    stickiness_margin_s: float = 0.5
    min_retry_after_s: float = 0.5
    max_retry_after_s: float = 120.0
    default_output_tokens: int = 128
    outstanding_max_age_s: float = 900.0
    decision_memory: int = 100_000
    conversation_memory: int = 100_000
    # Seconds per token to bring an offloaded block back (not learned yet: configured).
    tier_load_s_per_token: dict[str, float] = field(
        default_factory=lambda: {"CPU": 2e-6, "DISK": 1e-5, "SHARED": 5e-6}
    )
    seed: int = 0


def _fits(reg: WorkerRegistration, prompt_tokens: int) -> bool:
    """Whether the prompt fits the worker's KV cache at all (when the worker says)."""
    return reg.gpu_blocks is None or prompt_tokens < reg.gpu_blocks * reg.block_size


@dataclass(frozen=True, slots=True)
class Candidate:
    prediction: CandidatePrediction
    cached_tokens: int


class Predictor:
    def __init__(
        self,
        index: PrefixIndex,
        fits: FitRegistry | None = None,
        config: PredictorConfig | None = None,
        controls: LatencyControls | None = None,
    ) -> None:
        self.index = index
        self.controls = controls
        self.fits = fits or FitRegistry()
        self.config = config or PredictorConfig()
        self.workers: dict[WorkerId, WorkerRegistration] = {}
        self.queues: dict[WorkerId, WorkerQueue] = {}
        self.decisions: OrderedDict[RequestId, RouteResponse] = OrderedDict()
        self.conversations: OrderedDict[str, WorkerId] = OrderedDict()
        self.alone: dict[RequestId, bool] = {}  # nothing else ran there before its first token
        # busy-period samples: when each worker last finished a prefill (a first token) or,
        # on an engine that runs one sequence at a time, a whole request
        self.busy_mark_s: dict[WorkerId, float] = {}
        # Approximate mode: own hashes of prompts sent to workers without KV events, filed
        # in the index as cached there once their first token arrives (foretoken.core.index.approx).
        self.served_prompts: OrderedDict[RequestId, tuple[WorkerId, list[int]]] = OrderedDict()
        self.rng = random.Random(self.config.seed)

    # ------------------------------------------------------------------ observations

    def on_registration(self, reg: WorkerRegistration) -> None:
        self.fits.apply_registration(reg)
        if reg.removed:
            self.workers.pop(reg.worker_id, None)
            self.queues.pop(reg.worker_id, None)
            return
        self.workers[reg.worker_id] = reg
        queue = self.queues.get(reg.worker_id)
        if queue is None:
            self.queues[reg.worker_id] = WorkerQueue(reg.scheduler)
        elif queue.settings != reg.scheduler:
            queue.set_settings(reg.scheduler)

    def on_grant(self, grant: Grant, now_s: float) -> None:
        """A decision made elsewhere (another replica, the router's fallback) or our own,
        arriving on ``grants``: put it in the queue model unless it is there already."""
        if self.controls is not None:
            self.controls.observe_grant(grant, now_s)
        if grant.admitted and grant.worker_id is not None:
            expected = self.config.default_output_tokens
            self._enqueue(grant.worker_id, grant.request_id, grant.ts, grant.prompt_tokens,
                          grant.cached_tokens, expected)  # fmt: skip

    def on_outcome(self, outcome: Outcome, now_s: float) -> None:
        self._observe_served(outcome, now_s)
        if self.controls is not None:
            self.controls.observe_outcome(outcome, now_s)
        queue = self.queues.get(outcome.worker_id)
        if queue is None:
            return
        # The router's clock says when things happened; our consumption lags behind it.
        if outcome.kind == "first_token" and outcome.status == "ok":
            self._observe_busy(queue, outcome, now_s)
            queue.first_token(outcome.request_id, outcome.ts)
            return
        reg = self.workers.get(outcome.worker_id)
        if reg is not None and reg.scheduler.max_num_seqs == 1:
            self._mark_busy(outcome.worker_id, outcome.ts)  # the next prompt starts after it
        queue.finished(outcome.request_id, outcome.ts)
        tpot = None
        if outcome.e2e_s is not None and outcome.actual_ttft_s is not None:
            tpot = time_per_output_token_s(
                outcome.e2e_s, outcome.actual_ttft_s, outcome.output_tokens or 0
            )
        if tpot is not None and reg is not None:
            running = max(1.0, float(queue.running_count) + 1.0)
            self.fits.observe_decode(outcome.worker_id, reg.config_hash, tpot, running, now_s)

    def on_graded(self, graded: Graded, now_s: float) -> bool:
        """Feed the fit with a cold sample; True if this record was one."""
        wid = graded.worker_id
        alone = self.alone.pop(graded.request_id, False)
        if wid is None or wid not in self.workers:
            return False
        reg = self.workers[wid]
        # The router turns an omitted cached-token field into 0 for engines that report it,
        # so "unknown" here really is unknown: such requests are not samples.
        cached = prefill_sample_cached(graded, others_running=not alone)
        if cached is None:
            return False
        assert graded.actual_ttft_s is not None
        self.fits.observe_cold(wid, reg.config_hash, graded.prompt_tokens,
                               graded.actual_ttft_s, now_s, cached)  # fmt: skip
        return True

    def _observe_served(self, outcome: Outcome, now_s: float) -> None:
        """A prompt routed to a worker without KV events is cached there once its prefill
        is done: at its first token (or its completion, if the first token was lost)."""
        sent = self.served_prompts.get(outcome.request_id)
        if sent is None:
            return
        if outcome.kind == "completion" or outcome.status == "ok":
            del self.served_prompts[outcome.request_id]
        wid, hashes = sent
        prefilled = outcome.actual_ttft_s is not None and outcome.status != "error"
        if prefilled and wid == outcome.worker_id:
            self.index.observe_served(wid, hashes, now_s)

    def _observe_busy(self, queue: WorkerQueue, outcome: Outcome, now_s: float) -> None:
        """A busy-period prefill sample (``FitRegistry.observe_busy``): the gap between the
        worker's previous first token (on an engine that runs one sequence at a time: the
        previous completion, as it decodes before the next prompt starts) and this one, for
        a request queued there since before it — the engine never paused, and for a prompt
        of at least a step's budget (any prompt on a serial engine) its own prefill is most
        of the gap."""
        wid = outcome.worker_id
        prev = self.busy_mark_s.get(wid)
        self._mark_busy(wid, outcome.ts)
        entry = queue.get(outcome.request_id)
        reg = self.workers.get(wid)
        if entry is None or reg is None or prev is None or entry.first_token_s is not None:
            return
        if not entry.sent_at_s < prev < outcome.ts:
            return
        scheduler = reg.scheduler
        fresh = entry.prompt_tokens - entry.cached_tokens
        if scheduler.chunked_prefill and fresh < scheduler.max_num_batched_tokens:
            return  # smaller prompts share steps: the gap is not theirs alone
        self.fits.observe_busy(wid, reg.config_hash, entry.prompt_tokens, outcome.ts - prev,
                               now_s, entry.cached_tokens)  # fmt: skip

    def _mark_busy(self, wid: WorkerId, ts: float) -> None:
        if ts > self.busy_mark_s.get(wid, -math.inf):
            self.busy_mark_s[wid] = ts

    def maintain(self, now_s: float) -> None:
        if self.controls is not None:
            self.controls.tick(now_s)
        for queue in self.queues.values():
            for rid in queue.expire(now_s, self.config.outstanding_max_age_s):
                self.alone.pop(rid, None)
                self.served_prompts.pop(rid, None)
        self.index.age(now_s)

    # ------------------------------------------------------------------ predictions

    def cost_of(self, worker: WorkerId) -> CurveStepCost:
        curve = self.fits.curve(worker)
        step = self.fits.step_cost(worker)
        return CurveStepCost(curve.cost_s, step.overhead_s, step.per_seq_s)

    def predict(
        self, model: ModelName, token_ids: Sequence[int], now_s: float,
        prompt_tokens: int | None = None,
    ) -> list[Candidate]:  # fmt: skip
        n = len(token_ids) if token_ids else (prompt_tokens or 0)
        self.index.age(now_s)  # approximate views forget what their TTL says is gone
        hits = self.index.lookup(model, token_ids) if token_ids else {}
        out: list[Candidate] = []
        for wid, reg in self.workers.items():
            if reg.model != model or not _fits(reg, n):
                continue
            hit = hits.get(wid)
            cached = min(hit.tokens, n) if hit is not None else 0
            tiers = hit.by_tier() if hit is not None else {}
            load_s = sum(self.config.tier_load_s_per_token.get(t, 0.0) * tiers.get(t, 0)
                         for t in LOWER_TIERS)  # fmt: skip
            deepest = next((t for t in ("SHARED", "DISK", "CPU", "GPU") if tiers.get(t)), None)
            cost = self.cost_of(wid)
            result = self.queues[wid].predict(NewRequest(n, cached), now_s, cost)
            curve = self.fits.curve(wid)
            prefill = curve.own_prefill_s(n, cached) + load_s
            ttft = max(result.ttft_s + load_s, prefill)
            out.append(Candidate(CandidatePrediction(
                worker_id=wid, predicted_ttft_s=ttft, queue_wait_s=max(0.0, ttft - prefill),
                prefill_s=prefill, cached_tokens=cached, cached_tier=deepest,  # type: ignore[arg-type]
                queue_tokens_ahead=result.queue_tokens_ahead,
                approximate_cache=bool(hit is not None and hit.approximate)
                or not reg.has_kv_events,
                cache_source=cache_source(reg),
            ), cached))  # fmt: skip
        return out

    # ------------------------------------------------------------------ decisions

    def route(self, req: RouteRequest, now_s: float, ts: float) -> RouteResponse:
        known = self.decisions.get(req.request_id)
        if known is not None:
            return known
        if self.controls is not None:
            self.controls.tick(now_s)
            req = self._with_class_defaults(req)
        tokens = req.tokens()
        candidates = self.predict(req.model, tokens, now_s, req.prompt_tokens)
        n = req.prompt_length
        if not candidates:
            served = any(r.model == req.model for r in self.workers.values())
            reason, retry = (
                (TOO_LARGE, None) if served else (NO_WORKER, self.config.max_retry_after_s)
            )
            grant = self._grant(req, ts, n, None, admitted=False, reason=reason,
                                retry_after_s=retry)  # fmt: skip
            return self._remember(req.request_id, RouteResponse(grant=grant))
        best = self._choose(req, candidates)
        first = best.prediction.worker_id
        best, shed = self._controlled(req, best, candidates, now_s)
        admitted, reason = self._admit(req, best)
        explore = False
        retry_after = None
        if shed and self.controls is not None:
            admitted, reason = False, REJECT_REASON
            retry_after = self.controls.settings.admission_retry_after_s
        elif not admitted:
            retry_after = None if reason == NEVER_FITS else self._retry_after(req, best)
            if self.rng.random() < self.config.explore_fraction:
                admitted, explore = True, True
        grant = self._grant(
            req, ts, n, best, admitted=admitted, reason=None if admitted else reason,
            retry_after_s=retry_after, explore=explore,
            candidates=tuple(c.prediction for c in candidates),
        )  # fmt: skip
        if best.prediction.worker_id != first and admitted:
            grant = msgspec.structs.replace(grant, rerouted_from=first)
        if self.controls is not None:
            self.controls.observe_grant(grant, now_s)
        url = None
        if admitted:
            wid = best.prediction.worker_id
            expected = req.expected_output_tokens or self.config.default_output_tokens
            self._enqueue(wid, req.request_id, now_s, n, best.cached_tokens, expected)
            self._remember_prompt(req.request_id, tokens, wid)
            if req.conversation_id:
                self.conversations[req.conversation_id] = wid
                self.conversations.move_to_end(req.conversation_id)
                if len(self.conversations) > self.config.conversation_memory:
                    self.conversations.popitem(last=False)
            url = self.workers[wid].endpoints.http_url
        return self._remember(req.request_id, RouteResponse(grant=grant, http_url=url))

    def _choose(self, req: RouteRequest, candidates: list[Candidate]) -> Candidate:
        def key(c: Candidate) -> tuple[float, int]:
            return (c.prediction.predicted_ttft_s, c.prediction.queue_tokens_ahead)

        best = min(candidates, key=key)
        learner = self._learner(req, candidates)
        if learner is not None:
            return learner
        if req.prefer_cache_hit:
            fits = [c for c in candidates if self._meets(req, c)] or [best]
            return max(fits, key=lambda c: (c.cached_tokens, -key(c)[0]))
        sticky = self.conversations.get(req.conversation_id) if req.conversation_id else None
        if sticky is not None:
            mine = next((c for c in candidates if c.prediction.worker_id == sticky), None)
            margin = self.config.stickiness_margin_s
            if mine is not None and mine.prediction.predicted_ttft_s <= key(best)[0] + margin:
                return mine
        return best

    def _with_class_defaults(self, req: RouteRequest) -> RouteRequest:
        """The class's name as configured (unknown → default) and its default bound."""
        assert self.controls is not None
        name, klass = self.controls.resolve(req.workload_class)
        bound = req.max_queue_wait_s
        if bound is None:
            bound = klass.max_queue_wait_s
        if name == req.workload_class and bound == req.max_queue_wait_s:
            return req
        return msgspec.structs.replace(req, workload_class=name, max_queue_wait_s=bound)

    def _controlled(
        self, req: RouteRequest, best: Candidate, candidates: list[Candidate], now_s: float
    ) -> tuple[Candidate, bool]:
        """The latency controls' say: a verified alternative when the class must leave the
        chosen worker, and whether admission control sheds the request where it lands."""
        controls = self.controls
        if controls is None:
            return best, False
        klass_name, klass = controls.resolve(req.workload_class)
        wid = best.prediction.worker_id
        if controls.avoid(klass_name, wid) or controls.sheds(klass_name, wid, now_s):
            verified = [
                c for c in candidates
                if c.prediction.worker_id != wid
                and controls.healthy(klass_name, c.prediction.worker_id, now_s)
                and self._has_capacity(c.prediction.worker_id)
                and c.prediction.queue_wait_s <= klass.queue_budget_s
                and req.already_waited_s + c.prediction.predicted_ttft_s
                <= klass.objective_ttft_s - klass.margin_s
            ]  # fmt: skip
            if verified:
                best = min(verified, key=lambda c: c.prediction.predicted_ttft_s)
        return best, controls.sheds(klass_name, best.prediction.worker_id, now_s)

    def _has_capacity(self, wid: WorkerId) -> bool:
        """Room for one more running sequence (what the engine will let in)."""
        queue = self.queues.get(wid)
        reg = self.workers.get(wid)
        if queue is None or reg is None:
            return False
        return queue.outstanding_count < reg.scheduler.max_num_seqs

    def _learner(self, req: RouteRequest, candidates: list[Candidate]) -> Candidate | None:
        """An idle worker still on the default curve takes the request (if it meets its
        bound there): the default is deliberately pessimistic, so without this such a worker
        would never be chosen and never learn its curve (its first samples are cheap: it is
        idle, and a prefill sample needs an idle worker). Not when most of the prompt is
        cached somewhere: throwing a large hit away costs more than the sample is worth."""
        n = req.prompt_length
        if any(c.cached_tokens * LEARNER_MAX_CACHED_SHARE > n for c in candidates):
            return None
        for c in candidates:
            wid = c.prediction.worker_id
            idle = all(o.first_token_s is not None for o in self.queues[wid].outstanding())
            if self.fits.curve(wid).default and idle and self._meets(req, c):
                return c
        return None

    def _meets(self, req: RouteRequest, c: Candidate) -> bool:
        if req.max_queue_wait_s is None:
            return True
        return req.already_waited_s + c.prediction.predicted_ttft_s <= req.max_queue_wait_s

    def _admit(self, req: RouteRequest, best: Candidate) -> tuple[bool, str]:
        if req.max_queue_wait_s is not None:
            if req.already_waited_s + best.prediction.prefill_s > req.max_queue_wait_s:
                return False, NEVER_FITS  # even an idle worker could not: do not retry
            return self._meets(req, best), "predicted_ttft_exceeds_bound"
        return best.prediction.queue_wait_s <= self.config.overload_wait_s, "overloaded"

    def _retry_after(self, req: RouteRequest, best: Candidate) -> float:
        p = best.prediction
        if req.max_queue_wait_s is not None:
            excess = req.already_waited_s + p.predicted_ttft_s - req.max_queue_wait_s
        else:
            excess = p.queue_wait_s - self.config.overload_wait_s
        wait = min(excess, p.queue_wait_s) if p.queue_wait_s > 0 else excess
        return min(max(wait, self.config.min_retry_after_s), self.config.max_retry_after_s)

    def _enqueue(self, wid: WorkerId, rid: RequestId, sent_s: float, n: int, cached: int,
                 expected: int) -> None:  # fmt: skip
        queue = self.queues.get(wid)
        if queue is None:
            return
        # "Alone" for a prefill sample: no other prompt waiting or prefilling here when it
        # was sent, and none sent before its first token. Requests that are only decoding
        # are allowed: under steady load a worker is rarely empty, and a decode adds
        # milliseconds per step to a prefill of hundreds of milliseconds or more.
        was_idle = all(o.first_token_s is not None for o in queue.outstanding())
        if queue.add(rid, sent_s, n, cached, expected):
            for other in queue.outstanding():
                if other.request_id != rid and other.first_token_s is None:
                    self.alone[other.request_id] = False
            self.alone[rid] = was_idle

    def _remember_prompt(self, rid: RequestId, tokens: Sequence[int], wid: WorkerId) -> None:
        reg = self.workers[wid]
        if reg.has_kv_events or not tokens:
            return
        owns = self.index.hash_prompt(reg.model, reg.block_size, tokens).tolist()
        self.served_prompts[rid] = (wid, owns)
        if len(self.served_prompts) > self.config.decision_memory:
            self.served_prompts.popitem(last=False)

    def _remember(self, rid: RequestId, resp: RouteResponse) -> RouteResponse:
        self.decisions[rid] = resp
        if len(self.decisions) > self.config.decision_memory:
            self.decisions.popitem(last=False)
        return resp

    def _grant(
        self, req: RouteRequest, ts: float, n: int, best: Candidate | None, *, admitted: bool,
        reason: str | None, retry_after_s: float | None, explore: bool = False,
        candidates: tuple[CandidatePrediction, ...] = (),
    ) -> Grant:  # fmt: skip
        p = best.prediction if best is not None else None
        fit = self.fits.curve(p.worker_id).to_fit_used() if p is not None else None
        return Grant(
            request_id=req.request_id, ts=ts, model=req.model,
            workload_class=req.workload_class, prompt_tokens=n,
            worker_id=p.worker_id if p is not None and admitted else None,
            admitted=admitted, reject_reason=reason,
            retry_after_s=None if retry_after_s is None else round(retry_after_s, 3),
            predicted_ttft_s=p.predicted_ttft_s if p else None,
            queue_wait_s=p.queue_wait_s if p else None, prefill_s=p.prefill_s if p else None,
            cached_tokens=p.cached_tokens if p else 0, cached_tier=p.cached_tier if p else None,
            approximate_cache=p.approximate_cache if p else False,
            cache_source=p.cache_source if p else "events",
            queue_tokens_ahead=p.queue_tokens_ahead if p else 0, fit=fit,
            max_queue_wait_s=req.max_queue_wait_s, already_waited_s=req.already_waited_s,
            explore=explore, conversation_id=req.conversation_id, candidates=candidates,
        )  # fmt: skip
