"""The queue model (predictor/queue.py) and the scheduler replay (predictor/replay.py).

Hand-computed schedules: each test writes the engine's steps out by hand and
builds the expected TTFT from them with the cost curve ``C(N) = A·N + B·N²``, the step
overhead and the per-sequence decode cost. Then properties against ``naive_replay``, a
step-by-step reading of the scheduler written here (one token budget per step, no
stretches, no shortcuts).
"""

from __future__ import annotations

import pytest

from foretoken.core.queue.scheduler import (
    CurveStepCost,
    KvModel,
    NewRequest,
    QueueState,
    SeqState,
    prefill_span,
    projected_drain_s,
    simulate_until_first_token,
)
from foretoken.core.queue.worker_queue import Phase, WorkerQueue
from foretoken.core.types import RequestId
from foretoken.wire.records import SchedulerSettings

A = 1e-3  # s per token
B = 1e-6  # s per token²
OVERHEAD = 0.01
DECODE = 5e-4
NOW = 100.0
NEVER = 10**6  # output tokens of a sequence that does not finish within a test


def curve(n: int) -> float:
    return A * n + B * n * n


COST = CurveStepCost(curve, OVERHEAD, DECODE)


def sched(
    budget: int = 100, seqs: int = 16, threshold: int = 0, chunked: bool = True
) -> SchedulerSettings:
    return SchedulerSettings(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        long_prefill_token_threshold=threshold,
        chunked_prefill=chunked,
    )


def decoding(left: int, prompt: int = 10) -> SeqState:
    return SeqState(prompt_tokens=prompt, computed_tokens=prompt, output_tokens_left=left)


def prompt(tokens: int, computed: int = 0, left: int = NEVER) -> SeqState:
    return SeqState(prompt_tokens=tokens, computed_tokens=computed, output_tokens_left=left)


def replay(
    settings_: SchedulerSettings,
    running: tuple[SeqState, ...] = (),
    waiting: tuple[SeqState, ...] = (),
    new: NewRequest = NewRequest(10),
):
    state = QueueState(free_at_s=NOW, running=running, waiting=waiting)
    return simulate_until_first_token(settings_, state, new, NOW, COST)


def check_parts(result, expected_ttft_s: float, steps: int) -> None:
    assert result.steps == steps
    assert result.ttft_s == pytest.approx(expected_ttft_s, rel=1e-9)
    assert result.queue_wait_s + result.prefill_s == pytest.approx(result.ttft_s, rel=1e-9)


# --------------------------------------------------------------------------- by hand


def test_one_long_prompt_is_chunked_over_steps() -> None:
    # budget 100, empty queue, new prompt 250:
    #   step 1: new 0..100   step 2: new 100..200   step 3: new 200..250 → first token
    result = replay(sched(budget=100), new=NewRequest(250))
    check_parts(result, 3 * OVERHEAD + curve(250), steps=3)
    assert result.prefill_s == pytest.approx(curve(250))
    assert result.queue_wait_s == pytest.approx(3 * OVERHEAD)
    assert result.queue_tokens_ahead == 0


def test_cached_tokens_are_skipped_but_still_attended_to() -> None:
    # 250 prompt tokens, 180 cached: one step computes 180..250 at C(250) − C(180).
    result = replay(sched(budget=100), new=NewRequest(250, 180))
    check_parts(result, OVERHEAD + curve(250) - curve(180), steps=1)


def test_two_prompts_share_a_budget() -> None:
    # budget 100; waiting a (150 tokens, 4 output), then the new request (80):
    #   step 1: a 0..100 (budget gone)
    #   step 2: a 100..150 → a's first token; new 0..50
    #   step 3: a decodes (1 token); new 50..80 → first token
    result = replay(sched(budget=100), waiting=(prompt(150, left=4),), new=NewRequest(80))
    check_parts(result, 3 * OVERHEAD + curve(150) + curve(80) + DECODE, steps=3)
    assert result.queue_tokens_ahead == 150


def test_small_prompt_slips_between_chunks_of_a_giant_one() -> None:
    giant = prompt(1000)
    # threshold 60 < budget 100: step 1: giant 0..60, new 0..30 → first token.
    slipped = replay(sched(budget=100, threshold=60), running=(giant,), new=NewRequest(30))
    check_parts(slipped, OVERHEAD + curve(60) + curve(30), steps=1)
    # no threshold: the giant takes all 100 tokens in steps 1..10 (0..1000, first token at
    # 10); step 11: giant decodes, new 0..30 → first token.
    behind = replay(sched(budget=100), running=(giant,), new=NewRequest(30))
    check_parts(behind, 11 * OVERHEAD + curve(1000) + DECODE + curve(30), steps=11)
    assert behind.queue_tokens_ahead == 1000


def test_max_num_seqs_blocks_admission() -> None:
    # max_num_seqs 2, d1 (3 tokens left) and d2 (5 left) decode; the new prompt (10) waits:
    #   steps 1..3: d1, d2 decode → d1 finishes at the end of step 3
    #   step 4: d2 decodes; new 0..10 → first token
    result = replay(sched(seqs=2), running=(decoding(3), decoding(5)), new=NewRequest(10))
    check_parts(result, 4 * OVERHEAD + (3 * 2 + 1) * DECODE + curve(10), steps=4)
    # with a third seat the new prompt starts at once.
    free = replay(sched(seqs=3), running=(decoding(3), decoding(5)), new=NewRequest(10))
    check_parts(free, OVERHEAD + 2 * DECODE + curve(10), steps=1)


def test_serial_engine_waits_for_the_whole_previous_prompt() -> None:
    # chunked prefill off, budget 100; waiting a (250 tokens: over the budget), new 10:
    #   step 1: a 0..250 whole, nothing else prefills in that step
    #   step 2: a decodes; new 0..10 → first token
    serial = replay(sched(chunked=False), waiting=(prompt(250),), new=NewRequest(10))
    check_parts(serial, 2 * OVERHEAD + curve(250) + DECODE + curve(10), steps=2)
    # chunked: a 0..100, a 100..200, then a 200..250 beside new 0..10 in step 3.
    chunked = replay(sched(), waiting=(prompt(250),), new=NewRequest(10))
    check_parts(chunked, 3 * OVERHEAD + curve(250) + curve(10), steps=3)


def test_serial_engine_waits_for_a_prompt_to_fit_the_budget_left() -> None:
    # chunked prefill off, budget 10, 4 decoding sequences with 2 tokens left; new 8:
    #   steps 1..2: 4 decodes (8 > 10 − 4 tokens left: the prompt waits); all 4 finish
    #   step 3: new 0..8 → first token
    running = tuple(decoding(2) for _ in range(4))
    serial = replay(sched(budget=10, chunked=False), running=running, new=NewRequest(8))
    check_parts(serial, 3 * OVERHEAD + 8 * DECODE + curve(8), steps=3)
    # two small prompts fit one step whole: waiting a (3 tokens) and new (5), budget 10.
    both = replay(sched(budget=10, chunked=False), waiting=(prompt(3),), new=NewRequest(5))
    check_parts(both, OVERHEAD + curve(3) + curve(5), steps=1)


def test_decoding_requests_consume_budget() -> None:
    # budget 10, 4 decoding sequences; new prompt 8:
    #   step 1: 4 decodes, new 0..6     step 2: 4 decodes, new 6..8 → first token
    running = tuple(decoding(NEVER) for _ in range(4))
    result = replay(sched(budget=10), running=running, new=NewRequest(8))
    check_parts(result, 2 * OVERHEAD + 8 * DECODE + curve(8), steps=2)
    alone = replay(sched(budget=10), new=NewRequest(8))
    check_parts(alone, OVERHEAD + curve(8), steps=1)


def test_running_prefill_first_can_starve_the_decodes_behind_it() -> None:
    # budget 100, running: p (300 left, admitted first), then d (decoding, 2 tokens left).
    #   steps 1..3: p takes 100 each (budget gone: d is skipped); p's first token at 3
    #   step 4: p decodes, d decodes; new 0..50 → first token
    running = (prompt(300), decoding(2))
    result = replay(sched(budget=100), running=running, new=NewRequest(50))
    check_parts(result, 4 * OVERHEAD + curve(300) + 2 * DECODE + curve(50), steps=4)


def test_wait_starts_after_the_current_step() -> None:
    # the step under way ends 0.5 s from now; then one step of 10 tokens.
    state = QueueState(free_at_s=NOW + 0.5)
    result = simulate_until_first_token(sched(), state, NewRequest(10), NOW, COST)
    check_parts(result, 0.5 + OVERHEAD + curve(10), steps=1)
    idle = QueueState(free_at_s=NOW - 3.0)  # idle since long ago: starts now
    check_parts(
        simulate_until_first_token(sched(), idle, NewRequest(10), NOW, COST),
        OVERHEAD + curve(10),
        steps=1,
    )


def test_projected_drain() -> None:
    # budget 100: a (150) and b (30) waiting, d decoding with 1 token left:
    #   step 1: d decodes (and leaves); a 0..99
    #   step 2: a 99..150 → first token; b 0..30 → first token: nothing waits any more
    state = QueueState(free_at_s=NOW, running=(decoding(1),), waiting=(prompt(150), prompt(30)))
    drain = projected_drain_s(sched(), state, NOW, COST)
    assert drain == pytest.approx(2 * OVERHEAD + DECODE + curve(150) + curve(30))
    only_decodes = QueueState(free_at_s=NOW + 1.0, running=(decoding(5),))
    assert projected_drain_s(sched(), only_decodes, NOW, COST) == 0.0


def test_a_whole_prompt_is_never_credited_as_cached() -> None:
    assert prefill_span(100, 100) == (99, 100)
    assert prefill_span(0, 0) == (0, 1)
    result = replay(sched(), new=NewRequest(100, 500))
    check_parts(result, OVERHEAD + curve(100) - curve(99), steps=1)


# --------------------------------------------------------------------------- queue model


def rid(name: str) -> RequestId:
    return RequestId(name)


def test_add_is_idempotent_by_request_id() -> None:
    once, twice = WorkerQueue(sched()), WorkerQueue(sched())
    assert once.add(rid("r"), NOW, 500, 100, 20)
    assert twice.add(rid("r"), NOW, 500, 100, 20)
    assert not twice.add(rid("r"), NOW + 0.2, 500, 100, 20)  # the grant, arriving later
    assert twice.outstanding_count == 1
    assert twice.queued_tokens_ahead == 400
    at = NOW + 0.01
    assert twice.predict(NewRequest(50), at, COST) == once.predict(NewRequest(50), at, COST)


def test_a_finished_request_is_not_brought_back_by_a_late_grant() -> None:
    queue = WorkerQueue(sched())
    queue.add(rid("r"), NOW, 500, 0, 20)
    assert queue.finished(rid("r"), NOW + 1.0)
    assert not queue.add(rid("r"), NOW, 500, 0, 20)
    assert queue.phase(rid("r")) is Phase.FINISHED
    assert queue.outstanding_count == 0


def test_phases_follow_the_estimate_and_the_outcomes() -> None:
    # budget 100, curve as above: a (500 tokens) arrives at NOW; b (50) just after.
    queue = WorkerQueue(sched())
    queue.add(rid("a"), NOW, 500, 0, 5)
    queue.add(rid("b"), NOW + 1e-3, 50, 0, 5)
    queue.estimate(NOW + 1e-3, COST)  # the first step (a 0..100) is under way
    assert queue.phase(rid("a")) is Phase.PREFILLING
    assert queue.phase(rid("b")) is Phase.QUEUED
    assert queue.running_count == 1
    queue.first_token(rid("a"), NOW + 0.9)
    assert queue.phase(rid("a")) is Phase.DECODING
    assert queue.decoding_count == 1
    queue.finished(rid("a"), NOW + 1.0)
    assert queue.phase(rid("a")) is Phase.FINISHED
    assert queue.phase(rid("unknown")) is None


def test_a_prompt_whose_kv_blocks_do_not_fit_waits_for_a_running_request_to_leave() -> None:
    # 10 blocks of 10 tokens. a (60-token prompt, 20 output tokens) reserves
    # ceil(79 / 10) = 8 blocks; the new 30-token prompt needs 3: it waits until a's last
    # token (step 1: a's prefill; steps 2..20: its 19 other tokens), then runs in step 21.
    kv = KvModel(gpu_blocks=10, block_size=10)
    queue = WorkerQueue(sched(), kv=kv)
    queue.add(rid("a"), NOW, 60, 0, 20)
    waits = queue.predict(NewRequest(30, 0, 1), NOW, COST)
    expected = 21 * OVERHEAD + curve(60) + 19 * DECODE + curve(30)
    assert waits.ttft_s == pytest.approx(expected)
    # without the KV model (or with room for both) both prompts share step 1.
    free = WorkerQueue(sched())
    free.add(rid("a"), NOW, 60, 0, 20)
    together = OVERHEAD + curve(60) + curve(30)
    assert free.predict(NewRequest(30, 0, 1), NOW, COST).ttft_s == pytest.approx(together)
    roomy = WorkerQueue(sched(), kv=KvModel(gpu_blocks=11, block_size=10))
    roomy.add(rid("a"), NOW, 60, 0, 20)
    assert roomy.predict(NewRequest(30, 0, 1), NOW, COST).ttft_s == pytest.approx(together)
    # a credited cached prefix is shared: 25 cached tokens take 2 blocks off its 3
    assert queue.predict(NewRequest(30, 25, 1), NOW, COST).ttft_s < expected


def test_in_flight_prefill_is_estimated_from_the_send_time() -> None:
    # a 1000-token prompt sent at NOW with budget 100 takes 10 steps; step j (1-based)
    # ends at NOW + j·OVERHEAD + C(100·j). Just after step 4 ends, step 5 (400..500) is
    # under way: the estimate is the queue as of its end, 500 tokens left.
    queue = WorkerQueue(sched())
    queue.add(rid("a"), NOW, 1000, 0, 5)
    after_4 = NOW + 4 * OVERHEAD + curve(400) + 1e-9
    state = queue.estimate(after_4, COST)
    assert state.running[0].prefill_tokens_left == 500
    assert state.free_at_s == pytest.approx(NOW + 5 * OVERHEAD + curve(500))
    # a new 10-token prompt waits for the remaining 500 tokens (steps 6..10), then runs
    # beside a's first decode in step 11.
    result = queue.predict(NewRequest(10), after_4, COST)
    end_5 = NOW + 5 * OVERHEAD + curve(500)
    expected_end = end_5 + 6 * OVERHEAD + curve(1000) - curve(500) + DECODE + curve(10)
    assert result.ttft_s == pytest.approx(expected_end - after_4)
    assert result.queue_tokens_ahead == 500


def test_a_prefill_done_less_than_the_first_tokens_lag_ago_is_taken_as_done() -> None:
    """On an engine that prefills whole prompts, "one chunk left" is the whole prompt: a
    request queued behind one whose first token is merely on its way (outcomes reach the
    route service some milliseconds late) would wait for it twice. Within ``lag_s`` of the
    estimate finishing it, it counts as done; past that, the engine is slower than the
    estimate and it keeps its chunk."""
    whole = sched(budget=4096, chunked=False)
    queue = WorkerQueue(whole)
    queue.add(rid("a"), NOW, 2000, 0, 1)  # one step: done at NOW + OVERHEAD + C(2000)
    done = NOW + OVERHEAD + curve(2000)
    alone = queue.predict(NewRequest(100, 0, 1), done + 0.05, COST).ttft_s
    assert queue.estimate(done + 0.05, COST).running[0].prefill_tokens_left == 2000
    queue.lag_s = 0.1
    within = queue.predict(NewRequest(100, 0, 1), done + 0.05, COST).ttft_s
    assert within < alone - curve(2000) * 0.9  # a's prompt is not prefilled again
    past = queue.predict(NewRequest(100, 0, 1), done + 0.2, COST).ttft_s
    graceless = WorkerQueue(whole)
    graceless.add(rid("a"), NOW, 2000, 0, 1)
    expected = graceless.predict(NewRequest(100, 0, 1), done + 0.2, COST).ttft_s
    assert past == pytest.approx(expected, rel=1e-9)  # the grace ran out: the chunk is back
    assert past > within + curve(2000) * 0.9


def test_a_prompt_in_its_last_step_is_ahead_but_not_prefilled_twice() -> None:
    """An unchunked engine prefills a prompt in one step: while it runs, a request sent
    then waits for the step's end and counts the prompt's tokens ahead of it — once."""
    whole = sched(budget=4096, chunked=False)
    queue = WorkerQueue(whole)
    queue.add(rid("a"), NOW, 2000, 0, 1)
    done = NOW + OVERHEAD + curve(2000)
    during = NOW + 0.5 * (done - NOW)
    result = queue.predict(NewRequest(100, 0, 1), during, COST)
    assert result.queue_tokens_ahead == 2000
    own = OVERHEAD + DECODE + curve(100)  # its step beside a's first decode
    assert result.ttft_s == pytest.approx(done - during + own)


def test_an_unconfirmed_prefill_keeps_one_chunk() -> None:
    # long after the estimate has a (1000 tokens) done, no first token was seen: it is
    # shown with one chunk left (100 tokens at budget 100; 40 with threshold 40).
    for settings_, chunk in ((sched(), 100), (sched(threshold=40), 40)):
        queue = WorkerQueue(settings_)
        queue.add(rid("a"), NOW, 1000, 0, 5)
        state = queue.estimate(NOW + 100.0, COST)
        assert state.running[0].prefill_tokens_left == chunk
        assert queue.queued_tokens_ahead == chunk
        assert queue.phase(rid("a")) is Phase.PREFILLING
        queue.first_token(rid("a"), NOW + 100.0)
        assert queue.estimate(NOW + 100.0, COST).prefill_tokens_left == 0
        assert queue.queued_tokens_ahead == 0


def test_a_first_token_before_the_estimate_completes_the_prefill() -> None:
    queue = WorkerQueue(sched())
    queue.add(rid("a"), NOW, 100_000, 0, 50)
    queue.first_token(rid("a"), NOW + 0.5)  # far sooner than the estimate would say
    state = queue.estimate(NOW + 0.6, COST)
    assert state.prefill_tokens_left == 0
    assert state.running[0].output_tokens_left < 50


def test_an_outcome_that_overtakes_its_grant_is_applied_when_the_grant_comes() -> None:
    queue = WorkerQueue(sched())
    assert not queue.first_token(rid("a"), NOW + 0.5)
    queue.add(rid("a"), NOW, 100_000, 0, 50)
    assert queue.phase(rid("a")) is Phase.DECODING
    assert queue.estimate(NOW + 0.6, COST).prefill_tokens_left == 0


def test_expiry_forgets_requests_whose_outcome_never_came() -> None:
    queue = WorkerQueue(sched())
    queue.add(rid("old"), NOW, 500, 0, 5)
    queue.add(rid("new"), NOW + 50.0, 500, 0, 5)
    assert queue.expire(NOW + 100.0, max_age_s=60.0) == [rid("old")]
    assert queue.phase(rid("old")) is Phase.FINISHED
    assert not queue.first_token(rid("old"), NOW + 101.0)
    assert [e.request_id for e in queue.outstanding()] == [rid("new")]
    state = queue.estimate(NOW + 50.0, COST)
    assert len(state.running) + len(state.waiting) == 1


def test_snapshot_and_restore_give_the_same_predictions() -> None:
    queue = WorkerQueue(sched(threshold=40))
    for i, (tokens, cached) in enumerate(((5000, 0), (300, 100), (800, 0), (60, 0))):
        queue.add(rid(f"r{i}"), NOW + 0.1 * i, tokens, cached, 30)
        queue.estimate(NOW + 0.1 * i, COST)  # incremental here, from send times there
    queue.first_token(rid("r1"), NOW + 0.5)
    queue.finished(rid("r3"), NOW + 0.6)
    restored = WorkerQueue.restore(queue.snapshot())
    at = NOW + 2.0
    expected = queue.predict(NewRequest(700, 200), at, COST)
    got = restored.predict(NewRequest(700, 200), at, COST)
    assert (got.steps, got.queue_tokens_ahead) == (expected.steps, expected.queue_tokens_ahead)
    assert got.ttft_s == pytest.approx(expected.ttft_s, rel=1e-9)
    assert restored.phase(rid("r3")) is Phase.FINISHED
    assert restored.phase(rid("r1")) is Phase.DECODING


def test_other_settings_resimulate_the_queue() -> None:
    queue = WorkerQueue(sched(budget=100))
    queue.add(rid("a"), NOW, 1000, 0, 5)
    slow = queue.predict(NewRequest(10), NOW, COST)
    queue.set_settings(sched(budget=100, threshold=50))
    fast = queue.predict(NewRequest(10), NOW, COST)
    assert fast.ttft_s < slow.ttft_s
