"""The pure engine model of the fleet simulator: a vLLM-v1-like step scheduler over a
prefix cache, timed by the engine's hidden true cost (PRODUCT.md §3 "Fleet simulator").

There is no clock inside: the caller says what time it is. ``submit`` queues a request,
``step(now_s)`` runs one engine step that starts at ``now_s`` and returns how long it
lasts and what happened at its end; ``next_event_time`` says when the next step can
start. A real-time driver sleeps until then, a discrete-event replay jumps there — both
run this same code.

One step, as vLLM v1 schedules it:

1. **Running requests first**, in admission order. A decoding request takes 1 token of
   the ``max_num_batched_tokens`` budget; a partial prefill takes its next chunk, capped
   by ``long_prefill_token_threshold`` (0 = no cap) and by the budget left.
2. **Then waiting requests in arrival order** while budget is left and fewer than
   ``max_num_seqs`` run: look the prompt up in the prefix cache (cached tokens are
   skipped), take a chunk the same way and start running. With ``chunked_prefill`` off,
   a prompt must fit the budget whole. The head of the queue waits — and so does every
   request behind it — when the GPU cannot hold all the blocks it will need.
3. The step lasts ``step_overhead_s`` + Σ prefill chunks ``C(end) − C(start)`` with
   ``C(N) = a·N + b·N²`` (+ ``tier tokens × load cost`` for offload-tier hits, loaded
   synchronously in the request's first step) + Σ decoding sequences
   (``decode_s_per_seq + decode_s_per_context_token × context``), times a lognormal
   noise factor of median 1, plus a stall with its probability. Noise and stalls come
   from two seeded streams, each drawn ahead in blocks.
4. At the end of the step every request whose prompt is now fully computed emits its
   first token, every decoding request one more token; a request that reached
   ``max_tokens`` finishes and frees its blocks (they stay cached until reused).

**Decode runs.** :meth:`EngineModel.decode_run` computes a stretch of steps in which every
running request only decodes (nothing waits that could start) in one go — one duration
per step, per-request work only where a request's next token opens a KV block — with
exactly the results, times and random draws of calling :meth:`EngineModel.step` once
per step.

**No preemption.** An admitted request reserves every KV block it will ever need
(``ceil((prompt + max_tokens − 1) / block_size)``), so a running request never runs out
of blocks and nothing is preempted; the price is that admission is more conservative than
vLLM's (which admits on the prompt's blocks and preempts when decoding runs out). A
request that could never fit is refused at ``submit`` with :class:`RequestTooLarge`.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from foretoken.core.cost.samples import decode_step_s
from foretoken.core.types import EngineBlockHash, RequestId, WorkerId
from foretoken.sim.prefix_cache import CacheHit, KvCacheEvent, KvEventDetail, PrefixCache, TokenIds
from foretoken.sim.spec import EngineSpec
from foretoken.wire.records import Tier

# Tolerance when comparing caller-supplied times (float sums of step durations).
TIME_EPSILON_S = 1e-9
NOISE_MEDIAN_LOG = 0.0
# The stall stream's seed is (truth.seed, STALL_STREAM); the noise stream's is truth.seed.
STALL_STREAM = 1
# Random values are drawn ahead this many at a time.
DRAW_BLOCK = 4096
# Step ends kept before the log is trimmed to the oldest first token still decoding.
STEP_LOG_MAX = 1 << 16


class RequestTooLarge(ValueError):
    """A request this engine could never serve (more KV blocks than the GPU holds, or a
    prompt over the step budget with chunked prefill off)."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: RequestId
    time_s: float
    arrival_s: float
    prompt_tokens: int
    # vLLM's usage.prompt_tokens_details.cached_tokens (every tier's hit counts).
    cached_tokens: int
    cached_tier: Tier | None

    @property
    def ttft_s(self) -> float:
        return self.time_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: RequestId
    time_s: float
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # A decode step's time from the gaps between its tokens (core.cost.samples.decode_step_s).
    decode_step_s: float | None = None


class ScheduledChunk(NamedTuple):
    """Work of one request in one step: tokens start_token..start_token+num_tokens."""

    request_id: RequestId
    start_token: int
    num_tokens: int
    prefill: bool


@dataclass(frozen=True, slots=True)
class StepResult:
    start_s: float
    duration_s: float
    chunks: tuple[ScheduledChunk, ...]
    first_tokens: tuple[FirstToken, ...]
    # Requests that produced one output token at end_s (first tokens included).
    tokens: tuple[RequestId, ...]
    finished: tuple[Finished, ...]
    kv_events: tuple[KvCacheEvent, ...]
    stalled: bool = False

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Consecutive decode-only steps computed at once (see :meth:`EngineModel.decode_run`)."""

    start_s: float
    # When each step ends; the next one starts there.
    step_ends_s: tuple[float, ...]
    # (step index, the KV events of that step), only for steps that had some.
    kv_events: tuple[tuple[int, tuple[KvCacheEvent, ...]], ...]
    # Requests that finished at the end of the last step.
    finished: tuple[Finished, ...]
    stalled_steps: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.step_ends_s)

    @property
    def end_s(self) -> float:
        return self.step_ends_s[-1]


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    gpu_blocks: int
    gpu_blocks_free: int
    gpu_blocks_reserved: int
    tier_usage: dict[Tier, int]


@dataclass(eq=False, slots=True)
class _Request:
    request_id: RequestId
    token_ids: np.ndarray
    block_hashes: tuple[EngineBlockHash, ...]
    max_tokens: int
    arrival_s: float
    total_blocks: int
    prompt_tokens: int
    num_computed: int = 0
    output_tokens: int = 0
    hit: CacheHit | None = None
    first_step: int = -1  # index of its first token's step end in the engine's log

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


# One request's work in a step: (request, start token, tokens, prefill?, tier load seconds).
_Planned = tuple[_Request, int, int, bool, float]


class _Draws:
    """A seeded random stream drawn ``DRAW_BLOCK`` values at a time, consumed in order."""

    def __init__(self, draw: Callable[[int], np.ndarray]) -> None:
        self._draw = draw
        self._values: list[float] = []
        self._pos = 0

    def next(self) -> float:
        if self._pos == len(self._values):
            self._values = self._draw(DRAW_BLOCK).tolist()
            self._pos = 0
        value = self._values[self._pos]
        self._pos += 1
        return value


class EngineModel:
    """One simulated engine, driven by an external clock (seconds, any origin).
    ``kv_events`` is how much its steps' KV events say (:data:`KvEventDetail`)."""

    def __init__(self, spec: EngineSpec, *, kv_events: KvEventDetail = "full") -> None:
        self.spec = spec
        self._truth = spec.truth
        self._settings = spec.scheduler
        self.cache = PrefixCache(
            block_size=spec.block_size,
            gpu_blocks=spec.kv.gpu_blocks,
            hash_seed=spec.effective_hash_seed,
            hash_algo=spec.kv_hash_algo,
            lower_tiers=spec.kv.lower_tiers(),
            eagle=spec.eagle,
            kv_events=kv_events,
        )
        truth = spec.truth
        noise_rng = np.random.default_rng(truth.seed)
        stall_rng = np.random.default_rng((truth.seed, STALL_STREAM))
        self._noise = _Draws(lambda n: noise_rng.lognormal(NOISE_MEDIAN_LOG, truth.noise_sigma, n))
        self._stall = _Draws(stall_rng.random)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[RequestId, _Request] = {}
        self._busy_until_s = -math.inf
        self._step_ends = array("d")  # steps' ends, for the token gaps (trimmed: STEP_LOG_MAX)

    # ------------------------------------------------------------------ state

    @property
    def worker_id(self) -> WorkerId:
        return self.spec.id

    @property
    def is_idle(self) -> bool:
        return not self._waiting and not self._running

    @property
    def busy_until_s(self) -> float:
        """When the last step ends (−inf before the first step)."""
        return self._busy_until_s

    @property
    def next_event_time(self) -> float | None:
        """When the next step can start; None when there is nothing to do."""
        if self._running:
            return self._busy_until_s
        if self._waiting:
            return max(self._busy_until_s, self._waiting[0].arrival_s)
        return None

    def waiting_ids(self) -> tuple[RequestId, ...]:
        return tuple(request.request_id for request in self._waiting)

    def running_ids(self) -> tuple[RequestId, ...]:
        return tuple(request.request_id for request in self._running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            gpu_blocks=self.cache.gpu_blocks,
            gpu_blocks_free=self.cache.num_free_blocks,
            gpu_blocks_reserved=self.cache.num_reserved_blocks,
            tier_usage=self.cache.tier_usage(),
        )

    def retune(self, spec: EngineSpec) -> None:
        """A schedule change: the same engine, other true costs from its next step on."""
        self.spec, self._truth = spec, spec.truth

    # ------------------------------------------------------------------ requests

    def submit(
        self, request_id: RequestId, token_ids: TokenIds, max_tokens: int, now_s: float
    ) -> None:
        """Queue a request that arrived at ``now_s``."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already queued or running")
        if len(token_ids) == 0:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        total_blocks = self.cache.blocks_for(len(token_ids) + max_tokens - 1)
        if total_blocks > self.cache.gpu_blocks:
            raise RequestTooLarge(
                f"{len(token_ids)} prompt + {max_tokens} output tokens need {total_blocks} "
                f"KV blocks; {self.worker_id} has {self.cache.gpu_blocks}"
            )
        if (
            not self._settings.chunked_prefill
            and len(token_ids) > self._settings.max_num_batched_tokens
        ):
            raise RequestTooLarge(
                f"a {len(token_ids)}-token prompt exceeds max_num_batched_tokens "
                f"{self._settings.max_num_batched_tokens} with chunked prefill off"
            )
        tokens = np.asarray(token_ids)
        request = _Request(
            request_id=request_id,
            token_ids=tokens,
            block_hashes=self.cache.hash_prompt(tokens),
            max_tokens=max_tokens,
            arrival_s=now_s,
            total_blocks=total_blocks,
            prompt_tokens=len(tokens),
        )
        self._waiting.append(request)
        self._requests[request_id] = request

    def cancel(self, request_id: RequestId) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request in self._waiting:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self.cache.free(request_id)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (emits AllCleared); refused while requests run."""
        return not self._running and self.cache.reset()

    def drain_events(self) -> list[KvCacheEvent]:
        """KV events not yet returned by a step (e.g. from a reset)."""
        return self.cache.drain_events()

    # ------------------------------------------------------------------ stepping

    def step(self, now_s: float) -> StepResult:
        """Schedule and run one step starting at ``now_s`` (not before the last one ended)."""
        self._check_start(now_s)
        plan: list[_Planned] = []
        budget = self._schedule_running(self._settings.max_num_batched_tokens, plan)
        self._schedule_waiting(budget, plan, now_s)
        if not plan:
            events = tuple(self.cache.drain_events())
            return StepResult(now_s, 0.0, (), (), (), (), events)
        duration_s, stalled = self._duration_s(plan)
        end_s = now_s + duration_s
        self._busy_until_s = end_s
        self._step_ends.append(end_s)
        chunks = tuple(
            ScheduledChunk(request.request_id, start, num_tokens, prefill)
            for request, start, num_tokens, prefill, _ in plan
        )
        first_tokens, tokens, finished = self._advance(plan, end_s)
        return StepResult(
            start_s=now_s,
            duration_s=duration_s,
            chunks=chunks,
            first_tokens=first_tokens,
            tokens=tokens,
            finished=finished,
            kv_events=tuple(self.cache.drain_events()),
            stalled=stalled,
        )

    # ------------------------------------------------------------------ decode runs

    def decode_run(self, now_s: float, until_s: float) -> DecodeRun | None:
        """Run at once the decode-only steps from ``now_s`` on: the step at ``now_s`` and
        each next one that starts before ``until_s``, ending after the first step in which
        a request finishes. Times, KV events, finishes and random draws are exactly those
        of calling :meth:`step` at each step's start. None when the step at ``now_s``
        would not be decode-only (call :meth:`step` instead)."""
        self._check_start(now_s)
        running = self._running
        if not self._decode_only():
            return None
        size = len(running)
        # Step j decodes every running request: its context sum is first_context + size·j.
        first_context = sum(r.num_computed for r in running) + size
        steps_left = min(r.max_tokens - r.output_tokens for r in running)
        ends, stalls = self._run_times(now_s, until_s, size, first_context, steps_left)
        count = len(ends)
        self._step_ends.extend(ends)
        kv_events = self._run_commits(count)
        finished: list[Finished] = []
        end_s = ends[-1]
        for request in running:
            request.num_computed += count
            request.output_tokens += count
            if request.output_tokens >= request.max_tokens:
                finished.append(self._finish(request, end_s))
        if finished:
            self._running = [r for r in running if r.output_tokens < r.max_tokens]
        self._busy_until_s = end_s
        return DecodeRun(now_s, tuple(ends), kv_events, tuple(finished), stalls)

    def _decode_only(self) -> bool:
        """Whether the next step only decodes: every running request is past its prompt,
        the budget covers them all, and no waiting request could start."""
        running, settings = self._running, self._settings
        if not running or len(running) > settings.max_num_batched_tokens:
            return False
        if self._waiting and len(running) < settings.max_num_seqs:
            return False
        return all(r.num_computed >= r.prompt_tokens for r in running)

    def _run_times(
        self, now_s: float, until_s: float, size: int, first_context: int, steps_left: int
    ) -> tuple[list[float], int]:
        """The end times of the run's steps and how many of them stalled: each step is
        timed with :meth:`_duration_s`'s arithmetic and :meth:`_perturb`'s draws, and the
        next one starts at its end while that is before ``until_s``."""
        truth = self._truth
        decode_s = size * truth.decode_s_per_seq
        ends: list[float] = []
        stalls = 0
        end_s, context = now_s, first_context
        while True:
            duration_s, stalled = self._perturb(
                truth.step_overhead_s + (decode_s + truth.decode_s_per_context_token * context)
            )
            end_s += duration_s
            ends.append(end_s)
            stalls += stalled
            if len(ends) == steps_left or end_s >= until_s:
                return ends, stalls
            context += size

    def _run_commits(self, count: int) -> tuple[tuple[int, tuple[KvCacheEvent, ...]], ...]:
        """Take a new KV block for each request at each step where its next token opens
        one (in step order, then running order, as :meth:`step` would) and collect each
        step's KV events."""
        block_size = self.cache.block_size
        running = self._running
        crossings = sorted(
            (step, order)
            for order, request in enumerate(running)
            for step in range(-request.num_computed % block_size, count, block_size)
        )
        collected: list[tuple[int, tuple[KvCacheEvent, ...]]] = []
        current = 0
        for step, order in crossings:
            if step != current:
                self._collect_events(current, collected)
                current = step
            request = running[order]
            self.cache.commit(request.request_id, request.num_computed + step + 1)
        self._collect_events(current, collected)
        return tuple(collected)

    def _collect_events(
        self, step: int, collected: list[tuple[int, tuple[KvCacheEvent, ...]]]
    ) -> None:
        events = self.cache.drain_events()
        if events:
            collected.append((step, tuple(events)))

    def _check_start(self, now_s: float) -> None:
        if now_s < self._busy_until_s - TIME_EPSILON_S:
            raise ValueError(
                f"step at {now_s} starts before the previous step ends ({self._busy_until_s})"
            )

    def _chunk(self, remaining: int, budget: int) -> int:
        threshold = self._settings.long_prefill_token_threshold
        if self._settings.chunked_prefill and 0 < threshold < remaining:
            remaining = threshold
        return min(remaining, budget)

    def _schedule_running(self, budget: int, plan: list[_Planned]) -> int:
        block_size = self.cache.block_size
        for request in self._running:
            if budget == 0:
                break
            computed = request.num_computed
            if computed >= request.prompt_tokens:
                # Decoding: one token; the cache only changes when it opens a new block.
                if computed % block_size == 0:
                    self.cache.commit(request.request_id, computed + 1)
                plan.append((request, computed, 1, False, 0.0))
                budget -= 1
                continue
            num_tokens = self._chunk(request.num_tokens - computed, budget)
            self.cache.commit(request.request_id, computed + num_tokens)
            plan.append((request, computed, num_tokens, True, 0.0))
            budget -= num_tokens
        return budget

    def _schedule_waiting(self, budget: int, plan: list[_Planned], now_s: float) -> None:
        while self._waiting and budget > 0 and len(self._running) < self._settings.max_num_seqs:
            if self._waiting[0].arrival_s > now_s + TIME_EPSILON_S:
                return
            planned = self._admit(self._waiting[0], budget)
            if planned is None:
                return
            plan.append(planned)
            budget -= planned[2]

    def _admit(self, request: _Request, budget: int) -> _Planned | None:
        """Start the head of the waiting queue if its chunk and its blocks fit."""
        hit = self.cache.lookup(request.block_hashes, request.prompt_tokens)
        remaining = request.prompt_tokens - hit.cached_tokens
        num_tokens = self._chunk(remaining, budget)
        if not self._settings.chunked_prefill and num_tokens < remaining:
            return None
        if not self.cache.can_allocate(request.block_hashes, hit, request.total_blocks):
            return None
        rid = request.request_id
        self.cache.allocate(rid, request.token_ids, request.block_hashes, hit, request.total_blocks)
        self.cache.commit(rid, hit.cached_tokens + num_tokens)
        self._waiting.popleft()
        self._running.append(request)
        request.hit = hit
        request.num_computed = hit.cached_tokens
        return (request, hit.cached_tokens, num_tokens, True, self._load_s(hit))

    def _load_s(self, hit: CacheHit) -> float:
        return sum(
            hit.tokens_in(tier) * self._truth.load_s_per_token(tier)
            for tier, _ in self.spec.kv.lower_tiers()
        )

    def _duration_s(self, plan: list[_Planned]) -> tuple[float, bool]:
        truth = self._truth
        total = truth.step_overhead_s
        decoding = context_tokens = 0
        for _, start, num_tokens, prefill, load_s in plan:
            end = start + num_tokens
            if prefill:
                total += truth.chunk_prefill_s(start, end) + load_s
            else:
                decoding += 1
                context_tokens += end
        if decoding:
            total += decoding * truth.decode_s_per_seq + (
                truth.decode_s_per_context_token * context_tokens
            )
        return self._perturb(total)

    def _perturb(self, duration_s: float) -> tuple[float, bool]:
        """Multiplicative lognormal noise (median 1), then a stall with its probability."""
        truth = self._truth
        if truth.noise_sigma > 0:
            duration_s *= self._noise.next()
        stalled = truth.stall_probability > 0 and self._stall.next() < truth.stall_probability
        if stalled:
            duration_s += truth.stall_s
        return duration_s, stalled

    def _advance(
        self, plan: list[_Planned], end_s: float
    ) -> tuple[tuple[FirstToken, ...], tuple[RequestId, ...], tuple[Finished, ...]]:
        first_tokens: list[FirstToken] = []
        tokens: list[RequestId] = []
        finished: list[Finished] = []
        for request, start, num_tokens, prefill, _ in plan:
            request.num_computed = start + num_tokens
            if request.num_computed < request.prompt_tokens:
                continue
            request.output_tokens += 1
            tokens.append(request.request_id)
            if prefill:
                request.first_step = len(self._step_ends) - 1
                first_tokens.append(self._first_token(request, end_s))
            if request.output_tokens >= request.max_tokens:
                finished.append(self._finish(request, end_s))
        if finished:
            done = {item.request_id for item in finished}
            self._running = [r for r in self._running if r.request_id not in done]
        return tuple(first_tokens), tuple(tokens), tuple(finished)

    def _first_token(self, request: _Request, end_s: float) -> FirstToken:
        hit = request.hit
        return FirstToken(request.request_id, end_s, request.arrival_s, request.prompt_tokens,
                          hit.cached_tokens if hit else 0,
                          hit.deepest_tier if hit else None)  # fmt: skip

    def _finish(self, request: _Request, end_s: float) -> Finished:
        self.cache.free(request.request_id)
        del self._requests[request.request_id]
        # Every step from its first token on gave it a token (nothing is preempted).
        first = request.first_step
        step_s = decode_step_s(np.diff(self._step_ends[first:]).tolist()) if first >= 0 else None
        if len(self._step_ends) > STEP_LOG_MAX:
            self._trim_step_log()
        return Finished(request.request_id, end_s, request.arrival_s, request.prompt_tokens,
                        request.output_tokens, step_s)  # fmt: skip

    def _trim_step_log(self) -> None:
        """Forget the step ends before the oldest first token of a request still here."""
        cut = min((r.first_step for r in self._requests.values() if r.first_step >= 0),
                  default=len(self._step_ends))  # fmt: skip
        del self._step_ends[:cut]
        for r in self._requests.values():
            r.first_step -= cut if r.first_step >= 0 else 0
