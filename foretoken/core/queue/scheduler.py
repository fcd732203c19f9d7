"""Queue replay: how long until a new request's first token on one worker (PRODUCT.md §1
"How much is ahead", §3 "Prefill cost model and queue replay").

The engine's step scheduler, replayed from a worker's estimated queue. One step:

1. **Running sequences first**, in admission order, while budget is left: a decoding
   sequence takes 1 token of ``max_num_batched_tokens``; a partial prefill takes its next
   chunk, capped by ``long_prefill_token_threshold`` (0 = no cap) and the budget left.
2. **Then waiting sequences in arrival order**, while budget is left and fewer than
   ``max_num_seqs`` run, each taking a chunk the same way. With ``chunked_prefill`` off
   (a serial engine) a prompt is prefilled whole in one step: it waits until it fits the
   budget left, and a prompt larger than the whole budget runs in a step in which nothing
   else prefills.
3. The step lasts ``step_overhead_s`` + Σ chunks ``C(end) − C(start)`` + decoding
   sequences × ``decode_s_per_seq``. A sequence whose prompt is complete at the step's
   end emits its first token; one that has produced all its output tokens leaves.

**Stretches.** A step that admits nobody repeats itself, unchanged, until a sequence
completes its prompt or (in a replay of the future) produces its last token: the same
sequences take the same chunk sizes, so ``k`` such steps are computed at once, their
prefill time by telescoping ``Σ C(p + (j+1)·c) − C(p + j·c) = C(p + k·c) − C(p)``. A
128k-token prompt behind 8192-token steps is one stretch, and so is a long run of
decode-only steps. Decoders are kept as parallel lists (see :class:`_Scheduler`), so a
stretch costs O(partial prefills · log running) plus a few list operations in C.

**In-flight estimate.** The worker never reports prefill progress, so
:class:`InFlightEstimate` keeps a running simulation of the engine from the requests'
send times, advanced lazily to each prediction's ``now`` and corrected by what is
observed (a first token completes a prefill; a completion removes a request). A
request without a first token is never presented as done: it keeps at least one chunk.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING, Final, Literal, Protocol

import msgspec

from foretoken.core.types import SchedulerSettings

if TYPE_CHECKING:
    from foretoken.core.queue.tails import OutputTail

# Output tokens a sequence is assumed to have left when its estimate has run out.
MIN_OUTPUT_TOKENS_LEFT: Final = 1
# A run length with no bound from the sequences (only from time).
_UNBOUNDED: Final = 1 << 62
# The new request's output budget in a replay: it never leaves before its first token.
_NEVER_LEAVES: Final = 1 << 62

Phase = Literal["queued", "prefilling", "decoding"]


# ----------------------------------------------------------------------------- cost


class StepCost(Protocol):
    """What one engine step costs: the worker's learned prefill curve and step terms."""

    @property
    def step_overhead_s(self) -> float: ...

    @property
    def decode_s_per_seq(self) -> float: ...

    def chunk_s(self, start_token: int, end_token: int) -> float:
        """Prefill time of prompt tokens start_token..end_token: C(end) − C(start)."""
        ...


@dataclass(frozen=True, slots=True)
class CurveStepCost:
    """A :class:`StepCost` from a prefill curve ``C(N)`` in seconds (e.g. a fitted one).

    ``quadratic`` = ``(a, b)`` states that ``prefill_s(n)`` is exactly ``n * (a + b * n)``
    (``PrefillCurve.cost_s``): the native walk (:mod:`foretoken.core.queue.native_walk`)
    then computes the same numbers itself. None: only the Python walk knows the curve."""

    prefill_s: Callable[[int], float]
    step_overhead_s: float = 0.0
    decode_s_per_seq: float = 0.0
    quadratic: tuple[float, float] | None = None

    def chunk_s(self, start_token: int, end_token: int) -> float:
        return self.prefill_s(end_token) - self.prefill_s(start_token)


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class SeqState:
    """One sequence in a worker's queue: its prompt, how much of it is computed (cached
    tokens included), and how many output tokens it has left (its first token included
    while it prefills)."""

    prompt_tokens: int
    computed_tokens: int
    output_tokens_left: int

    @property
    def prefill_tokens_left(self) -> int:
        return max(self.prompt_tokens - self.computed_tokens, 0)


@dataclass(frozen=True, slots=True)
class QueueState:
    """A worker's queue as a replay starts from it: running sequences in admission
    order, waiting ones in arrival order, and when the engine's current step ends."""

    free_at_s: float
    running: tuple[SeqState, ...] = ()
    waiting: tuple[SeqState, ...] = ()

    @property
    def prefill_tokens_left(self) -> int:
        return sum(s.prefill_tokens_left for s in self.running) + sum(
            s.prefill_tokens_left for s in self.waiting
        )


class NewRequest(msgspec.Struct, frozen=True, gc=False):
    """A request asked about (a msgspec Struct: one is built per candidate of every route
    call, ~10x cheaper than a frozen dataclass)."""

    prompt_tokens: int
    cached_tokens: int = 0
    # Output tokens it reserves KV blocks for (only read with a :class:`KvModel`).
    output_tokens: int = 1
    # Of its cached tokens, how many a sequence still on the engine holds (only read with
    # a :class:`KvModel`): the rest are free cached blocks it takes out of the pool. -1: all.
    pinned_tokens: int = -1


@dataclass(frozen=True, slots=True)
class KvModel:
    """The engine's KV capacity as its registration reports it. An admitted sequence
    reserves every block it will need, ``ceil((prompt + output − 1) / block_size)`` less
    the blocks of its cached prefix that another sequence on the engine holds (shared with
    it), and the head of the waiting queue — with everyone behind it — waits until its
    blocks fit (a sequence alone on the engine always starts). A cached block nobody holds
    sits in the free pool (evictable), and a hit on it takes it out: it is charged, as
    vLLM's ``get_num_blocks_to_allocate`` counts evictable computed blocks."""

    gpu_blocks: int
    block_size: int

    def blocks(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        total = -(-(prompt_tokens + max(output_tokens, 1) - 1) // self.block_size)
        total -= max(cached_tokens, 0) // self.block_size
        return max(min(total, self.gpu_blocks), 1)


class QueuePrediction(msgspec.Struct, frozen=True, gc=False):
    """A prediction: ``queue_wait_s + prefill_s == ttft_s`` (the wait clamped at 0)."""

    queue_wait_s: float
    prefill_s: float
    ttft_s: float
    # Engine steps from the replay's start through the one that yields the first token.
    steps: int
    # Prefill tokens of the queue not yet computed when the request arrives.
    queue_tokens_ahead: int


def prefill_span(prompt_tokens: int, cached_tokens: int) -> tuple[int, int]:
    """(first token to compute, prompt length): at least one token is always computed, as
    an engine never credits a whole prompt from its cache."""
    prompt = max(prompt_tokens, 1)
    return min(max(cached_tokens, 0), prompt - 1), prompt


def pinned_prefix(first: int, pinned_tokens: int) -> int:
    """The cached tokens (of the ``first`` credited) whose blocks another sequence holds:
    ``pinned_tokens``, or all of them when it is negative (unknown)."""
    return first if pinned_tokens < 0 else min(pinned_tokens, first)


# ----------------------------------------------------------------------------- the core


@dataclass(frozen=True, slots=True)
class Stretch:
    """``steps`` identical engine steps from ``start_s``, as recorded for a replay of the
    future: each step lasts ``per_step_s`` plus the prefill of ``chunks`` ((tokens computed
    before the stretch, tokens per step) of each partial prefill), leaves ``budget_left``
    tokens of the step budget unused, runs ``running`` sequences and leaves ``waiting``
    ones waiting."""

    start_s: float
    steps: int
    per_step_s: float
    chunks: tuple[tuple[int, int], ...]
    budget_left: int
    running: int
    waiting: int
    kv_used: int = 0  # KV blocks the running sequences reserve (with a KvModel)

    def end_of_step_s(self, j: int, cost: StepCost) -> float:
        """When the stretch's ``j``-th step (1-based) ends."""
        chunk_s = cost.chunk_s
        total_s = self.start_s + j * self.per_step_s
        for computed, size in self.chunks:
            total_s += chunk_s(computed, computed + j * size)
        return total_s


_WAITING: Final = 0
_PREFILLING: Final = 1
_DECODING: Final = 2
_GONE: Final = 3


class _Seq:
    """A sequence inside a replay (mutable; compared by identity)."""

    __slots__ = (
        "blocks", "computed", "done_s", "end", "expected", "first", "key", "left", "order", "seen",
        "tail", "where",
    )  # fmt: skip

    def __init__(self, first: int, computed: int, end: int, left: int, key: object = None) -> None:
        self.first = first  # first uncached prompt token
        self.computed = computed
        self.end = end
        self.left = left  # output tokens left while it prefills (its first one included)
        self.expected = left  # output tokens expected in all
        self.key = key
        self.seen = False  # its first token was seen
        self.order = -1  # admission order once running
        self.where = _WAITING
        self.blocks = 0  # KV blocks reserved while running (with a KvModel)
        self.done_s = math.inf  # when the simulation finished its prefill
        self.tail: OutputTail | None = None  # its answer's length as learned (tails.py)


class _Scheduler:
    """The step scheduler. Running sequences are kept in two lists ordered by admission:
    partial prefills (``_Seq``), and decoders as parallel lists (admission order, the step
    at whose end each emits its last token, the sequence). Since a step's budget runs out
    in admission order, the decoders it serves are always a prefix of the decoders.

    ``retire``: sequences leave after their last output token (a replay of the future);
    without it they stay until removed (the in-flight estimate, which learns of
    completions from outcomes)."""

    def __init__(
        self, settings: SchedulerSettings, *, retire: bool, kv: KvModel | None = None
    ) -> None:
        self.kv = kv
        self.kv_cap = kv.gpu_blocks if kv is not None else 0
        self.kv_used = 0
        self.budget = settings.max_num_batched_tokens
        self.max_seqs = settings.max_num_seqs
        self.chunked = settings.chunked_prefill
        self.cap = settings.long_prefill_token_threshold if self.chunked else 0
        self.retire = retire
        self.prefilling: list[_Seq] = []
        self.dec_orders: list[int] = []
        self.dec_done: list[int] = []
        self.dec_seqs: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.free_at_s = -math.inf
        self.steps = 0
        self.next_order = 0
        # When a list: every stretch run is appended to it (see foretoken.core.queue.future).
        self.record: list[Stretch] | None = None

    @property
    def idle(self) -> bool:
        return not self.prefilling and not self.dec_orders and not self.waiting

    @property
    def running_count(self) -> int:
        return len(self.prefilling) + len(self.dec_orders)

    def has_prefill(self) -> bool:
        return bool(self.waiting) or bool(self.prefilling)

    def min_chunk(self, seq: _Seq) -> int:
        """The smallest last chunk this sequence's prefill can have."""
        uncached = seq.end - seq.first
        if not self.chunked:
            return uncached
        return min(uncached, self.cap or self.budget, self.budget)

    def blocks_of(self, seq: _Seq, output_tokens: int, pinned_tokens: int = -1) -> int:
        """The blocks ``seq`` reserves; ``pinned_tokens`` of its cached prefix are held by
        another sequence (-1: all of it)."""
        kv = self.kv
        if kv is None:
            return 0
        return kv.blocks(seq.end, pinned_prefix(seq.first, pinned_tokens), output_tokens)

    def start_decoding(self, seq: _Seq, tokens_left: int) -> None:
        index = bisect_left(self.dec_orders, seq.order)
        self.dec_orders.insert(index, seq.order)
        self.dec_done.insert(index, self.steps + tokens_left)
        self.dec_seqs.insert(index, seq)
        seq.where = _DECODING

    def drop_decoder(self, seq: _Seq) -> None:
        index = self.dec_seqs.index(seq)
        del self.dec_orders[index], self.dec_done[index], self.dec_seqs[index]
        seq.where = _GONE
        self.kv_used -= seq.blocks

    def run_stretch(self, cost: StepCost, until_s: float = math.inf) -> bool:
        """Run the next step and every identical one after it that starts before
        ``until_s``; False when no step can start before ``until_s`` or nothing is left."""
        start_s = self.free_at_s
        if start_s >= until_s:
            return False
        sizes, decoders, admitted = self._plan()
        if not sizes and not decoders:
            return False
        per_step_s = cost.step_overhead_s + decoders * cost.decode_s_per_seq
        steps = 1 if admitted else self._run_length(sizes, decoders)
        if until_s < math.inf and steps > 1:
            steps = self._steps_before(until_s, steps, per_step_s, sizes, cost)
            if steps == 0:  # decode-only steps that take no time: jump to until_s
                self.free_at_s = until_s
                return False
        elif steps >= _UNBOUNDED:
            raise ValueError("an unbounded stretch needs a time bound")
        self.free_at_s = start_s + steps * per_step_s + self._prefill_s(sizes, steps, cost)
        if self.record is not None:
            chunks = tuple(
                (seq.computed, size) for seq, size in zip(self.prefilling, sizes, strict=False)
            )
            left = self.budget - decoders - sum(sizes)
            running = len(self.prefilling) + len(self.dec_orders)
            stretch = Stretch(start_s, steps, per_step_s, chunks, left, running, len(self.waiting),
                              self.kv_used)  # fmt: skip
            self.record.append(stretch)
        self._advance(sizes, decoders, steps)
        return True

    def _prefill_s(self, sizes: list[int], steps: int, cost: StepCost) -> float:
        """Prefill time of ``steps`` identical steps (telescoped per sequence)."""
        chunk_s = cost.chunk_s
        total_s = 0.0
        for seq, size in zip(self.prefilling, sizes, strict=False):  # the first len(sizes)
            total_s += chunk_s(seq.computed, seq.computed + steps * size)
        return total_s

    def _plan(self) -> tuple[list[int], int, bool]:
        """One step: chunk sizes of the first ``len(sizes)`` partial prefills (admissions
        appended), how many of the first decoders decode, and whether anyone was admitted."""
        budget = self.budget
        sizes: list[int] = []
        orders = self.dec_orders
        chunked, cap = self.chunked, self.cap
        decoders = passed = 0
        for seq in self.prefilling:
            before = bisect_left(orders, seq.order)  # decoders admitted before it
            take = before - passed if before - passed < budget else budget
            decoders += take
            budget -= take
            passed = before
            if budget <= 0:
                return sizes, decoders, False
            size = seq.end - seq.computed
            if chunked:
                size = cap if 0 < cap < size else size
                size = budget if budget < size else size
            sizes.append(size)
            budget -= size
            if budget <= 0:
                return sizes, decoders, False
        take = min(len(orders) - passed, budget)
        return sizes, decoders + take, self._admit(budget - take, sizes)

    def _admit(self, budget: int, sizes: list[int]) -> bool:
        waiting, prefilling = self.waiting, self.prefilling
        chunked, cap = self.chunked, self.cap
        running = len(prefilling) + len(self.dec_orders)
        admitted = False
        kv_used, kv_cap = self.kv_used, self.kv_cap
        while waiting and budget > 0 and running < self.max_seqs:
            seq = waiting[0]
            if kv_used and kv_used + seq.blocks > kv_cap:
                break  # its KV blocks do not fit: it waits, and everyone behind it
            size = seq.end - seq.computed
            if chunked:
                size = cap if 0 < cap < size else size
                size = budget if budget < size else size
            elif size > budget and (size <= self.budget or sizes):
                break  # serial: the head waits until it fits, and everyone behind it
            waiting.popleft()
            seq.order = self.next_order
            self.next_order += 1
            seq.where = _PREFILLING
            kv_used += seq.blocks
            prefilling.append(seq)
            sizes.append(size)
            budget -= size
            running += 1
            admitted = True
        self.kv_used = kv_used
        return admitted

    def _run_length(self, sizes: list[int], decoders: int) -> int:
        """How many times a step that admitted nobody repeats unchanged (its last
        repetition may complete a prompt or, with ``retire``, a sequence's output)."""
        steps = _UNBOUNDED
        for seq, size in zip(self.prefilling, sizes, strict=False):  # the first len(sizes)
            repeats = (seq.end - seq.computed) // size
            steps = repeats if repeats < steps else steps
        if self.retire and decoders:
            done = self.dec_done
            last = min(done) if decoders == len(done) else min(done[:decoders])
            steps = min(steps, last - self.steps)
        return steps

    def _steps_before(
        self, until_s: float, steps: int, per_step_s: float, sizes: list[int], cost: StepCost
    ) -> int:
        """Of ``steps`` identical steps from ``free_at_s``, how many start before
        ``until_s`` (at least one; 0 only for steps that take no time)."""
        start_s = self.free_at_s
        if not sizes:
            if per_step_s <= 0:
                return 0
            return min(steps, max(1, math.ceil((until_s - start_s) / per_step_s)))

        def start_of(j: int) -> float:
            return start_s + j * per_step_s + self._prefill_s(sizes, j, cost)

        if start_of(steps - 1) < until_s:
            return steps
        low, high = 0, steps - 1  # start_of(low) < until_s <= start_of(high)
        while high - low > 1:
            middle = (low + high) // 2
            if start_of(middle) < until_s:
                low = middle
            else:
                high = middle
        return low + 1

    def _advance(self, sizes: list[int], decoders: int, steps: int) -> None:
        self.steps += steps
        done = self.dec_done
        if decoders < len(done):  # the ones the budget did not reach wait as long
            done[decoders:] = [d + steps for d in done[decoders:]]
        if self.retire and done and min(done) <= self.steps:
            self._retire_decoders()
        prefilling = self.prefilling
        completed = False
        for seq, size in zip(prefilling, sizes, strict=False):  # the first len(sizes)
            seq.computed += steps * size
            completed = completed or seq.computed >= seq.end
        if completed:
            self.prefilling = [s for s in prefilling if s.computed < s.end]
            for seq in prefilling[: len(sizes)]:
                if seq.computed >= seq.end:
                    self._first_token(seq)

    def _first_token(self, seq: _Seq) -> None:
        seq.done_s = self.free_at_s
        seq.left -= 1
        if self.retire and seq.left <= 0:
            seq.where = _GONE
            self.kv_used -= seq.blocks
        else:
            self.start_decoding(seq, seq.left)

    def _retire_decoders(self) -> None:
        now = self.steps
        kept = [d > now for d in self.dec_done]
        if self.kv is not None:
            self.kv_used -= sum(s.blocks for s, k in zip(self.dec_seqs, kept, strict=True) if not k)
        self.dec_orders = list(compress(self.dec_orders, kept))
        self.dec_done = list(compress(self.dec_done, kept))
        self.dec_seqs = list(compress(self.dec_seqs, kept))


_admission_order = attrgetter("order")


def _run_to_first_token(
    scheduler: _Scheduler,
    new_request: NewRequest,
    now_s: float,
    cost: StepCost,
    tokens_ahead: int,
) -> QueuePrediction:
    first, prompt = prefill_span(new_request.prompt_tokens, new_request.cached_tokens)
    target = _Seq(first, first, prompt, _NEVER_LEAVES)
    target.blocks = scheduler.blocks_of(
        target, new_request.output_tokens, new_request.pinned_tokens
    )
    scheduler.waiting.append(target)
    scheduler.free_at_s = max(scheduler.free_at_s, now_s)
    steps_before = scheduler.steps
    while target.computed < target.end:
        if not scheduler.run_stretch(cost):
            raise RuntimeError("the replay stalled before the new request's first token")
    ttft_s = scheduler.free_at_s - now_s
    prefill_s = cost.chunk_s(first, prompt)
    return QueuePrediction(
        queue_wait_s=max(ttft_s - prefill_s, 0.0),
        prefill_s=prefill_s,
        ttft_s=ttft_s,
        steps=scheduler.steps - steps_before,
        queue_tokens_ahead=tokens_ahead,
    )


def _run_to_drain(scheduler: _Scheduler, now_s: float, cost: StepCost) -> float:
    if not scheduler.has_prefill():
        return 0.0
    scheduler.free_at_s = max(scheduler.free_at_s, now_s)
    while scheduler.has_prefill():
        if not scheduler.run_stretch(cost):
            raise RuntimeError("the replay stalled before the queue drained")
    return scheduler.free_at_s - now_s


def _scheduler_from(
    settings: SchedulerSettings, queue_state: QueueState, kv: KvModel | None = None
) -> _Scheduler:
    scheduler = _Scheduler(settings, retire=True, kv=kv)
    scheduler.free_at_s = queue_state.free_at_s
    scheduler.next_order = len(queue_state.running)
    for order, state in enumerate(queue_state.running):
        seq = _seq_from(state)
        seq.blocks = scheduler.blocks_of(seq, seq.left)
        scheduler.kv_used += seq.blocks
        seq.order = order
        if seq.computed < seq.end:
            seq.where = _PREFILLING
            scheduler.prefilling.append(seq)
        else:
            seq.where = _DECODING
            scheduler.dec_orders.append(order)
            scheduler.dec_done.append(seq.left)  # at step 0: its last token's step
            scheduler.dec_seqs.append(seq)
    for state in queue_state.waiting:
        seq = _seq_from(state)
        seq.blocks = scheduler.blocks_of(seq, seq.left)
        scheduler.waiting.append(seq)
    return scheduler


def _seq_from(state: SeqState) -> _Seq:
    computed = state.computed_tokens
    left = max(state.output_tokens_left, MIN_OUTPUT_TOKENS_LEFT)
    return _Seq(computed, computed, state.prompt_tokens, left)


# ----------------------------------------------------------------------------- replay API


def simulate_until_first_token(
    settings: SchedulerSettings,
    queue_state: QueueState,
    new_request: NewRequest,
    now_s: float,
    cost: StepCost,
    kv: KvModel | None = None,
) -> QueuePrediction:
    """Replay the worker's scheduler from ``now_s`` (or from the end of its current step)
    with ``new_request`` arriving at ``now_s`` behind everything in ``queue_state``; the
    step that completes its prompt yields its first token (with ``kv``, admission also
    waits for KV blocks)."""
    scheduler = _scheduler_from(settings, queue_state, kv)
    return _run_to_first_token(scheduler, new_request, now_s, cost, queue_state.prefill_tokens_left)


def projected_drain_s(
    settings: SchedulerSettings, queue_state: QueueState, now_s: float, cost: StepCost
) -> float:
    """Seconds from ``now_s`` until every prompt now in the queue is prefilled (nothing
    waits to prefill any more): when a retry would find the worker's queue drained."""
    return _run_to_drain(_scheduler_from(settings, queue_state), now_s, cost)
