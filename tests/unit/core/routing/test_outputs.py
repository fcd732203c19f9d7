"""Expected output lengths learned from completions: a max_tokens is a cap, not a length
(a client that asks for exactly what it gets keeps its caps exact)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from foretoken.core.routing import outputs as outputs_module
from foretoken.core.routing.outputs import (
    BUCKET_MIN,
    MIN_SAMPLES,
    SETTING_MIN,
    SETTING_WINDOW,
    OutputLengths,
    _km_mean,
    is_round,
)
from foretoken.core.types import ModelName, RequestId, RouteDecision
from foretoken.wire.records import Outcome, SchedulerSettings
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.one_worker import one_worker

M = ModelName("m")
OTHER = ModelName("other")


def learned(pairs: list[tuple[int | None, int]], model: ModelName = M) -> OutputLengths:
    outputs = OutputLengths(default_output_tokens=128, memory=10_000)
    for i, (cap, length) in enumerate(pairs):
        rid = RequestId(f"r{i}")
        outputs.sent(rid, model, cap)
        outputs.completed(rid, length)
    return outputs


def test_before_any_completion_the_cap_or_the_default() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=16)
    assert outputs.expected(M, 2048) == 2048
    assert outputs.expected(M, None) == 128


def test_exact_clients_keep_exact_caps() -> None:
    rng = np.random.default_rng(1)
    lengths = [int(x) for x in rng.integers(4, 3000, size=200)]
    outputs = learned([(n, n) for n in lengths])
    for cap in (7, 100, 1000, 2999, 50_000):
        assert outputs.expected(M, cap) == cap


def test_a_fixed_cap_is_expected_at_the_mean_answer() -> None:
    rng = np.random.default_rng(2)
    lengths = np.clip(np.rint(np.exp(rng.normal(np.log(200), 0.8, 400))), 1, 2048)
    outputs = learned([(2048, int(n)) for n in lengths])
    expected = outputs.expected(M, 2048)
    assert abs(expected / lengths[-256:].mean() - 1) < 0.25
    assert outputs.expected(OTHER, 2048) == 2048  # per model


def test_caps_of_another_size_use_their_own_bucket_once_it_has_samples() -> None:
    pairs: list[tuple[int | None, int]] = [(4096, 400)] * MIN_SAMPLES  # loose clients
    outputs = learned(pairs + [(64, 64)] * BUCKET_MIN)  # and exact ones with small caps
    assert outputs.expected(M, 64) == 64
    assert outputs.expected(M, 4096) == 400
    assert outputs.expected(M, 6000) == pytest.approx(6000 * 400 / 4096, rel=0.01)  # 4k-8k
    # a bucket not seen yet: the share over every cap
    share = (MIN_SAMPLES * 400 / 4096 + BUCKET_MIN) / (MIN_SAMPLES + BUCKET_MIN)
    assert outputs.expected(M, 1000) == pytest.approx(1000 * share, abs=1)


def test_requests_without_a_cap_take_the_mean_of_such_answers() -> None:
    outputs = learned([(None, 300)] * MIN_SAMPLES + [(1000, 1000)] * MIN_SAMPLES)
    assert outputs.expected(M, None) == 300


def test_unknown_failed_and_forgotten_requests_teach_nothing() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=4)
    outputs.completed(RequestId("never-sent"), 10)
    outputs.sent(RequestId("x"), M, 100)
    outputs.forget(RequestId("x"))
    outputs.completed(RequestId("x"), 10)
    assert outputs.learned == 0 and outputs.expected(M, 100) == 100
    for i in range(10):  # the memory is bounded: the oldest pending request is dropped
        outputs.sent(RequestId(f"p{i}"), M, 100)
    assert len(outputs.pending) == 4


def test_lengths_no_engine_could_have_made_are_not_learned() -> None:
    """An outcome claiming 2^40 tokens (a stranger's, or a miscount) made every later
    request's expected answer years long; a count is taken within its cap and a bound, and
    one streamed faster than any engine decodes is not taken at all."""
    outputs = OutputLengths(default_output_tokens=128, memory=1_000)
    for i in range(MIN_SAMPLES):
        for rid, cap in ((f"none{i}", None), (f"cap{i}", 100)):
            outputs.sent(RequestId(rid), M, cap)
            outputs.completed(RequestId(rid), 1 << 40, streamed_s=0.02)
    # the capped ones at their cap (99 tokens in 20 ms may be), the others not at all: a
    # request without a cap is expected at every answer's mean, 100
    assert outputs.learned == MIN_SAMPLES and outputs.expected(M, None) == 100
    for i in range(MIN_SAMPLES):
        for rid, cap in ((f"n{i}", None), (f"c{i}", 100)):
            outputs.sent(RequestId(rid), M, cap)
            outputs.completed(RequestId(rid), 1 << 40)  # no time: bounded only
    assert outputs.expected(M, None) == outputs_module.MAX_LEARNED_OUTPUT
    assert outputs.expected(M, 100) == 100


def test_learning_off_keeps_the_caps() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=100, learn=False)
    for i in range(50):
        outputs.sent(RequestId(f"r{i}"), M, 2048)
        outputs.completed(RequestId(f"r{i}"), 100)
    assert outputs.expected(M, 2048) == 2048


def test_the_revision_moves_when_a_mean_becomes_usable_or_moves() -> None:
    outputs = learned([(1000, 100)] * (BUCKET_MIN - 1))
    assert outputs.revision == 0
    outputs.sent(RequestId("a"), M, 1000)
    outputs.completed(RequestId("a"), 100)
    first = outputs.revision
    assert first == 1  # the cap's bucket became usable
    outputs.sent(RequestId("b"), M, 1000)
    outputs.completed(RequestId("b"), 110)  # a small move: no new revision
    assert outputs.revision == first
    outputs.sent(RequestId("c"), M, 1000)
    assert outputs.expected_for(RequestId("c")) == outputs.expected(M, 1000)
    assert outputs.expected_for(RequestId("gone")) is None


# ---------------------------------------------------------------- in the route service


def _burst_then_probe(learn: bool) -> float:
    """Twelve requests sent with max_tokens 4096 to a 4-seat worker, the first four
    answered after 64 tokens each; the queue wait then predicted for one more."""
    service = one_worker(SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=4))
    service.outputs.learn = learn

    def send(rid: str, t: float) -> RouteDecision:
        query = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(512)),
                             expected_output_tokens=4096).query()  # fmt: skip
        return service.route(query, t, t)

    for i in range(12):
        send(f"r{i}", 0.0)
    for i in range(4):
        service.on_outcome(Outcome(request_id=f"r{i}", ts=0.1, kind="first_token",
                                   worker_id="w0", actual_ttft_s=0.1), 0.1)  # fmt: skip
    for i in range(4):
        done = Outcome(request_id=f"r{i}", ts=1.0, kind="completion", worker_id="w0",
                       actual_ttft_s=0.1, output_tokens=64, e2e_s=1.0)  # fmt: skip
        service.on_outcome(done, 1.0)
    probe = send("probe", 1.0)
    assert probe.queue_wait_s is not None
    return probe.queue_wait_s


def test_a_burst_queued_with_its_caps_is_re_estimated_once_answers_are_seen() -> None:
    """The eight still queued were sent before any answer came: they keep their caps
    (4096 steps each before a seat frees) unless re-estimated; learned, four answers of 64
    against the cold length's eight pseudo-answers, 263 tokens."""
    learned_wait, capped_wait = _burst_then_probe(True), _burst_then_probe(False)
    assert capped_wait > 5 * learned_wait


def test_what_was_learned_is_described_per_model() -> None:
    outputs = learned([(2048, 512)] * 10 + [(None, 100)] * MIN_SAMPLES)
    described = outputs.describe()["m"]
    assert isinstance(described, dict)
    assert described["by_cap"] == {"2048-4095": {"share": 0.25, "samples": 10}}
    assert described["expected_without_cap"] == 100 and described["uncapped_samples"] == 8


# ---------------------------------------------------------------------------- tails


def test_no_tail_before_enough_answers_nor_for_exact_clients() -> None:
    assert learned([(2048, 100)] * (BUCKET_MIN - 1)).tail(M, 2048) is None
    assert learned([(n, n) for n in range(10, 400, 7)]).tail(M, 300) is None  # exact caps
    assert learned([(None, 50)] * (MIN_SAMPLES - 1)).tail(M, None) is None
    assert learned([(2048, 100)] * BUCKET_MIN).tail(OTHER, 2048) is None  # per model


def test_a_running_answer_has_the_residual_lengths_of_answers_that_ran_as_long() -> None:
    rng = np.random.default_rng(3)
    lengths = np.clip(np.rint(np.exp(rng.normal(np.log(200), 0.9, 600))), 1, 1500).astype(int)
    outputs = learned([(2048, int(n)) for n in lengths])
    tail = outputs.tail(M, 2048)
    assert tail is not None
    recent = np.sort(lengths[-256:])
    for produced in (1, 100, 300, 800):
        above = recent[recent > produced]
        for u in (0.1, 0.5, 0.9):
            want = above[int(u * len(above))] - produced
            assert tail.left(produced, u) == pytest.approx(want, abs=1.5)
    # an answer that outlived the mean has about as long again left, not one token
    mean = outputs.expected(M, 2048)
    assert tail.left(mean + 50, 0.5) > mean / 2
    # past every answer seen: the mean again, within what the cap leaves
    assert tail.left(int(recent.max()) + 1, 0.5) == pytest.approx(mean, abs=2)
    assert tail.left(2040, 0.5) <= 8


def test_a_cap_of_another_size_scales_the_shares() -> None:
    outputs = learned([(1000, n) for n in (100, 200, 300, 400)] * 3)
    tail = outputs.tail(M, 1500)  # no 1024-2047 bucket yet: the shares over every cap
    assert tail is not None
    assert tail.left(1, 0.0) == pytest.approx(1500 * 0.1, abs=1)
    assert tail.left(1, 0.99) == pytest.approx(1500 * 0.4, abs=1)
    assert tail.left(450, 0.5) == pytest.approx(1500 * 0.4 - 450, abs=1)  # above .3: .4


def test_answers_without_a_cap_have_a_tail_in_tokens() -> None:
    outputs = learned([(None, n) for n in (10, 20, 30, 40)] * 2)
    tail = outputs.tail(M, None)
    assert tail is not None
    assert tail.left(25, 0.25) == 5  # above 25: 30, 30, 40, 40
    assert tail.left(25, 0.75) == 15
    assert tail.left(100, 0.5) == 25  # past every answer: the mean


def test_a_restored_snapshot_has_the_tails_an_older_one_has_not() -> None:
    outputs = learned([(2048, 100 + 7 * i) for i in range(20)] + [(None, 50 + i) for i in range(9)])
    restored = OutputLengths(default_output_tokens=128, memory=100)
    restored.load_state(outputs.state())
    assert restored.expected(M, 2048) == outputs.expected(M, 2048)
    for cap in (2048, 1500, None):
        tail, again = outputs.tail(M, cap), restored.tail(M, cap)
        assert tail is not None and again is not None
        assert [again.left(p, u) for p in (1, 150) for u in (0.2, 0.8)] == [
            tail.left(p, u) for p in (1, 150) for u in (0.2, 0.8)
        ]
    # a snapshot written before the windows were kept: the means, no tail until answers come
    rows = msgspec.msgpack.decode(outputs.state())
    older = OutputLengths(default_output_tokens=128, memory=100)
    older.load_state(msgspec.msgpack.encode([row[:4] for row in rows]))
    assert older.expected(M, 2048) == outputs.expected(M, 2048)
    assert older.tail(M, 2048) is None


@pytest.mark.parametrize("window", [[1.5], [-0.1], [float("nan")], [0.5] * 300])
def test_a_snapshot_with_a_bad_window_is_refused(window: list[float]) -> None:
    row = ["m", "share", 10, 0.5, window]
    with pytest.raises(ValueError, match="bad window"):
        OutputLengths(128, 100).load_state(msgspec.msgpack.encode([row]))


# ---------------------------------------------------------------------------- cold caps


def test_a_cap_many_requests_share_is_a_setting_expected_at_the_cold_length() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    revision = outputs.revision
    for i in range(SETTING_MIN - 1):
        outputs.sent(RequestId(f"a{i}"), M, 8100)
        assert outputs.expected(M, 8100) == 8100  # not yet: one client's cap or a length
    outputs.sent(RequestId("a-last"), M, 8100)
    assert outputs.revision == revision + 1  # the ones queued with 8100 are re-estimated
    assert outputs.expected(M, 8100) == 512
    assert outputs.expected_for(RequestId("a0")) == 512
    assert outputs.expected(OTHER, 8100) == 8100  # per model
    # a smaller setting stays its cap; answers learned take over from the cold length
    for i in range(SETTING_MIN):
        outputs.sent(RequestId(f"b{i}"), M, 256)
    assert outputs.expected(M, 256) == 256
    for i in range(BUCKET_MIN):
        outputs.completed(RequestId(f"a{i}" if i < SETTING_MIN - 1 else "a-last"), 300)
    assert 300 < outputs.expected(M, 8100) < 512  # the cold length weighs against them
    for i in range(120):
        outputs.sent(RequestId(f"c{i}"), M, 8100)
        outputs.completed(RequestId(f"c{i}"), 300)
    assert outputs.expected(M, 8100) == pytest.approx(300, abs=5)


def test_a_round_cap_is_a_setting_from_its_first_request() -> None:
    """SDKs' and apps' caps are round; answers' lengths seldom are."""
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    revision = outputs.revision
    for cap in (1024, 4096, 8192, 2000, 1500, 16384, 32768):
        assert is_round(cap)
        assert outputs.expected(M, cap) == 512
        outputs.sent(RequestId(f"r{cap}"), M, cap)
        assert outputs.expected_for(RequestId(f"r{cap}")) == 512
    for i in range(SETTING_MIN):
        outputs.sent(RequestId(f"again{i}"), M, 4096)
    assert outputs.revision == revision  # nothing queued was estimated otherwise
    for cap in (999, 1023, 1100, 3001, 4095, 768):
        assert not is_round(cap)
        assert outputs.expected(M, cap) == cap
    assert outputs.expected(M, 512) == 512 and outputs.expected(M, 256) == 256
    off = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=0)
    assert off.expected(M, 4096) == 4096


def test_caps_that_are_lengths_stay_exact_before_anything_is_learned() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    rng = np.random.default_rng(5)
    lengths = [int(n) for n in rng.integers(1100, 9000, size=SETTING_WINDOW) if not is_round(n)]
    assert len(lengths) > SETTING_WINDOW - 3
    for i, n in enumerate(lengths):
        outputs.sent(RequestId(f"r{i}"), M, n)
        assert outputs.expected(M, n) == n


def test_a_setting_ages_out_of_the_window_and_the_cold_rule_can_be_off() -> None:
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    for i in range(SETTING_MIN):
        outputs.sent(RequestId(f"s{i}"), M, 4100)
    for i in range(SETTING_WINDOW):
        outputs.sent(RequestId(f"o{i}"), M, 2000 + i)
    assert not outputs.is_setting(M, 4100)
    assert outputs.expected(M, 4100) == 4100
    off = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=0)
    not_learning = OutputLengths(128, 1000, learn=False, cold_output_tokens=512)
    for i in range(SETTING_MIN):
        off.sent(RequestId(f"s{i}"), M, 4100)
        not_learning.sent(RequestId(f"s{i}"), M, 4100)
    assert off.expected(M, 4100) == 4100 == not_learning.expected(M, 4100)


def test_a_settings_answers_do_not_scale_with_it() -> None:
    """Clients that send 1024 and 8192 get the same answers; a per-request budget twice
    the answer keeps its own share (settings' tiny shares of 8192 stay out of it)."""
    outputs = OutputLengths(default_output_tokens=128, memory=10_000, cold_output_tokens=512)
    pairs = [(1024, 200), (8192, 180), (4100, 220), (600, 300)] * 60
    pairs += [(610 + 30 * i, 305 + 15 * i) for i in range(MIN_SAMPLES)]  # budgets: 2x
    for i, (cap, _) in enumerate(pairs):  # a burst: sent before any answer
        outputs.sent(RequestId(f"r{i}"), M, cap)
    for i, (_, length) in enumerate(pairs):
        outputs.completed(RequestId(f"r{i}"), length)
    assert outputs.expected(M, 1024) == pytest.approx(200, rel=0.05)
    assert outputs.expected(M, 8192) == pytest.approx(180, rel=0.05)
    assert outputs.expected(M, 4100) == pytest.approx(220, rel=0.05)  # repeated: a setting
    # a setting never answered yet: the model's mean answer (the cold length weighs 8)
    answers = outputs.models[M].lengths
    assert answers.n == len(pairs)
    assert outputs.expected(M, 2048) == round(
        (8 * 512 + answers.n * answers.mean) / (8 + answers.n)
    )
    assert outputs.expected(M, 100) == 50  # not a setting: a budget, half of it
    assert outputs.expected(M, 1100) == 550
    described = outputs.describe()["m"]
    assert isinstance(described, dict)
    assert described["settings"]["8192"] == {"mean": 180.0, "samples": 60}
    tail = outputs.tail(M, 8192)  # in tokens, within the cap
    assert tail is not None and tail.left(1, 0.5) == 179
    assert outputs.tail(M, 2048) is not None  # the model's answers
    short = outputs.tail(M, 1024)
    assert short is not None and short.left(1020, 0.5) <= 4
    restored = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    restored.load_state(outputs.state())  # the caps sent lately are not in a snapshot
    assert [restored.expected(M, c) for c in (1024, 8192, 4100, 2048, 1100)] == [
        outputs.expected(M, c) for c in (1024, 8192, 4100, 2048, 1100)
    ]


def test_a_round_cap_of_exact_clients_is_their_length() -> None:
    """Where every cap learned is its answer's length, a round one (an answer of exactly
    1024 tokens) is taken as one too, until that setting's own answers say otherwise."""
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    for i, n in enumerate(range(100, 100 + 7 * MIN_SAMPLES, 7)):
        outputs.sent(RequestId(f"r{i}"), M, n)
        outputs.completed(RequestId(f"r{i}"), n)
    assert outputs.expected(M, 1024) == 1024 and outputs.tail(M, 1024) is None
    for i in range(BUCKET_MIN):  # a client whose setting it is after all
        outputs.sent(RequestId(f"s{i}"), M, 1024)
        outputs.completed(RequestId(f"s{i}"), 300)
    assert outputs.expected(M, 1024) < 400  # its answers, the cold length against them
    tail = outputs.tail(M, 1024)
    assert tail is not None and tail.left(1, 0.5) == 299


# ---------------------------------------------------------------- answers still running


def test_the_kaplan_meier_mean_counts_what_still_runs() -> None:
    assert _km_mean([1, 2, 3], []) == 2.0
    # two ended at 1 and 2, two still running past 5: a quarter, then half, live on
    assert _km_mean([1, 2], [5, 5]) == pytest.approx(1 + 0.75 * 1 + 0.5 * 3)
    assert _km_mean([10] * 5, [20] * 5) == pytest.approx(15)


def _burst(now_s: float, long_ones_fail: bool = False) -> OutputLengths:
    """A burst of 40 requests with a 4096 setting, the 30 longest streaming from t = 0; the
    10 shortest (100 tokens, streamed for 1 s) answered at ``now_s`` while the other 30
    still stream (or failed)."""
    outputs = OutputLengths(default_output_tokens=128, memory=1000, cold_output_tokens=512)
    for i in range(40):
        outputs.sent(RequestId(f"r{i}"), M, 4096)
        outputs.started(RequestId(f"r{i}"), 0.0 if i < 30 else now_s - 1.0)
    for i in range(30) if long_ones_fail else ():
        outputs.forget(RequestId(f"r{i}"))
    for i in range(30, 40):
        outputs.completed(RequestId(f"r{i}"), 100, now_s, streamed_s=1.0)
    return outputs


def test_answers_still_running_lengthen_the_expected_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outputs_module, "CENSORED_EVERY_S", 0.0)  # counted at every answer

    def learned(prior: float, mean: float) -> float:  # the cold length weighs 8 answers
        return (8 * prior + 10 * mean) / 18

    alone = _burst(1.0, long_ones_fail=True)  # the shortest answers alone: 100 tokens
    assert alone.models[M].censored_ratio == 1.0
    assert alone.expected(M, 4096) == round(learned(learned(512, 100), 100))
    # the 30 still streaming have streamed 3 s each by t = 3: a quarter of the burst ended
    # at 1 s, three quarters live on to 3 s (Kaplan-Meier: 2.5 s, 2.5 times the answers')
    running = _burst(3.0)
    assert running.models[M].censored_ratio == pytest.approx(2.5)
    assert running.expected(M, 4096) == round(learned(learned(512, 250), 250))
    running.started(RequestId("never-sent"), 0.0)  # unknown: never starts
    assert RequestId("never-sent") not in running.running


def test_answers_still_running_are_counted_at_most_every_tenth_of_a_second() -> None:
    outputs = _burst(3.0)  # the 8th answer counts them; the 9th and 10th, at once, do not
    ratio = outputs.models[M].censored_ratio
    assert ratio > 2.5 and outputs.models[M].censored_at == 3.0
    outputs.sent(RequestId("late"), M, 4096)
    outputs.completed(RequestId("late"), 100, 3.05)
    assert outputs.models[M].censored_ratio == ratio
    outputs.sent(RequestId("later"), M, 4096)
    outputs.completed(RequestId("later"), 100, 3.2)
    assert outputs.models[M].censored_ratio != ratio and outputs.models[M].censored_at == 3.2
