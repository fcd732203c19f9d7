"""Properties of the scheduler replay (core/queue/scheduler.py) and the in-flight estimate
against ``naive_replay``, a step-by-step reading of the scheduler written here (one token
budget per step, no stretches, no shortcuts). The hand-computed schedules are in
``test_scheduler.py``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from foretoken.core.queue.inflight import InFlightEstimate
from foretoken.core.queue.scheduler import (
    CurveStepCost,
    NewRequest,
    QueueState,
    SeqState,
    prefill_span,
    simulate_until_first_token,
)
from foretoken.wire.records import SchedulerSettings
from tests.unit.core.queue.test_scheduler import COST, NEVER, NOW, decoding, prompt, sched

# --------------------------------------------------------------------------- naive reference


@dataclass
class NaiveSeq:
    computed: int
    end: int
    left: int


Plan = list[tuple[NaiveSeq, int, bool]]  # (sequence, tokens, is a prefill chunk)


def naive_chunk(settings_: SchedulerSettings, remaining: int, budget: int) -> int:
    threshold = settings_.long_prefill_token_threshold
    if 0 < threshold < remaining:
        remaining = threshold
    return min(remaining, budget)


def naive_step_plan(
    settings_: SchedulerSettings, running: list[NaiveSeq], waiting: deque[NaiveSeq]
) -> Plan:
    """One step's work, as fleet/engine.py schedules it (admitting from ``waiting``)."""
    budget = settings_.max_num_batched_tokens
    plan: Plan = []
    for seq in running:
        if budget <= 0:
            break
        if seq.computed >= seq.end:
            plan.append((seq, 1, False))
            budget -= 1
            continue
        n = seq.end - seq.computed
        if settings_.chunked_prefill:
            n = naive_chunk(settings_, n, budget)
        plan.append((seq, n, True))
        budget -= n
    while waiting and budget > 0 and len(running) < settings_.max_num_seqs:
        remaining = waiting[0].end - waiting[0].computed
        prefilling = any(is_prefill for _, _, is_prefill in plan)
        oversized = remaining > settings_.max_num_batched_tokens
        if settings_.chunked_prefill:
            n = naive_chunk(settings_, remaining, budget)
        elif remaining <= budget or (oversized and not prefilling):
            n = remaining
        else:
            break
        running.append(waiting.popleft())
        plan.append((running[-1], n, True))
        budget -= n
    return plan


def naive_step_s(plan: Plan, cost) -> float:
    duration = cost.step_overhead_s
    for seq, n, is_prefill in plan:
        if is_prefill:
            duration += cost.chunk_s(seq.computed, seq.computed + n)
        else:
            duration += cost.decode_s_per_seq
    return duration


def naive_seqs(states: tuple[SeqState, ...]) -> list[NaiveSeq]:
    return [NaiveSeq(s.computed_tokens, s.prompt_tokens, s.output_tokens_left) for s in states]


def naive_replay(
    settings_: SchedulerSettings, state: QueueState, new: NewRequest, now_s: float, cost
) -> tuple[float, int]:
    """(TTFT, steps): the scheduler one step at a time."""
    running = [
        NaiveSeq(s.computed_tokens, s.prompt_tokens, s.output_tokens_left) for s in state.running
    ]
    waiting = deque(
        NaiveSeq(s.computed_tokens, s.prompt_tokens, s.output_tokens_left) for s in state.waiting
    )
    first, prompt_len = prefill_span(new.prompt_tokens, new.cached_tokens)
    target = NaiveSeq(first, prompt_len, NEVER)
    waiting.append(target)
    t, steps = max(state.free_at_s, now_s), 0
    while True:
        plan = naive_step_plan(settings_, running, waiting)
        t += naive_step_s(plan, cost)
        steps += 1
        for seq, n, is_prefill in plan:
            seq.computed += n if is_prefill else 0
            if not is_prefill or seq.computed >= seq.end:
                seq.left -= 1
        if target.computed >= target.end:
            return t - now_s, steps
        running[:] = [s for s in running if s.left > 0]


# --------------------------------------------------------------------------- properties

settings_st = st.builds(
    sched,
    budget=st.integers(1, 48),
    seqs=st.integers(1, 6),
    threshold=st.integers(0, 60),
    chunked=st.booleans(),
)


@st.composite
def seq_st(draw: st.DrawFn, decode: bool) -> SeqState:
    tokens = draw(st.integers(1, 150))
    if decode:
        return decoding(draw(st.integers(1, 12)), tokens)
    return prompt(tokens, draw(st.integers(0, tokens - 1)), draw(st.integers(1, 6)))


@st.composite
def state_st(draw: st.DrawFn) -> QueueState:
    running = draw(st.lists(st.booleans().flatmap(seq_st), max_size=5))
    waiting = draw(st.lists(seq_st(False), max_size=4))
    offset = draw(st.sampled_from([-1.0, 0.0, 0.25]))
    return QueueState(free_at_s=NOW + offset, running=tuple(running), waiting=tuple(waiting))


new_st = st.builds(NewRequest, st.integers(1, 200), st.integers(0, 200))
cost_st = st.builds(
    lambda a, b, overhead, decode: CurveStepCost(lambda n: a * n + b * n * n, overhead, decode),
    st.sampled_from([0.0, 1e-4, 1e-3]),
    st.sampled_from([0.0, 1e-7, 1e-5]),
    st.sampled_from([0.0, 1e-3, 0.02]),
    st.sampled_from([0.0, 1e-4, 3e-3]),
)
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(settings_st, state_st(), new_st, cost_st)
def test_stretches_equal_the_step_by_step_scheduler(settings_, state, new, cost) -> None:
    fast = simulate_until_first_token(settings_, state, new, NOW, cost)
    ttft_s, steps = naive_replay(settings_, state, new, NOW, cost)
    assert fast.steps == steps
    assert fast.ttft_s == pytest.approx(ttft_s, rel=1e-9, abs=1e-12)
    assert fast.queue_wait_s + fast.prefill_s == pytest.approx(fast.ttft_s, rel=1e-9, abs=1e-12)


@PROPERTY
@given(settings_st, state_st(), new_st, cost_st)
def test_ttft_is_never_below_the_own_prefill(settings_, state, new, cost) -> None:
    result = simulate_until_first_token(settings_, state, new, NOW, cost)
    first, prompt_len = prefill_span(new.prompt_tokens, new.cached_tokens)
    own_s = cost.chunk_s(first, prompt_len)
    assert result.prefill_s == own_s
    assert result.ttft_s >= own_s - 1e-12 * max(1.0, own_s)


@PROPERTY
@given(settings_st, state_st(), new_st, cost_st, st.lists(seq_st(False), min_size=1, max_size=3))
def test_more_work_ahead_never_shortens_the_ttft(settings_, state, new, cost, extra) -> None:
    base = simulate_until_first_token(settings_, state, new, NOW, cost)
    more = QueueState(state.free_at_s, state.running, state.waiting + tuple(extra))
    longer = simulate_until_first_token(settings_, more, new, NOW, cost)
    assert longer.ttft_s >= base.ttft_s - 1e-9 * max(1.0, base.ttft_s)
    assert longer.queue_tokens_ahead > base.queue_tokens_ahead


@PROPERTY
@given(
    settings_st,
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300), st.integers(1, 8)), max_size=6),
    st.lists(st.floats(0.0, 3.0), min_size=1, max_size=4),
)
def test_advancing_in_pieces_equals_advancing_at_once(settings_, requests, cuts) -> None:
    whole, pieces = InFlightEstimate(settings_), InFlightEstimate(settings_)
    for i, (tokens, cached, output) in enumerate(requests):
        for estimate in (whole, pieces):
            estimate.arrive(i, NOW, tokens, cached, output)
    end_s = NOW + max(cuts)
    for cut in sorted(cuts):
        pieces.advance(NOW + cut, COST)
    whole.advance(end_s, COST)
    a, b = whole.state(), pieces.state()
    assert a.free_at_s == pytest.approx(b.free_at_s, rel=1e-9)
    assert [s.computed_tokens for s in a.running] == [s.computed_tokens for s in b.running]
    assert len(a.waiting) == len(b.waiting)


@PROPERTY
@given(
    settings_st,
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(0, 300), st.integers(1, 8), st.booleans()),
        max_size=8,
    ),
    st.floats(0.0, 2.0),
    new_st,
)
def test_the_estimate_predicts_as_a_replay_of_its_state(settings_, requests, at, new) -> None:
    estimate = InFlightEstimate(settings_)
    for i, (tokens, cached, output, _) in enumerate(requests):
        estimate.advance(NOW + 0.05 * i, COST)
        estimate.arrive(i, NOW + 0.05 * i, tokens, cached, output)
    now_s = NOW + at
    estimate.advance(now_s, COST)
    for i, (*_, seen) in enumerate(requests):
        if seen:
            estimate.first_token(i, now_s)
    state = estimate.state(now_s)
    direct = estimate.predict(new, now_s, COST)
    replayed = simulate_until_first_token(settings_, state, new, now_s, COST)
    assert direct.steps == replayed.steps
    # the estimate also counts the last chunk of a prefill whose step is under way, which a
    # QueueState shows as a decoder (its first token due at the step's end)
    assert direct.queue_tokens_ahead >= replayed.queue_tokens_ahead
    assert direct.ttft_s == pytest.approx(replayed.ttft_s, rel=1e-9)
    unseen = [i for i, (*_, seen) in enumerate(requests) if not seen]
    assert all(estimate.prefill_tokens_left(i) for i in unseen)  # at least a chunk each
