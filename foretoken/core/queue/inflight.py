"""The in-flight estimate: a running simulation of one worker's engine over the requests
sent to it (PRODUCT.md §3 "Queue replay").

The worker never reports prefill progress, so :class:`InFlightEstimate` keeps a running
simulation of the engine from the requests' send times, advanced lazily to each
prediction's ``now`` and corrected by what is observed (a first token completes a
prefill; a completion removes a request). A request without a first token is never
presented as done once it is overdue — it keeps at least one chunk — but the step that
finishes its prefill in the simulation may still be under way at ``now`` (its first token
is not due yet), and first tokens reach the route service some milliseconds after they
happen (``lag_s``: through Kafka, ~10-25 ms): until that step's end plus ``lag_s`` it
counts as done. Before, such a prompt prefilled its last chunk again after the step that
computes it — on an engine that prefills whole prompts (llama.cpp) the whole prompt: a
1,024-token request sent while a 6,144-token one prefilled was predicted to wait for it
twice (0.47 s predicted, 0.11 s actual, the real-engine bench).

Predictions read the queue's recorded future (:class:`~foretoken.core.queue.future.Future`),
replayed once per change of the estimate (or of the worker's cost curve) and shared by
every request asked about in between. The replay and the walk run natively when the native
walk models the cost and the queue (:mod:`foretoken.core.queue.native_walk`, bit-identical),
else on the Python reference.
"""

from __future__ import annotations

import math
from itertools import compress

from foretoken.core.queue import native_walk
from foretoken.core.queue.future import Future
from foretoken.core.queue.native_walk import NativeFuture
from foretoken.core.queue.scheduler import (
    _DECODING,
    _PREFILLING,
    _WAITING,
    MIN_OUTPUT_TOKENS_LEFT,
    KvModel,
    NewRequest,
    Phase,
    QueuePrediction,
    QueueState,
    SeqState,
    StepCost,
    _admission_order,
    _Scheduler,
    _Seq,
    prefill_span,
)
from foretoken.core.queue.tails import OutputTail, tail_done
from foretoken.core.types import SchedulerSettings


class InFlightEstimate:
    """A running simulation of one worker's engine over the requests sent to it, keyed
    by an id, advanced lazily (:meth:`advance`) and corrected by observations."""

    def __init__(self, settings: SchedulerSettings, kv: KvModel | None = None) -> None:
        self.settings = settings
        self.kv = kv
        self._scheduler = _Scheduler(settings, retire=False, kv=kv)
        self._seqs: dict[object, _Seq] = {}
        self._version = 0  # bumped by every change of the simulation
        self._future: Future | NativeFuture | None = None
        self._future_version = -1
        self._future_until_s = math.inf  # when a prefill's grace (lag_s) runs out
        self._lag_s = 0.0
        self._tails = 0  # sequences whose answer length is a distribution (tails.py)

    @property
    def running_count(self) -> int:
        return self._scheduler.running_count

    @property
    def kv_free_blocks(self) -> int | None:
        """GPU blocks no running sequence reserves (None: capacity unknown)."""
        if self.kv is None:
            return None
        return max(self._scheduler.kv_cap - self._scheduler.kv_used, 0)

    @property
    def lag_s(self) -> float:
        """How late first tokens reach us (the outcomes' lag): a prefill the simulation
        finished less than this ago is taken as done, its first token on its way."""
        return self._lag_s

    @lag_s.setter
    def lag_s(self, value: float) -> None:
        if value != self._lag_s:
            self._lag_s = value
            self._future = None  # recorded with the previous grace

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    def advance(self, until_s: float, cost: StepCost) -> None:
        """Simulate every step that starts before ``until_s`` (the last may end after it)."""
        scheduler = self._scheduler
        if scheduler.free_at_s >= until_s:  # no step starts before until_s
            return
        before = (scheduler.steps, scheduler.free_at_s)
        while scheduler.run_stretch(cost, until_s):
            pass
        if (scheduler.steps, scheduler.free_at_s) != before:
            self._version += 1

    def arrive(
        self, key: object, at_s: float, prompt_tokens: int, cached_tokens: int,
        output_tokens: int, pinned_tokens: int = -1, tail: OutputTail | None = None,
    ) -> None:  # fmt: skip
        """A request reaches the engine's waiting queue at ``at_s`` (after :meth:`advance`
        to ``at_s``; an earlier ``at_s`` is taken as a late correction); ``pinned_tokens``:
        of its cached tokens, those another sequence holds (-1: all; see ``KvModel``);
        ``tail``: its answer's length as a distribution (``tails.py``; None: fixed)."""
        if key in self._seqs:
            return
        self._version += 1
        first, prompt = prefill_span(prompt_tokens, cached_tokens)
        seq = _Seq(first, first, prompt, max(output_tokens, MIN_OUTPUT_TOKENS_LEFT), key)
        if tail is not None:
            seq.tail = tail
            self._tails += 1
        seq.blocks = self._scheduler.blocks_of(seq, output_tokens, pinned_tokens)
        self._wake(at_s)
        self._scheduler.waiting.append(seq)
        self._seqs[key] = seq

    def first_token(self, key: object, at_s: float) -> None:
        """The request's first token was seen: its prompt is done, it decodes."""
        seq = self._seqs.get(key)
        if seq is None or seq.seen:
            return
        self._version += 1
        seq.seen = True
        scheduler = self._scheduler
        if seq.where == _DECODING:
            return
        if seq.where == _WAITING:
            self._wake(at_s)
            scheduler.waiting.remove(seq)
            seq.order = scheduler.next_order
            scheduler.next_order += 1
            scheduler.kv_used += seq.blocks  # it runs on the engine: its blocks are taken
        else:
            scheduler.prefilling.remove(seq)
        seq.computed = seq.end
        scheduler.start_decoding(seq, seq.expected - 1)

    def remove(self, key: object) -> None:
        seq = self._seqs.pop(key, None)
        if seq is None:
            return
        self._version += 1
        self._tails -= seq.tail is not None
        scheduler = self._scheduler
        if seq.where == _WAITING:
            scheduler.waiting.remove(seq)
        elif seq.where == _PREFILLING:
            scheduler.prefilling.remove(seq)
            scheduler.kv_used -= seq.blocks
        else:
            scheduler.drop_decoder(seq)

    def admission_blocked(self) -> bool:
        """Whether the head of the waiting queue cannot start now: ``max_num_seqs`` run,
        or its KV blocks do not fit (the engine then runs steps that only decode)."""
        scheduler = self._scheduler
        if not scheduler.waiting:
            return False
        if scheduler.running_count >= scheduler.max_seqs:
            return True
        head = scheduler.waiting[0].blocks
        return scheduler.kv_used > 0 and scheduler.kv_used + head > scheduler.kv_cap

    def prefill_idle(self) -> bool:
        """Whether no admitted sequence is still prefilling (every running one decodes)."""
        scheduler = self._scheduler
        return not scheduler.prefilling and all(seq.seen for seq in scheduler.dec_seqs)

    def lone_head(self) -> object | None:
        """The key of the waiting head if it can start now and the one behind it (if
        any) cannot start beside it (a seat or its KV blocks): the head then prefills
        alone. None otherwise."""
        scheduler = self._scheduler
        waiting = scheduler.waiting
        if not waiting or self.admission_blocked():
            return None
        head = waiting[0]
        if len(waiting) == 1 or scheduler.running_count + 1 >= scheduler.max_seqs:
            return head.key
        used = scheduler.kv_used + head.blocks
        return head.key if used + waiting[1].blocks > scheduler.kv_cap > 0 else None

    def phase(self, key: object) -> Phase | None:
        seq = self._seqs.get(key)
        if seq is None:
            return None
        if seq.seen:
            return "decoding"
        return "queued" if seq.where == _WAITING else "prefilling"

    def prefill_tokens_left(self, key: object) -> int | None:
        """Prompt tokens still to compute (clamped: ≥ one chunk without a first token)."""
        seq = self._seqs.get(key)
        if seq is None:
            return None
        if seq.seen:
            return 0
        return seq.end - self._unconfirmed(seq).computed

    def prefill_left(self) -> list[int]:
        """Prompt tokens each sequence without a first token still has to compute (one
        admitted keeps at least its last chunk), admitted ones first."""
        scheduler = self._scheduler
        chunk = scheduler.min_chunk  # as _unconfirmed keeps it
        left = [max(s.end - s.computed, chunk(s)) for s in scheduler.prefilling]
        left += [max(s.end - s.computed, chunk(s)) for s in scheduler.dec_seqs if not s.seen]
        left += [s.end - s.computed for s in scheduler.waiting]
        return left

    def state(self, now_s: float = math.inf) -> QueueState:
        """The estimate as a replay starts from it (see :meth:`predict`)."""
        scheduler, _ = self._replay_copy(now_s)
        base = scheduler.steps
        running = [(s.order, SeqState(s.end, s.computed, s.left)) for s in scheduler.prefilling]
        running += [
            (order, SeqState(s.end, s.end, done - base))
            for order, done, s in zip(
                scheduler.dec_orders, scheduler.dec_done, scheduler.dec_seqs, strict=True
            )
        ]
        running.sort(key=lambda item: item[0])
        return QueueState(
            free_at_s=scheduler.free_at_s,
            running=tuple(state for _, state in running),
            waiting=tuple(SeqState(s.end, s.computed, s.left) for s in scheduler.waiting),
        )

    def predict(self, new_request: NewRequest, now_s: float, cost: StepCost) -> QueuePrediction:
        """:func:`~foretoken.core.queue.scheduler.simulate_until_first_token` from :meth:`state`
        (after
        :meth:`advance`). A request without a first token has at least its last chunk to
        compute and all its output left; one with a first token has what the simulation
        has not yet produced of its expected output (at least one token)."""
        return self.future(now_s, cost).first_token(new_request, now_s)

    def drain_s(self, now_s: float, cost: StepCost) -> float:
        """:func:`~foretoken.core.queue.scheduler.projected_drain_s` from :meth:`state` (after
        :meth:`advance`)."""
        return self.future(now_s, cost).drain_s(now_s)

    def future(self, now_s: float, cost: StepCost) -> Future | NativeFuture:
        """The queue's recorded future, replayed again only when the simulation or the
        cost changed since the last one."""
        future = self._future
        if (
            future is None
            or self._future_version != self._version
            or now_s > self._future_until_s
            or (future.cost is not cost and future.cost != cost)
        ):
            lag_s = self._lag_s
            future = native_walk.record_estimate(self._scheduler, self.settings, now_s, cost,
                                                 lag_s, tails=self._tails > 0)  # fmt: skip
            if future is None:  # a cost or a queue the native walk does not model
                scheduler, tokens_ahead = self._replay_copy(now_s)
                future = Future.record(scheduler, self.settings, now_s, cost, tokens_ahead)
            self._future, self._future_version = future, self._version
            graces = [s.done_s + lag_s for s in self._scheduler.dec_seqs
                      if not s.seen and s.done_s + lag_s > now_s]  # fmt: skip
            self._future_until_s = min(graces, default=math.inf)
        return future

    def _wake(self, at_s: float) -> None:
        scheduler = self._scheduler
        if scheduler.idle:
            scheduler.free_at_s = max(scheduler.free_at_s, at_s)

    def _unconfirmed(self, seq: _Seq) -> _Seq:
        """A copy of a running sequence without a first token, keeping its last chunk."""
        computed = min(seq.computed, seq.end - self._scheduler.min_chunk(seq))
        copy = _Seq(seq.first, computed, seq.end, seq.expected, seq.key)
        copy.order = seq.order
        copy.where = _PREFILLING
        copy.blocks = seq.blocks
        return copy

    def _replay_copy(self, now_s: float = math.inf) -> tuple[_Scheduler, int]:
        """A scheduler for a replay of the future at ``now_s``, at the estimate's step count
        (decoders are shared: a replay never changes them), and the prefill tokens it has
        left. A decoder whose first token was not seen prefills its last chunk again (the
        estimate ran ahead of the engine) once it is overdue: when the step that finished
        its prefill in the simulation ended ``lag_s`` or more before ``now_s``. Before that
        its first token is due, or on its way (``now_s`` = inf: every such one overdue)."""
        source = self._scheduler
        scheduler = _Scheduler(self.settings, retire=True, kv=self.kv)
        scheduler.free_at_s = source.free_at_s
        scheduler.next_order = source.next_order
        scheduler.steps = base = source.steps
        prefilling = [self._unconfirmed(s) for s in source.prefilling]
        lag_s = self._lag_s
        seen = [s.seen or now_s < s.done_s + lag_s for s in source.dec_seqs]
        if all(seen):
            scheduler.dec_orders = source.dec_orders.copy()
            scheduler.dec_done = source.dec_done.copy()
            scheduler.dec_seqs = source.dec_seqs.copy()
        else:  # the estimate ran ahead of the engine: those keep their last chunk
            prefilling += [self._unconfirmed(s) for s, k in zip(source.dec_seqs, seen,
                                                                 strict=True) if not k]  # fmt: skip
            prefilling.sort(key=_admission_order)
            scheduler.dec_orders = list(compress(source.dec_orders, seen))
            scheduler.dec_done = list(compress(source.dec_done, seen))
            scheduler.dec_seqs = list(compress(source.dec_seqs, seen))
        done = scheduler.dec_done
        if self._tails:
            done = tail_done(scheduler.dec_seqs, done, base)
        if done and min(done) < base + MIN_OUTPUT_TOKENS_LEFT:  # outlived their estimate
            done = [max(d, base + MIN_OUTPUT_TOKENS_LEFT) for d in done]
        scheduler.dec_done = done
        scheduler.prefilling = prefilling
        for seq in source.waiting:
            copy = _Seq(seq.first, seq.computed, seq.end, seq.expected)
            copy.blocks = seq.blocks
            scheduler.waiting.append(copy)
        scheduler.kv_used = sum(s.blocks for s in prefilling)
        scheduler.kv_used += sum(s.blocks for s in scheduler.dec_seqs)
        tokens_ahead = sum(s.end - s.computed for s in prefilling)
        tokens_ahead += sum(s.end - s.computed for s in scheduler.waiting)
        # a prefill whose last step is still under way: its last chunk is being computed
        tokens_ahead += sum(source.min_chunk(s) for s in source.dec_seqs
                            if not s.seen and now_s < s.done_s)  # fmt: skip
        return scheduler, tokens_ahead
