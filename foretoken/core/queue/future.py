"""A worker's recorded future, and a new request's first token read off it.

A replay for one candidate request
(:func:`foretoken.core.queue.scheduler.simulate_until_first_token`) runs
the worker's whole queue ahead of the request through the step scheduler. The route
service asks this for every worker on every request, and most of the time a worker's
queue has not changed since the previous request, so the queue's future is replayed
**once** (without any new request) and recorded as
:class:`~foretoken.core.queue.scheduler.Stretch`\\ es;
each new request is then walked through the recording.

Why the walk is exact: a new request arrives behind everything in the queue, so the
scheduler serves it last in every step — running sequences in admission order come first
and it is the last admitted; waiting ones ahead of it are admitted before it (first come,
first served; a serial engine's head blocks everyone behind it). It therefore only ever
takes the budget the queue left in a step (``budget_left``), and only once the queue runs
fewer than ``max_num_seqs``; it never changes what the queue gets in a step, only how
long the step lasts (step cost is additive: overhead + chunks + decoders). So the queue's
steps are the recorded ones, each one the new request joins lasts its chunk longer, and
every later step starts that much later. Tests check the walk against the full replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from foretoken.core.queue.scheduler import (
    KvModel,
    NewRequest,
    QueuePrediction,
    StepCost,
    Stretch,
    _Scheduler,
    pinned_prefix,
    prefill_span,
)
from foretoken.core.types import SchedulerSettings


@dataclass(frozen=True, slots=True)
class Future:
    """The queue's steps from ``start_s`` until it is empty, with no new request."""

    settings: SchedulerSettings
    cost: StepCost
    ready_s: float  # when the engine's current step ends (before any new arrival)
    start_s: float
    stretches: tuple[Stretch, ...]
    end_s: float  # when the last sequence leaves (the engine is idle after it)
    drained_s: float | None  # when nothing is left to prefill (None: nothing was)
    tokens_ahead: int
    kv: KvModel | None = None

    @classmethod
    def record(
        cls, scheduler: _Scheduler, settings: SchedulerSettings, now_s: float, cost: StepCost,
        tokens_ahead: int,
    ) -> Future:  # fmt: skip
        """Run ``scheduler`` (a replay of the future: ``retire=True``) to its end from
        ``now_s`` (or the end of its current step) and keep what it did."""
        ready_s = scheduler.free_at_s
        scheduler.free_at_s = begin_s = max(ready_s, now_s)
        stretches: list[Stretch] = []
        scheduler.record = stretches
        drained_s = None if not scheduler.has_prefill() else math.nan
        while scheduler.run_stretch(cost):
            if drained_s is not None and math.isnan(drained_s) and not scheduler.has_prefill():
                drained_s = scheduler.free_at_s
        scheduler.record = None
        if drained_s is not None and math.isnan(drained_s):
            raise RuntimeError("the replay stalled before the queue drained")
        return cls(settings, cost, ready_s, begin_s, tuple(stretches), scheduler.free_at_s,
                   drained_s, tokens_ahead, scheduler.kv)  # fmt: skip

    def drain_s(self, now_s: float) -> float:
        """Seconds from ``now_s`` until every prompt in the queue is prefilled."""
        if self.drained_s is None:
            return 0.0
        return self.drained_s + self._offset(now_s) - now_s

    def first_token(self, new_request: NewRequest, now_s: float) -> QueuePrediction:
        """What :func:`~foretoken.core.queue.scheduler.simulate_until_first_token` gives for
        ``new_request`` arriving at ``now_s`` behind this queue."""
        settings, cost = self.settings, self.cost
        first, prompt = prefill_span(new_request.prompt_tokens, new_request.cached_tokens)
        kv = self.kv
        blocks = kv_cap = 0
        if kv is not None:
            pinned = pinned_prefix(first, new_request.pinned_tokens)
            blocks, kv_cap = kv.blocks(prompt, pinned, new_request.output_tokens), kv.gpu_blocks
        chunked = settings.chunked_prefill
        cap = settings.long_prefill_token_threshold if chunked else 0
        budget, max_seqs = settings.max_num_batched_tokens, settings.max_num_seqs
        computed, admitted, shift_s, steps = first, False, 0.0, 0
        done_s: float | None = None
        for st in self.stretches:
            left = st.budget_left
            blocked = st.running >= max_seqs or st.waiting or st.kv_used + blocks > kv_cap > 0
            if left <= 0 or (not admitted and blocked):
                steps += st.steps
                continue
            if not chunked:  # serial: the whole prompt in one step, when it may start
                size = prompt - computed
                if size > left and (size <= budget or st.chunks):
                    steps += st.steps
                    continue
                done_s = st.end_of_step_s(1, cost) + shift_s + cost.chunk_s(computed, prompt)
                steps += 1
                break
            admitted = True
            per = cap if 0 < cap < left else left
            need = -(-(prompt - computed) // per)
            if need <= st.steps:
                done_s = st.end_of_step_s(need, cost) + shift_s + cost.chunk_s(computed, prompt)
                steps += need
                break
            shift_s += cost.chunk_s(computed, computed + st.steps * per)
            computed += st.steps * per
            steps += st.steps
        if done_s is None:  # alone on the engine after the queue
            per = prompt - computed if not chunked else min(cap or budget, budget)
            need = -(-(prompt - computed) // per)
            done_s = self.end_s + shift_s + need * cost.step_overhead_s
            done_s += cost.chunk_s(computed, prompt)
            steps += need
        ttft_s = done_s + self._offset(now_s) - now_s
        prefill_s = cost.chunk_s(first, prompt)
        return QueuePrediction(
            queue_wait_s=max(ttft_s - prefill_s, 0.0),
            prefill_s=prefill_s,
            ttft_s=ttft_s,
            steps=steps,
            queue_tokens_ahead=self.tokens_ahead,
        )

    def _offset(self, now_s: float) -> float:
        """A replay of the future does not depend on the clock: from a later start (an
        engine that was idle, or a request that arrives after the current step ends)
        everything happens that much later."""
        return max(self.ready_s, now_s) - self.start_s
