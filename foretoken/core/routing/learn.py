"""Learning from what the pipeline observes — outcomes and graded requests — never from a
simulator's truth (PRODUCT.md §1 "How fast the worker prefills"):

* **cold samples** (:meth:`Learner.on_graded`): a request that ran alone on its worker with
  known reuse is a prefill sample, ``TTFT ≈ C(N) − C(cached)``;
* **busy-period samples** (:meth:`Learner.on_first_token`): a worker never idle from a cold
  start would never give one, so a second, bootstrap fit takes the gap between the worker's
  previous first token and this one, for a request queued there since before it; and a
  prompt held back by a full engine (every seat taken, or its KV blocks do not fit, with
  nothing prefilling) that a completion let start alone is a sample from that completion
  to its first token (:meth:`Learner._note_unblock`: under KV-blocked load the chains
  break at every first token, and such a worker had 2–4 samples in 170 first tokens);
* **decode samples** (:meth:`Learner.on_completion`): a decode step's time against the
  time-mean number of requests decoding over the request's decode window
  (:mod:`foretoken.core.cost.decode_windows`), for the step-cost fit. The router times the
  gaps between streamed tokens and the outcome carries the step of the fast ones
  (:func:`foretoken.core.cost.samples.decode_step_s`: steps that carried no other prompt's
  chunk), left out when prompts waited throughout and it looks like a chunked step —
  judged on the worker's curve, so such steps are held until it has one (the default
  curve's ``a`` made a 60 ms step with a chunk in it look decode-only);
  Without it (a stream not timed), the time per output token less the prefill of the
  prompts whose first token came during the window;
* **residuals** (:meth:`Learner.on_graded`): every served request's predicted and measured
  TTFT calibrate the upper quantiles grants carry (:mod:`foretoken.core.cost.quantiles`);
* **approximate cache credit**: a prompt routed to a worker without KV events is filed as
  cached there once its prefill is done (:mod:`foretoken.core.index.approx`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container

import numpy as np

from foretoken.core.cost.busy_chains import BusyChains, ChainSample, alone_sample
from foretoken.core.cost.decode_windows import DecodeWindows, Window
from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2
from foretoken.core.cost.kv_steps import MAX_HOLD_S, KvSteps, StepSample
from foretoken.core.cost.quantiles import TtftQuantiles
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.cost.samples import prefill_sample_cached, time_per_output_token_s
from foretoken.core.cost.tier_costs import TierCosts
from foretoken.core.index.protocol import Index
from foretoken.core.queue.burst import Sent, burst_sample
from foretoken.core.queue.scheduler import CurveStepCost
from foretoken.core.queue.worker_queue import Outstanding, WorkerQueue
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.routing.kv_progress import PrefillProgress
from foretoken.core.routing.predict import step_cost
from foretoken.core.types import (
    GradedRequest,
    KvBatch,
    RequestId,
    RequestOutcome,
    Tier,
    WorkerId,
    WorkerProfile,
)

# A burst sample replays at most this many prompts (the fixed point replays a few times).
MAX_BURST_PROMPTS = 256
# Decode steps held per worker until it has a curve to judge them by (_observe_window).
MAX_HELD_STEPS = 256


class Learner:
    def __init__(
        self, index: Index, fits: FitRegistry, book: WorkerBook, config: PredictorConfig,
        quantiles: TtftQuantiles | None = None, tier_costs: TierCosts | None = None,
        unacted: Container[RequestId] = frozenset(),
    ) -> None:  # fmt: skip
        self.index, self.fits, self.book, self.config = index, fits, book, config
        # Decisions whose grant has not come back: nobody may have acted on them (kv_steps).
        self.unacted = unacted
        self.quantiles = quantiles or TtftQuantiles()
        self.tier_costs = tier_costs or TierCosts(config.tier_load_s_per_token)
        self.progress = PrefillProgress(book)
        self.kv_steps = KvSteps(config.kv_step_blocks)
        # Requests sent with a credit from one lower tier: (worker, tier, its tokens).
        self.tier_credit: OrderedDict[RequestId, tuple[WorkerId, Tier, int]] = OrderedDict()
        # busy-period samples: when each worker last finished a prefill (a first token) or,
        # on an engine that runs one sequence at a time, a whole request
        self.busy_mark_s: dict[WorkerId, float] = {}
        # and when the request of that first token was sent (a later one may overtake)
        self.busy_mark_sent: dict[WorkerId, float] = {}
        # Approximate mode: own hashes of prompts sent to workers without KV events, filed
        # in the index as cached there once their first token arrives.
        self.served_prompts: OrderedDict[RequestId, tuple[WorkerId, list[int]]] = OrderedDict()
        self.windows = DecodeWindows(config.decode_min_share)
        self.chains = BusyChains(config.busy_chain_budgets)
        self.burst_start: dict[WorkerId, float] = {}  # the idle start of each burst sample
        # A completion that let a KV- or seat-blocked head start alone: (when, which head).
        self.unblocked: dict[WorkerId, tuple[float, RequestId]] = {}
        # Decode steps that may have carried a chunk, judged once the worker has a curve.
        self.held_steps: dict[WorkerId, list[tuple[Window, float, int]]] = {}

    def on_outcome(self, outcome: RequestOutcome, now_s: float) -> None:
        self._observe_served(outcome, now_s)
        queue = self.book.queues.get(outcome.worker_id)
        if queue is None:
            return
        # The router's clock says when things happened; our consumption lags behind it.
        self.book.started(outcome.request_id, outcome.ts)  # or it ended without
        if outcome.kind == "first_token" and outcome.status == "ok":
            self._observe_busy(queue, outcome, now_s)
            entry = queue.get(outcome.request_id)
            if entry is not None and entry.first_token_s is None:
                self._witness_steps(outcome, entry.sent_at_s, now_s)
                if self.config.decode_windows:
                    self.windows.open(outcome.worker_id, outcome.request_id, outcome.ts,
                                      entry.prompt_tokens, entry.cached_tokens,
                                      queue.unstarted_count > 1)  # fmt: skip
            queue.first_token(outcome.request_id, outcome.ts)
            return
        self.on_completion(queue, outcome, now_s)

    def on_completion(self, queue: WorkerQueue, outcome: RequestOutcome, now_s: float) -> None:
        profile = self.book.profiles.get(outcome.worker_id)
        if profile is not None and profile.scheduler.max_num_seqs == 1:
            self._mark_busy(outcome.worker_id, outcome.ts)  # the next prompt starts after it
        wid = outcome.worker_id
        if profile is not None and not self._settled(wid):  # a later step ended
            clean = self.chains.close_clean(wid, profile.scheduler, outcome.ts)
            self._feed_chain(wid, profile.config_hash, clean, now_s)
        cost = step_cost(self.fits, wid) if self._chains_on(profile) else None
        blocked = (cost is not None and queue.admission_blocked(outcome.ts, cost)
                   and queue.prefill_idle(outcome.ts, cost))  # fmt: skip
        queue.finished(outcome.request_id, outcome.ts)
        if cost is not None:
            self._note_unblock(queue, wid, outcome.ts, blocked, cost)
        if self.config.decode_windows:
            if profile is not None:
                chunk = _least_chunk(profile) if queue.unstarted_count else 0
                self._observe_window(outcome, profile.config_hash, now_s, chunk)
            return
        tpot = None
        if outcome.e2e_s is not None and outcome.actual_ttft_s is not None:
            tpot = time_per_output_token_s(
                outcome.e2e_s, outcome.actual_ttft_s, outcome.output_tokens or 0
            )
        if tpot is not None and profile is not None:
            running = max(1.0, float(queue.running_count) + 1.0)
            self.fits.observe_decode(outcome.worker_id, profile.config_hash, tpot, running, now_s)

    def _chains_on(self, profile: WorkerProfile | None) -> bool:
        chunked = profile is not None and profile.scheduler.chunked_prefill
        return chunked and self.config.busy_chain_budgets > 0

    def _note_unblock(self, queue: WorkerQueue, wid: WorkerId, ts: float, was_blocked: bool,
                      cost: CurveStepCost) -> None:  # fmt: skip
        """After a completion at ``ts``: if the engine was blocked (its waiting head held
        back by a seat or KV blocks, nothing prefilling) and now the head starts alone,
        its prefill runs from ``ts`` to its first token beside decoders only — a sample
        (:meth:`_busy_chain`). A later completion that lets another prompt start beside a
        watched head spoils it."""
        head = queue.lone_head(ts, cost) if was_blocked else None
        if head is not None:
            self.unblocked[wid] = (ts, head)
        elif (wid in self.unblocked and queue.unstarted_count > 1
              and not queue.admission_blocked(ts, cost)):  # fmt: skip
            del self.unblocked[wid]

    def _observe_window(self, outcome: RequestOutcome, config_hash: str, now_s: float,
                        chunk: int = 0) -> None:  # fmt: skip
        """``chunk``: the prompt tokens a step carries when prompts wait for their
        prefill (:func:`_least_chunk`), if some wait now, else 0."""
        span = None
        if outcome.e2e_s is not None and outcome.actual_ttft_s is not None:
            span = outcome.e2e_s - outcome.actual_ttft_s
        window = self.windows.close(outcome.request_id, outcome.ts, span,
                                    outcome.output_tokens or 0)  # fmt: skip
        if window is None:
            return
        wid = outcome.worker_id
        step_s = outcome.decode_step_s  # the router timed the stream's token gaps
        if step_s is not None and step_s > 0:
            if _may_carry_chunks(window, chunk) and self.fits.curve(wid).default:
                # whether its steps carried a chunk is judged on the curve: wait for one
                pending = self.held_steps.setdefault(wid, [])
                if len(pending) < MAX_HELD_STEPS:
                    pending.append((window, step_s, chunk))
                return
            for w, s, c in self.held_steps.pop(wid, ()):
                if self._decode_only(wid, w, s, c):
                    self.fits.observe_decode(wid, config_hash, s, w.mean_decoding, now_s)
            if self._decode_only(wid, window, step_s, chunk):
                self.fits.observe_decode(wid, config_hash, step_s, window.mean_decoding, now_s)
            return
        if self.fits.curve(wid).default:  # it would subtract far too much: keep it for later
            self.windows.hold(wid, window)
            return
        for held in (*self.windows.release(wid), window):
            self._feed_window(wid, config_hash, held, now_s)

    def _decode_only(self, wid: WorkerId, window: Window, step_s: float, chunk: int) -> bool:
        """Whether a stream's decode step ``step_s`` (its fast token gaps: their median) is
        a step without a prefill chunk. It is unless prompts wait for theirs as the window
        closes and its steps may have carried ``chunk``-token ones: every step, if prompts
        waited at its open too; else if the prompts first served within the window make
        chunks for at least half its steps (the median gap is then one that carried a
        chunk). Such a step is judged: nearer a step that carries a chunk than a
        decode-only one (at the current curve and step cost), it is left out."""
        if not _may_carry_chunks(window, chunk):
            return True
        running = window.mean_decoding
        chunk_s = self.fits.curve(wid).a * max(chunk - running, 0.0)
        return step_s < self.fits.step_cost(wid).decode_step_s(running) + 0.5 * chunk_s

    def _feed_window(self, wid: WorkerId, config_hash: str, window: Window, now_s: float) -> None:
        curve = self.fits.curve(wid)
        sample = window.sample(curve.a, curve.b, self.windows.min_share)
        if sample is not None:
            self.fits.observe_decode(wid, config_hash, sample[0], sample[1], now_s)

    def on_graded(self, graded: GradedRequest, now_s: float) -> bool:
        """Feed the fit with a cold sample; True if this record was one. Every served
        request with a prediction is a residual for the quantiles."""
        wid = graded.worker_id
        alone = self.book.ran_alone(graded.request_id)
        if wid is None or wid not in self.book.profiles:
            return False
        predicted, actual = graded.predicted_ttft_s, graded.actual_ttft_s
        if actual is not None:  # the attempt's TTFT: the router's counts the time waited
            actual = max(0.0, actual - graded.already_waited_s)
        if graded.status == "served" and predicted is not None and actual is not None:
            self.quantiles.observe(graded.request_id, wid, predicted, actual,
                                   graded.queue_wait_s, graded.fit_default)  # fmt: skip
        profile = self.book.profiles[wid]
        tier = self.tier_credit.pop(graded.request_id, None)
        # The router turns an omitted cached-token field into 0 for engines that report it,
        # so "unknown" here really is unknown: such requests are not samples.
        cached = prefill_sample_cached(graded, others_running=not alone, in_event_time=True)
        if cached is None:
            return False
        assert actual is not None
        if tier is not None and tier[0] == wid:
            # a sample of the tier's cost, not of the curve: the two are hard to tell
            # apart in one TTFT (a curve taught by such requests, less a prior load cost
            # 4x too low, read the tier as nearly free)
            self._observe_tier(profile, graded, cached, tier[1], tier[2])
            return True
        # With the steps its prefill took: the queue walk adds their overheads on top of
        # C(N) − C(K) (as busy-chain samples do, alone_sample), so the curve takes them off
        # at the worker's learned step cost (FitRegistry.observe_cold).
        n = graded.prompt_tokens
        self.fits.observe_cold(wid, profile.config_hash, n, actual, now_s, cached,
                               _prefill_steps(profile, n, cached))  # fmt: skip
        # On a chunked engine the busy chains already took it, at its first token, as a
        # clean chain (sent to an idle engine); a serial engine's come from here.
        chains = self.config.busy_chain_budgets > 0
        if chains and not profile.scheduler.chunked_prefill and not self.fits.has_cold_fit(wid):
            cost = step_cost(self.fits, wid)
            sample = alone_sample(profile.scheduler, graded.prompt_tokens, cached,
                                  actual, cost.step_overhead_s)  # fmt: skip
            self._feed_chain(wid, profile.config_hash, sample, now_s)
        return True

    def on_kv_batch(self, batch: KvBatch, now_s: float) -> bool:
        """A worker's KV batch: a step's prefill while prompts queue there
        (:mod:`foretoken.core.cost.kv_steps`), a partial cold sample while a lone prompt
        prefills there (:mod:`foretoken.core.routing.kv_progress`); True if it gave one."""
        stepped = self._kv_step(batch, now_s)
        progress = self.progress.on_batch(batch) if self.config.kv_progress_samples else None
        if progress is None:
            return stepped
        profile = progress.profile
        step_s = step_cost(self.fits, batch.worker_id).step_overhead_s  # nothing else runs
        sample = alone_sample(profile.scheduler, progress.computed, progress.cached,
                              progress.seconds, step_s)  # fmt: skip
        if sample is None:
            return False
        self.fits.observe_progress(batch.worker_id, profile.config_hash, sample.u, sample.v,
                                   sample.raw_s, now_s, sample.steps)  # fmt: skip
        return True

    def _kv_step(self, batch: KvBatch, now_s: float) -> bool:
        wid = batch.worker_id
        profile, queue = self.book.profiles.get(wid), self.book.queues.get(wid)
        if not self.config.kv_step_samples or profile is None or queue is None:
            return False

        def waiting() -> float | None:
            return queue.first_unstarted_sent(batch.ts - MAX_HOLD_S, self.unacted)

        samples = self.kv_steps.on_batch(batch, profile.block_size, float(queue.decoding_count),
                                         waiting)  # fmt: skip
        return self._feed_steps(wid, samples, now_s)

    def _witness_steps(self, outcome: RequestOutcome, sent_s: float, now_s: float) -> None:
        """A first token witnesses the steps its request waited through (kv_steps). Sent
        when its grant says (``actual_ttft_s`` counts what the client says it waited)."""
        if self.config.kv_step_samples:
            samples = self.kv_steps.on_first_token(outcome.worker_id, sent_s, outcome.ts)
            self._feed_steps(outcome.worker_id, samples, now_s)

    def _feed_steps(self, wid: WorkerId, samples: list[StepSample], now_s: float) -> bool:
        profile = self.book.profiles.get(wid)
        if not samples or profile is None:
            return False
        for x in samples:
            self.fits.observe_busy_chain(wid, profile.config_hash, x.u, x.v, x.seconds, now_s,
                                         1, x.decoding, x.placed)  # fmt: skip
        return True

    def forget_worker(self, wid: WorkerId) -> None:
        """A worker removed or reset: what follows its engine's steps goes."""
        self.kv_steps.forget(wid)

    def remember_tier(self, rid: RequestId, wid: WorkerId, lower: tuple[Tier, int]) -> None:
        """``rid`` was sent to ``wid`` with ``lower[1]`` tokens credited from tier
        ``lower[0]`` (and none from another lower tier)."""
        self.tier_credit[rid] = (wid, lower[0], lower[1])
        if len(self.tier_credit) > self.config.decision_memory:
            self.tier_credit.popitem(last=False)

    def _observe_tier(self, profile: WorkerProfile, graded: GradedRequest, cached: int,
                      tier: Tier, tokens: int) -> None:  # fmt: skip
        """A prefill sample that loaded ``tokens`` from ``tier``: its load time per token
        is a sample of the tier's cost, once the worker has a curve to take its own
        prefill from (:mod:`foretoken.core.cost.tier_costs`), and the engine reused at
        least the credit."""
        wid = profile.worker_id
        curve = self.fits.curve(wid)
        if curve.default or cached < graded.credited_cached_tokens or tokens <= 0:
            return
        n = graded.prompt_tokens
        assert graded.actual_ttft_s is not None
        steps = _prefill_steps(profile, n, cached)
        own = curve.own_prefill_s(n, cached) + steps * self.fits.step_cost(wid).overhead_s
        attempt = graded.actual_ttft_s - graded.already_waited_s  # the router's counts the wait
        self.tier_costs.observe(wid, tier, (attempt - own) / tokens)

    def remember_prompt(self, rid: RequestId, wid: WorkerId, chain: np.ndarray) -> None:
        """A prompt sent to a worker without KV events: its own hashes (for the worker's
        block size), for when it is served."""
        if self.book.profiles[wid].has_kv_events or not len(chain):
            return
        self.served_prompts[rid] = (wid, chain.tolist())
        if len(self.served_prompts) > self.config.decision_memory:
            self.served_prompts.popitem(last=False)

    def forget(self, rid: RequestId) -> None:
        self.served_prompts.pop(rid, None)
        self.tier_credit.pop(rid, None)
        self.windows.forget(rid)
        self.quantiles.drop(rid)

    def _observe_served(self, outcome: RequestOutcome, now_s: float) -> None:
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

    def _observe_busy(self, queue: WorkerQueue, outcome: RequestOutcome, now_s: float) -> None:
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
        profile = self.book.profiles.get(wid)
        if entry is None or profile is None or entry.first_token_s is not None:
            return
        if self.config.busy_chain_budgets > 0 and profile.scheduler.chunked_prefill:
            self._busy_chain(queue, outcome, entry, profile, prev, now_s)
            return
        if prev is None:
            return
        if not entry.sent_at_s < prev < outcome.ts:
            return
        scheduler = profile.scheduler
        fresh = entry.prompt_tokens - entry.cached_tokens
        if scheduler.chunked_prefill and fresh < scheduler.max_num_batched_tokens:
            return  # smaller prompts share steps: the gap is not theirs alone
        self.fits.observe_busy(wid, profile.config_hash, entry.prompt_tokens, outcome.ts - prev,
                               now_s, entry.cached_tokens)  # fmt: skip

    def _busy_chain(
        self, queue: WorkerQueue, outcome: RequestOutcome, entry: Outstanding,
        profile: WorkerProfile, prev: float | None, now_s: float,
    ) -> None:  # fmt: skip
        """Busy chains (:mod:`foretoken.core.cost.busy_chains`) on a chunked engine; the
        first first token after a request was sent to an idle engine starts a clean one,
        timed from that send."""
        wid, ts, chains = outcome.worker_id, outcome.ts, self.chains
        marked_sent = self.busy_mark_sent.get(wid, -math.inf)
        self.busy_mark_sent[wid] = entry.sent_at_s
        cost = step_cost(self.fits, wid)
        line = self.windows.lines.get(wid)
        decoding = line.decoding if line is not None else 0.0
        step_s = cost.step_overhead_s + cost.decode_s_per_seq * decoding
        start = self.book.idle_start.pop(wid, None)
        t_unblock, head = self.unblocked.pop(wid, (math.inf, None))
        if head == outcome.request_id and last_le(prev, t_unblock):
            sample = alone_sample(profile.scheduler, entry.prompt_tokens, entry.cached_tokens,
                                  ts - t_unblock, step_s, decoding)  # fmt: skip
            self._feed_chain(wid, profile.config_hash, sample, now_s)
        settle = self._settled(wid)
        if not settle:  # a later step: a clean chain has every prompt of its first step
            self._feed_chain(wid, profile.config_hash,
                             chains.close_clean(wid, profile.scheduler, ts), now_s)  # fmt: skip
        if queue.admission_blocked(ts, cost):
            chains.drop(wid)  # the gap holds steps waiting for KV blocks or a seat
            return
        drained = not queue.waiting_sent_before(ts, outcome.request_id)
        last = -math.inf if prev is None else prev
        # Settled, a clean chain runs from the idle engine's first send and takes every
        # prompt sent after it; before, only that prompt, from its own first token, if none
        # came between (its first step, which may carry others' first chunks too).
        if settle:
            clean = start is not None and last <= start[1] <= entry.sent_at_s
        else:
            clean = start is not None and start[0] == outcome.request_id and last <= start[1]
        if not clean and not settle and start is not None and last <= start[1] and decoding < 0.5:
            # an idle engine's first first token, of another prompt than the first sent
            sample = self._burst(queue, profile, start[1], entry, ts, cost)
            self._feed_chain(wid, profile.config_hash, sample, now_s)
        if clean:
            assert start is not None
            chains.drop(wid)  # the engine was idle until then: a clean chain from the send
            sample = chains.start_clean(wid, profile.scheduler, entry.prompt_tokens,
                                        entry.cached_tokens, ts - start[1], ts, step_s,
                                        decoding, drained)  # fmt: skip
            self._feed_chain(wid, profile.config_hash, sample, now_s)
            return
        # A clean chain's prompts are still prefilling (it waits for them): never idle.
        same_step = last == ts and entry.sent_at_s < last and chains.has(wid)
        # Busy since the previous first token: this request waited through the gap, or one
        # sent before that still waits (this one overtook it; it prefilled meanwhile).
        overtook = queue.waiting_sent_before(entry.sent_at_s, outcome.request_id)
        busy = last < ts and (
            entry.sent_at_s < last
            or (chains.has(wid) and queue.waiting_sent_before(last, outcome.request_id))
        )
        if not chains.has(wid) and marked_sent > entry.sent_at_s:
            return  # overtaken: it prefilled before the previous first token too
        if not (chains.is_clean(wid) or same_step or busy):
            chains.drop(wid)  # it may have paused: start afresh
            return
        sample = chains.add(wid, profile.scheduler, entry.prompt_tokens, entry.cached_tokens,
                            max(ts - last, 0.0), step_s, decoding, drained, settle,
                            overtook)  # fmt: skip
        self._feed_chain(wid, profile.config_hash, sample, now_s)

    def _burst(
        self, queue: WorkerQueue, profile: WorkerProfile, start_s: float, entry: Outstanding,
        ts: float, cost: CurveStepCost,
    ) -> ChainSample | None:  # fmt: skip
        """The sample of a burst (:mod:`foretoken.core.queue.burst`): the prompts sent to
        the idle engine since ``start_s``, replayed until ``entry``'s first token at ``ts``."""
        pending = queue.unstarted_sent_since(start_s)
        if not pending or len(pending) > MAX_BURST_PROMPTS or entry not in pending:
            return None
        wid = profile.worker_id
        if self.burst_start.get(wid) == start_s:  # one sample per burst
            return None
        self.burst_start[wid] = start_s
        sent = [Sent(e.sent_at_s, e.prompt_tokens, e.cached_tokens, e.expected_output_tokens)
                for e in pending]  # fmt: skip
        overhead, per_seq = cost.step_overhead_s, cost.decode_s_per_seq
        work = burst_sample(profile.scheduler, queue.kv, sent, pending.index(entry),
                            ts - start_s, self.fits.curve(wid).a,
                            REFERENCE_B_S_PER_TOKEN2, overhead, per_seq)  # fmt: skip
        if work is None or not work.steps:
            return None
        raw = ts - start_s
        seconds = raw - work.steps * overhead - work.decoders * per_seq
        return ChainSample(work.u, work.v, seconds, raw, work.steps, work.decoders / work.steps)

    def _feed_chain(
        self, wid: WorkerId, config_hash: str, sample: ChainSample | None, now_s: float
    ) -> None:
        if sample is not None:
            self.fits.observe_busy_chain(wid, config_hash, sample.u, sample.v, sample.raw_s,
                                         now_s, sample.steps, sample.decoding,
                                         sample.exact)  # fmt: skip

    def _settled(self, wid: WorkerId) -> bool:
        """Whether the worker's clean chains wait for a drained queue (``busy_chain_settle``)."""
        return self.fits.busy_chain_samples(wid) >= self.config.busy_chain_settle

    def _mark_busy(self, wid: WorkerId, ts: float) -> None:
        if ts > self.busy_mark_s.get(wid, -math.inf):
            self.busy_mark_s[wid] = ts


def _may_carry_chunks(window: Window, chunk: int) -> bool:
    """Whether a decode window's median step may carry a ``chunk``-token prefill chunk
    (``Learner._decode_only``)."""
    if not chunk:
        return False
    return window.queued_at_open or window.u >= 0.5 * window.steps * chunk


def _least_chunk(profile: WorkerProfile) -> int:
    """The fewest prompt tokens (plus decodes) a step of a worker whose prompts wait carries:
    its token budget, or one prompt's chunk when a long-prefill threshold caps it."""
    settings = profile.scheduler
    threshold = settings.long_prefill_token_threshold
    budget = settings.max_num_batched_tokens
    return min(budget, threshold) if threshold > 0 else budget


def _prefill_steps(profile: WorkerProfile, n: int, cached: int) -> int:
    """The steps a prompt of ``n`` tokens (``cached`` reused) takes to prefill alone."""
    per_step = _least_chunk(profile) if profile.scheduler.chunked_prefill else n
    return -(-(n - cached) // max(per_step, 1))


def last_le(prev_s: float | None, t: float) -> bool:
    """Whether the previous first token (None: none yet) came at or before ``t``."""
    return prev_s is None or prev_s <= t
