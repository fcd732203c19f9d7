"""The route policy's rules: admission against the bound, Retry-After, stickiness, cache
preference, no herding, idempotency, explore, and learning from cold samples."""

from __future__ import annotations

import msgspec
import pytest

from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import (
    BlockStored,
    Graded,
    KvEventBatch,
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16
MODEL = "m"


def _reg(wid: str, model: str = MODEL) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=wid, model=model, engine="vllm", engine_version="x", block_size=BLOCK,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
        endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
    )  # fmt: skip


def _predictor(n: int = 2, **cfg: object) -> RouteService:
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(**{"explore_fraction": 0.0, **cfg}))  # type: ignore[arg-type]
    for i in range(n):
        reg = _reg(f"w{i}")
        index.register_worker(reg.worker_id, reg.model, reg.block_size)
        p.on_registration(reg)
    return p


def _req(rid: str, tokens: int = 4096, **kw: object) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(range(tokens)), **kw)  # type: ignore[arg-type]


def test_every_worker_is_a_candidate_and_the_fastest_is_chosen() -> None:
    p = _predictor(3)
    g = p.route(_req("a").query(), 0.0, 0.0)
    assert g.admitted and len(g.candidates) == 3
    assert g.predicted_ttft_s == min(c.predicted_ttft_s for c in g.candidates)
    assert g.queue_wait_s is not None and g.prefill_s is not None
    assert g.predicted_ttft_s == pytest.approx(g.queue_wait_s + g.prefill_s)


def test_concurrent_requests_do_not_herd_onto_one_worker() -> None:
    p = _predictor(2)
    first = p.route(_req("a", 30_000).query(), 0.0, 0.0)
    second = p.route(_req("b", 30_000).query(), 0.0, 0.0)
    assert first.worker_id != second.worker_id
    third = p.route(_req("c", 30_000).query(), 0.0, 0.0)
    assert third.queue_wait_s is not None and third.queue_wait_s > 0  # someone is ahead now


def test_decisions_are_idempotent_by_request_id() -> None:
    p = _predictor(2)
    once = p.route(_req("a").query(), 0.0, 0.0)
    again = p.route(_req("a").query(), 5.0, 5.0)
    assert once == again
    assert sum(q.outstanding_count for q in p.book.queues.values()) == 1


def test_a_bound_that_cannot_be_met_is_rejected_with_a_retry_after() -> None:
    p = _predictor(1)
    for i in range(6):  # pile up work
        p.route(_req(f"load{i}", 60_000).query(), 0.0, 0.0)
    g = p.route(_req("tight", 4096, max_queue_wait_s=5.0).query(), 0.0, 0.0)
    assert not g.admitted and g.worker_id is None
    assert g.reject_reason == "predicted_ttft_exceeds_bound"
    assert g.predicted_ttft_s is not None and g.predicted_ttft_s > 5.0
    cfg = p.config
    assert g.retry_after_s is not None
    assert cfg.min_retry_after_s <= g.retry_after_s <= cfg.max_retry_after_s
    loose = p.route(_req("loose", 4096, max_queue_wait_s=300.0).query(), 0.0, 0.0)
    assert loose.admitted


def test_time_already_waited_counts_against_the_bound() -> None:
    p = _predictor(1)
    fresh = p.route(_req("a", 2048, max_queue_wait_s=10.0).query(), 0.0, 0.0)
    assert fresh.admitted and fresh.predicted_ttft_s is not None
    late = p.route(
        _req("b", 16, max_queue_wait_s=10.0, already_waited_s=10.0 - 1e-6).query(), 0.0, 0.0
    )
    assert not late.admitted


def test_overload_without_a_bound_is_rejected_only_when_severe() -> None:
    p = _predictor(1, overload_wait_s=1.0)
    assert p.route(_req("a", 60_000).query(), 0.0, 0.0).admitted
    later = [p.route(_req(f"b{i}", 60_000).query(), 0.0, 0.0) for i in range(4)]
    assert not later[-1].admitted and later[-1].reject_reason == "overloaded"


def test_explore_admits_a_fraction_of_would_be_rejections() -> None:
    p = _predictor(1, explore_fraction=1.0)
    for i in range(6):
        p.route(_req(f"load{i}", 60_000).query(), 0.0, 0.0)
    g = p.route(_req("x", 4096, max_queue_wait_s=5.0).query(), 0.0, 0.0)
    assert g.admitted and g.explore and g.retry_after_s is not None


def _store(p: RouteService, wid: str, tokens: list[int]) -> None:
    n = len(tokens) // BLOCK
    batch = KvEventBatch(worker_id=wid, model=MODEL, seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(range(1, n + 1)), token_ids=tuple(tokens[: n * BLOCK]),
        block_size=BLOCK,
    ),))  # fmt: skip
    p.index.apply(batch, 0.0)


def test_cached_prefix_is_credited_and_wins() -> None:
    p = _predictor(2)
    prompt = list(range(8192))
    _store(p, "w1", prompt)
    g = p.route(
        RouteRequest(request_id="c", model=MODEL, token_ids=tuple(prompt)).query(), 0.0, 0.0
    )
    assert g.worker_id == "w1" and g.cached_tokens == 8192
    cold = next(c for c in g.candidates if c.worker_id == "w0")
    assert cold.predicted_ttft_s > g.predicted_ttft_s  # type: ignore[operator]


def test_a_conversation_sticks_unless_staying_costs_more() -> None:
    p = _predictor(2, stickiness_margin_s=0.5)
    first = p.route(_req("t1", 1024, conversation_id="conv").query(), 0.0, 0.0)
    home = first.worker_id
    p.on_outcome(Outcome(request_id="t1", ts=0.1, kind="completion", worker_id=home,
                         actual_ttft_s=0.05, e2e_s=0.2, output_tokens=3), 0.2)  # type: ignore[arg-type]  # fmt: skip
    second = p.route(_req("t2", 1024, conversation_id="conv").query(), 1.0, 1.0)
    assert second.worker_id == home
    for i in range(5):  # the home worker gets very busy (twice the other's work)
        p.route(_req(f"other{i}", 60_000).query(), 1.0, 1.0)
        p.book.queues[home].add(f"pin{i}", 1.0, 60_000, 0, 10)  # type: ignore[arg-type]
        p.book.queues[home].add(f"pin{i}b", 1.0, 60_000, 0, 10)  # type: ignore[arg-type]
    third = p.route(_req("t3", 1024, conversation_id="conv").query(), 1.0, 1.0)
    assert third.worker_id != home


def test_prefer_cache_hit_takes_the_cached_worker_even_if_slower() -> None:
    p = _predictor(2)
    prompt = list(range(4096))
    _store(p, "w1", prompt)
    for i in range(3):
        p.book.queues["w1"].add(f"busy{i}", 0.0, 30_000, 0, 10)  # type: ignore[index]
    plain = p.route(
        RouteRequest(request_id="p", model=MODEL, token_ids=tuple(prompt)).query(), 0.0, 0.0
    )
    assert plain.worker_id == "w0"
    prefer = p.route(RouteRequest(request_id="q", model=MODEL, token_ids=tuple(prompt),
                                  prefer_cache_hit=True).query(), 0.0, 0.0)  # fmt: skip
    assert prefer.worker_id == "w1"


def test_cold_samples_teach_the_fit() -> None:
    """Each cold TTFT holds its prefill's steps, each with the overhead its decode shows
    (20 ms a token alone); the curve learns the prefill without them (the queue walk adds
    them on top)."""
    p = _predictor(1)
    a, b, step_s = 2e-5, 1e-9, 0.02
    settings = p.book.profiles["w0"].scheduler  # type: ignore[index]
    chunk = min(settings.max_num_batched_tokens, settings.long_prefill_token_threshold or 1 << 62)
    t = 0.0
    for i, n in enumerate([1000, 2000, 4000, 8000, 12000, 16000, 24000, 32000, 48000, 64000]):
        rid = f"s{i}"
        resp = p.route(_req(rid, n).query(), t, t)
        assert resp.admitted
        actual = a * n + b * n * n + -(-n // chunk) * step_s
        first = Outcome(request_id=rid, ts=t + actual, kind="first_token", worker_id="w0",
                        actual_ttft_s=actual)  # type: ignore[arg-type]  # fmt: skip
        p.on_outcome(first, t + actual)
        done = Outcome(request_id=rid, ts=t + actual + 4 * step_s, kind="completion",
                       worker_id="w0", actual_ttft_s=actual, e2e_s=actual + 4 * step_s,
                       output_tokens=5, engine_cached_tokens=0)  # type: ignore[arg-type]  # fmt: skip
        p.on_outcome(done, t + actual + 4 * step_s)
        graded = Graded(request_id=rid, ts=t, model=MODEL, workload_class="d", worker_id="w0",
                        status="served", admitted=True, prompt_tokens=n, actual_ttft_s=actual,
                        engine_cached_tokens=0)  # type: ignore[arg-type]  # fmt: skip
        assert p.on_graded(graded, t + actual)
        t += 1000.0
    curve = p.fits.curve("w0")  # type: ignore[arg-type]
    assert not curve.default
    assert curve.cost_s(32_000) == pytest.approx(a * 32_000 + b * 32_000**2, rel=0.05)


def test_no_worker_for_the_model_is_a_rejection_not_a_crash() -> None:
    p = _predictor(1)
    g = p.route(RouteRequest(request_id="z", model="other", token_ids=(1, 2, 3)).query(), 0.0, 0.0)
    assert not g.admitted and g.reject_reason == "no_worker_for_model"


def test_an_idle_worker_on_the_default_curve_gets_cold_requests_to_learn() -> None:
    p = _predictor(2)
    for i, n in enumerate([1000, 2000, 4000, 8000, 12000, 16000, 24000, 32000, 48000]):
        p.fits.observe_cold("w0", "c", n, 2e-5 * n, float(i))  # type: ignore[arg-type]
    assert not p.fits.curve("w0").default and p.fits.curve("w1").default  # type: ignore[arg-type]
    learned_is_faster = p.route(_req("a", 4096).query(), 0.0, 0.0)
    assert learned_is_faster.worker_id == "w1"  # idle and still learning: it takes the sample
    busy_now = p.route(_req("b", 4096).query(), 0.0, 0.0)
    assert busy_now.worker_id == "w0"  # the learner is busy: back to the fastest prediction


def test_a_worker_whose_cache_cannot_hold_the_prompt_is_not_a_candidate() -> None:
    p = _predictor(1)
    small = WorkerRegistration(
        worker_id="tiny", model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
        endpoints=WorkerEndpoints(http_url="http://tiny"), config_hash="c", ts=0.0,
        gpu_blocks=64,
    )  # fmt: skip
    p.on_registration(small)
    g = p.route(_req("big", 64 * BLOCK + 1).query(), 0.0, 0.0)
    assert [c.worker_id for c in g.candidates] == ["w0"]
    p.on_registration(WorkerRegistration(**{**{f: getattr(_reg("w0"), f) for f in
                      WorkerRegistration.__struct_fields__}, "gpu_blocks": 64}))  # fmt: skip
    g = p.route(_req("too-big", 64 * BLOCK + 1).query(), 0.0, 0.0)
    assert not g.admitted and g.reject_reason == "prompt_exceeds_kv_capacity"
    assert g.retry_after_s is None
    p.on_registration(small)
    g = p.route(_req("fits", 64 * BLOCK - 1).query(), 0.0, 0.0)
    assert {c.worker_id for c in g.candidates} == {"w0", "tiny"}


def test_a_prompt_whose_own_prefill_exceeds_the_bound_is_told_not_to_retry() -> None:
    p = _predictor(1)
    g = p.route(_req("huge", 60_000, max_queue_wait_s=5.0).query(), 0.0, 0.0)
    assert not g.admitted and g.reject_reason == "prefill_exceeds_bound"
    assert g.retry_after_s is None  # waiting cannot help


def _back_to_back(p: RouteService, a: float, b: float) -> None:
    sizes = [2048 + 523 * k for k in range(12)]
    for k, n in enumerate(sizes):
        req = RouteRequest(request_id=f"q{k}", model=MODEL,
                           token_ids=tuple(range(10_000 * k, 10_000 * k + n)))  # fmt: skip
        assert p.route(req.query(), 0.0, 0.0).admitted
    assert p.fits.curve("w0").default
    t = 0.0
    for k, n in enumerate(sizes):
        t += a * n + b * n * n
        p.on_outcome(Outcome(request_id=f"q{k}", ts=t, kind="first_token", worker_id="w0",
                             actual_ttft_s=t), t)  # fmt: skip


def test_busy_chains_bootstrap_a_worker_that_is_never_idle() -> None:
    """Busy chains (the default): the gaps between consecutive first tokens, less the
    steps' overhead, fit ``a`` with ``b`` fixed; the curve leaves the default."""
    p = _predictor(1)
    a, b = 2e-4, 3e-9
    _back_to_back(p, a, b)
    curve = p.fits.curve("w0")
    assert not curve.default and p.fits.describe()[0]["source"] == "busy"
    mean_n = 2048 + 523 * 5.5  # b·N folded into a at the prompts' sizes
    assert curve.a + curve.b * mean_n == pytest.approx(a + b * mean_n, rel=0.25)


def test_a_worker_that_is_never_idle_learns_from_back_to_back_first_tokens() -> None:
    """Per-prompt busy-period samples (``busy_chain_budgets = 0``): every request queued
    behind the previous one; the gaps between first tokens are their prefill times. They
    bootstrap the curve until cold samples come, which then take over."""
    p = _predictor(1, busy_chain_budgets=0)
    a, b = 2e-4, 3e-9
    _back_to_back(p, a, b)
    curve = p.fits.curve("w0")
    assert not curve.default
    assert curve.a == pytest.approx(a, rel=0.05) and curve.b == pytest.approx(b, rel=0.05)
    assert p.fits.describe()[0]["source"] == "busy"
    for k in range(10):  # cold samples of another truth take over
        n = 1000 + 700 * k
        p.fits.observe_cold("w0", "c", n, 1e-4 * n, float(k))
    assert p.fits.curve("w0").a == pytest.approx(1e-4, rel=0.05)
    assert p.fits.describe()[0]["source"] == "cold"


def test_small_prompts_on_a_chunked_engine_give_no_busy_samples() -> None:
    """Only the first prompt, sent to an idle engine, is a sample (a clean chain timed from
    its send); the gaps of the small prompts queued behind it are not theirs alone."""
    p = _predictor(1)
    for k in range(12):
        tokens = tuple(range(1000 * k, 1000 * k + 500 + k))  # nothing shared
        req = RouteRequest(request_id=f"s{k}", model=MODEL, token_ids=tokens)
        p.route(req.query(), 0.0, 0.0)
    for k in range(12):
        p.on_outcome(Outcome(request_id=f"s{k}", ts=0.1 * (k + 1), kind="first_token",
                             worker_id="w0", actual_ttft_s=0.1 * (k + 1)), 1.0)  # fmt: skip
    assert p.fits.describe()[0]["busy_observed"] == 1


IDLE_A = 4e-5


def _idle_prompt() -> tuple[RouteService, float, float]:
    """One worker; a 3000-token prompt (two steps at a 2048-token budget) routed at 0 to it
    idle; its true ``a`` and its TTFT (steps' overhead + a·N + b·N²)."""
    p = _predictor(1)
    n = 3000
    ttft = 2 * p.fits.step_cost("w0").overhead_s + IDLE_A * n + REFERENCE_B_S_PER_TOKEN2 * n * n
    p.route(RouteRequest(request_id="r0", model=MODEL, token_ids=tuple(range(n))).query(),
            0.0, 0.0)  # fmt: skip
    return p, IDLE_A, ttft


def test_a_prompt_sent_to_an_idle_worker_is_a_sample_at_once_when_nothing_waits() -> None:
    """Cold start from one request: its TTFT less its steps' overhead (3000 tokens at a
    2048-token budget: two) fits ``a`` (``b`` fixed) at its own first token when no other
    prompt sent before it still waits (none can have shared its steps), before any
    completion or graded record."""
    p, a, ttft = _idle_prompt()
    p.on_outcome(Outcome(request_id="r0", ts=ttft, kind="first_token", worker_id="w0",
                         actual_ttft_s=ttft), ttft)  # fmt: skip
    curve = p.fits.curve("w0")
    assert not curve.default and curve.a == pytest.approx(a, rel=1e-6)


def test_a_prompt_sent_to_an_idle_worker_waits_for_the_next_step_when_another_waits() -> None:
    """The same prompt with a second one sent during its prefill: the second may end in the
    same step, so the first is a sample only once a later first token shows that its last
    step held nothing else."""
    p, a, ttft = _idle_prompt()
    p.route(RouteRequest(request_id="r1", model=MODEL, token_ids=tuple(range(7, 600))).query(),
            0.01, 0.01)  # fmt: skip
    p.on_outcome(Outcome(request_id="r0", ts=ttft, kind="first_token", worker_id="w0",
                         actual_ttft_s=ttft), ttft)  # fmt: skip
    assert p.fits.curve("w0").default  # r1 may still end in the same step
    p.on_outcome(Outcome(request_id="r1", ts=ttft + 0.05, kind="first_token", worker_id="w0",
                         actual_ttft_s=ttft + 0.04), ttft + 0.05)  # fmt: skip
    curve = p.fits.curve("w0")
    assert not curve.default and curve.a == pytest.approx(a, rel=1e-6)


def test_on_a_one_sequence_engine_the_busy_gap_starts_at_the_previous_completion() -> None:
    """A serial engine decodes a request to its end before the next prompt starts: the gap
    from the previous first token would count that decode as prefill."""
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    reg = msgspec.structs.replace(
        _reg("w0"), scheduler=SchedulerSettings(max_num_seqs=1, chunked_prefill=False)
    )
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    p.on_registration(reg)
    a, decode_s = 1e-4, 2.0
    sizes = [1000 + 400 * k for k in range(12)]
    for k, n in enumerate(sizes):
        req = RouteRequest(request_id=f"q{k}", model=MODEL,
                           token_ids=tuple(range(10_000 * k, 10_000 * k + n)))  # fmt: skip
        p.route(req.query(), 0.0, 0.0)
    t = 0.0
    for k, n in enumerate(sizes):
        t += a * n
        p.on_outcome(Outcome(request_id=f"q{k}", ts=t, kind="first_token", worker_id="w0",
                             actual_ttft_s=t), t)  # fmt: skip
        t += decode_s
        p.on_outcome(Outcome(request_id=f"q{k}", ts=t, kind="completion", worker_id="w0",
                             actual_ttft_s=t - decode_s, output_tokens=10, e2e_s=t), t)  # fmt: skip
    curve = p.fits.curve("w0")
    assert not curve.default
    assert curve.cost_s(3000) == pytest.approx(a * 3000, rel=0.05)  # no decode in it


def _served(p: RouteService, rid: str, ttft: float, t: float) -> None:
    g = p.decisions[rid]  # type: ignore[index]
    assert g.worker_id is not None
    p.on_outcome(Outcome(request_id=rid, ts=t, kind="first_token", worker_id=g.worker_id,
                         actual_ttft_s=ttft), t)  # fmt: skip


def test_grants_carry_a_p90_learned_from_first_tokens() -> None:
    p = _predictor(1, quantile_min_samples=10)
    first = p.route(_req("q0", 2048).query(), 0.0, 0.0)
    assert first.predicted_ttft_p90_s is not None and first.predicted_ttft_s is not None
    assert first.predicted_ttft_p90_s > first.predicted_ttft_s  # the default factor
    for i in range(40):  # every request took exactly 3× its prediction
        rid = f"r{i}"
        g = p.route(_req(rid, 2048).query(), 100.0 * i, 100.0 * i)
        assert g.predicted_ttft_s is not None
        _served(p, rid, 3 * g.predicted_ttft_s, 100.0 * i + 1)
    g = p.route(_req("late", 2048).query(), 5000.0, 5000.0)
    assert g.predicted_ttft_s is not None and g.predicted_ttft_p90_s is not None
    # residuals log((3p + s0)/(p + s0)) < log 3: the p90 is near, never above, 3p + 2·s0
    floor = p.config.quantile_floor_s
    assert 2 * g.predicted_ttft_s < g.predicted_ttft_p90_s <= 3 * g.predicted_ttft_s + 2 * floor
    assert p.quantiles.observed == 40


def test_requests_still_waiting_count_in_the_p90_and_leave_when_answered() -> None:
    p = _predictor(1, quantile_min_samples=10)
    for t in (0.0, 500.0):  # queues, each request answered at its prediction (the first
        grants = [p.route(_req(f"r{t}-{i}", 2048).query(), t, t) for i in range(20)]
        for g in grants:  # round also teaches the curve: the second's are fitted)
            assert g.predicted_ttft_s is not None
            _served(p, g.request_id, g.predicted_ttft_s, t + g.predicted_ttft_s)
    assert not p.quantiles._waiting
    for i in range(20):  # another queue, still without a first token 60 s later
        p.route(_req(f"stuck{i}", 2048).query(), 1000.0, 1000.0)
    assert len(p.quantiles._waiting) == 20
    late = p.route(_req("late", 2048).query(), 1060.0, 1060.0)
    assert late.predicted_ttft_s is not None and late.predicted_ttft_p90_s is not None
    wait, default = late.queue_wait_s, late.fit.default if late.fit is not None else None
    args = ("w0", late.predicted_ttft_s, 0.9, wait, default)
    blind = p.quantiles.upper(*args)  # type: ignore[arg-type]
    seen = p.quantiles.upper(*args, 1060.0)  # type: ignore[arg-type]
    assert late.predicted_ttft_p90_s == pytest.approx(seen, rel=1e-4)
    assert seen > 1.5 * blind  # the stuck ones passed its quantile
    for i in range(20):  # they fail: their bounds stop counting
        wid = p.decisions[f"stuck{i}"].worker_id  # type: ignore[index]
        p.on_outcome(Outcome(request_id=f"stuck{i}", ts=1061.0, kind="first_token",
                             worker_id=wid, status="error"), 1061.0)  # fmt: skip
    assert set(p.quantiles._waiting) == {"late"}
    assert p.quantiles.upper(*args, 1061.0) == pytest.approx(blind)  # type: ignore[arg-type]


def test_admission_against_a_quantile_is_stricter_than_the_point() -> None:
    point, strict = _predictor(1), _predictor(1, admission_quantile=0.9)
    for p in (point, strict):
        for i in range(3):
            p.route(_req(f"load{i}", 20_000).query(), 0.0, 0.0)
    probe = point.route(_req("probe", 2048).query(), 0.0, 0.0)
    assert probe.predicted_ttft_s is not None and probe.predicted_ttft_p90_s is not None
    bound = (probe.predicted_ttft_s + probe.predicted_ttft_p90_s) / 2  # between the two
    ok = point.route(_req("x", 2048, max_queue_wait_s=bound).query(), 0.0, 0.0)
    no = strict.route(_req("x", 2048, max_queue_wait_s=bound).query(), 0.0, 0.0)
    assert ok.admitted and not no.admitted
    assert no.reject_reason == "predicted_ttft_exceeds_bound" and no.retry_after_s is not None


def test_a_prompt_overtaken_by_later_ones_starts_no_busy_chain() -> None:
    """A long prompt capped at the long-prefill threshold prefills beside shorter prompts
    sent after it, whose first tokens come first. Its first token then ends a gap that
    holds only its last steps: as the start of a chain it would read its whole prefill
    in them (``a`` 10× too low in one generated fleet, queue waits 10× short)."""
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    reg = msgspec.structs.replace(_reg("w0"), scheduler=SchedulerSettings(
        max_num_batched_tokens=2048, max_num_seqs=8, long_prefill_token_threshold=512))  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    p.on_registration(reg)
    sent = {"long": (0.0, 9000), "short": (0.01, 600), "after": (0.3, 700), "last": (0.4, 800)}
    for k, (t, n) in enumerate(sent.values()):
        rid = list(sent)[k]
        body = RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(range(k, k + n)))
        assert p.route(body.query(), t, t).worker_id == "w0"
    # the short prompt overtakes the long one; two more first tokens after the long one's
    for rid, ts in (("short", 0.1), ("long", 0.9), ("after", 1.0), ("last", 1.1)):
        p.on_outcome(Outcome(request_id=rid, ts=ts, kind="first_token", worker_id="w0",
                             actual_ttft_s=ts - sent[rid][0]), ts)  # fmt: skip
        if rid == "short":  # the idle engine's first first token: the burst's own sample
            burst = p.fits.curve("w0")  # (foretoken.core.queue.burst)
            assert p.fits.describe()[0]["busy_observed"] == 1
    # before, the long prompt began a chain at 0.1 and its 9,000 tokens in 0.8 s were a sample
    assert p.fits.describe()[0]["busy_observed"] == 1
    assert p.fits.curve("w0").a == burst.a


@pytest.mark.parametrize("name", ["overload_wait_s", "placement_delay_weight",
                                  "stickiness_margin_s"])  # fmt: skip
def test_a_nan_setting_is_refused_by_name(name: str) -> None:
    """NaN passes every comparison: it used to load, then fail later naming another value."""
    with pytest.raises(ValueError, match=name):
        PredictorConfig(**{name: float("nan")})  # type: ignore[arg-type]
