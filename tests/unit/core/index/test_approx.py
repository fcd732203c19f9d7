"""Approximate cache mode (predictor/approx.py, issue 9): engines that publish no KV events
are credited from the prompts the route service sent them — once their first token arrived —
aged out by a TTL and by an estimate of the worker's capacity (LRU), and every credit on
them is flagged approximate, from the candidate's prediction to the grant."""

from __future__ import annotations

from collections import OrderedDict

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from foretoken.adapters.engines.engines_file import EngineConfig
from foretoken.core.index.approx import ApproxCacheConfig, index_params
from foretoken.core.index.prefix import FOLD_STATS_EVERY, PrefixIndex
from foretoken.core.index.state import SWEEPS_PER_TTL
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.wire.records import (
    BlockStored,
    KvEventBatch,
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16
MODEL = ModelName("m")
TTL = 60.0


def reg(wid: str, *, events: bool = False, gpu_blocks: int | None = None) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=WorkerId(wid), model=MODEL, engine="llamacpp", engine_version="x",
        block_size=BLOCK, scheduler=SchedulerSettings(max_num_batched_tokens=2048),
        endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
        has_kv_events=events, reports_cached_tokens=events, gpu_blocks=gpu_blocks,
    )  # fmt: skip


def prompt(blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + blocks * BLOCK))


def approx_index(*regs: WorkerRegistration, config: ApproxCacheConfig) -> PrefixIndex:
    index = PrefixIndex()
    for r in regs:
        ttl, capacity = index_params(r, config)
        index.register_worker(r.worker_id, r.model, r.block_size,
                              store_only_ttl_s=ttl, capacity_blocks=capacity)  # fmt: skip
    return index


def serve(index: PrefixIndex, wid: str, tokens: list[int], now_s: float) -> int:
    owns = index.hash_prompt(MODEL, BLOCK, tokens)
    return index.observe_served(WorkerId(wid), owns, now_s)


def cached(index: PrefixIndex, wid: str, tokens: list[int]) -> int:
    return index.lookup(MODEL, tokens)[WorkerId(wid)].tokens


# --------------------------------------------------------------------------- config


def test_capacity_is_the_registered_gpu_blocks_else_the_configured_default() -> None:
    config = ApproxCacheConfig(ttl_s=TTL, default_capacity_tokens=10 * BLOCK + 5)
    assert config.capacity_blocks(reg("a", gpu_blocks=7)) == 7
    assert config.capacity_blocks(reg("a")) == 10
    assert index_params(reg("a"), config) == (TTL, 10)
    assert index_params(reg("e", events=True), config) == (None, None)
    assert reg("a").cache_source == "approximate"
    assert reg("e", events=True).cache_source == "events"
    with pytest.raises(ValueError, match="ttl_s"):
        ApproxCacheConfig(ttl_s=0.0)
    with pytest.raises(ValueError, match="default_capacity_tokens"):
        ApproxCacheConfig(default_capacity_tokens=0)


def test_the_engines_file_flags_reach_the_registration() -> None:
    base = {"worker_id": "l0", "model": "m", "http_url": "http://l0",
            "kv_events_url": "tcp://127.0.0.1:1"}  # fmt: skip
    flags = {"engine": "llamacpp", "kv_events": False, "reports_cached_tokens": False}
    silent = msgspec.convert({**base, **flags}, EngineConfig).registration(0.0)
    assert not silent.has_kv_events and not silent.reports_cached_tokens
    vllm = msgspec.convert(base, EngineConfig).registration(0.0)
    assert vllm.has_kv_events and vllm.reports_cached_tokens
    no_url = msgspec.convert({**base, "kv_events_url": None}, EngineConfig).registration(0.0)
    assert not no_url.has_kv_events


def test_old_registrations_and_grants_decode_with_the_defaults() -> None:
    old = msgspec.json.encode(reg("a")).replace(b',"reports_cached_tokens":false', b"")
    decoded = msgspec.json.decode(old, type=WorkerRegistration)
    assert decoded.reports_cached_tokens  # the default: engines report unless they say
    with pytest.raises(msgspec.ValidationError, match="gpu_blocks"):
        msgspec.convert({**msgspec.to_builtins(reg("a")), "gpu_blocks": 0}, WorkerRegistration)


# --------------------------------------------------------------------------- index


def test_a_served_prompt_is_credited_on_its_worker_only() -> None:
    config = ApproxCacheConfig(ttl_s=TTL)
    index = approx_index(reg("a"), reg("b"), config=config)
    p = prompt(4)
    assert serve(index, "a", p, 0.0) == 4
    hits = index.lookup(MODEL, [*p, 999])
    assert hits[WorkerId("a")].tokens == 4 * BLOCK and hits[WorkerId("a")].approximate
    assert hits[WorkerId("b")].tokens == 0 and hits[WorkerId("b")].approximate
    # a longer prompt sharing the prefix matches the prefix only
    assert cached(index, "a", p[: 2 * BLOCK] + prompt(2, 5000)) == 2 * BLOCK
    # serving it again refreshes, it does not count copies
    assert serve(index, "a", p, 1.0) == 0
    stats = index.stats()["workers"]["a"]  # type: ignore[index]
    assert stats["blocks"]["GPU"] == 4 and stats["duplicate_copies"] == 0


def test_a_worker_with_kv_events_does_not_learn_from_routes() -> None:
    index = approx_index(reg("e", events=True), config=ApproxCacheConfig())
    assert serve(index, "e", prompt(4), 0.0) == 0
    assert cached(index, "e", prompt(4)) == 0
    assert not index.lookup(MODEL, prompt(4))[WorkerId("e")].approximate


def test_aging_forgets_a_prompt_a_ttl_after_it_was_last_served() -> None:
    index = approx_index(reg("a"), config=ApproxCacheConfig(ttl_s=TTL))
    old, fresh = prompt(3), prompt(3, 7000)
    serve(index, "a", old, 0.0)
    serve(index, "a", fresh, TTL / 2)
    index.age(TTL * 0.99)
    assert cached(index, "a", old) == 3 * BLOCK  # not yet
    index.age(TTL * (1 + 1 / SWEEPS_PER_TTL) + 0.01)  # swept at most TTL/8 late
    assert cached(index, "a", old) == 0
    assert cached(index, "a", fresh) == 3 * BLOCK
    assert index.totals.expired_blocks == 3
    # serving again restarts its clock
    serve(index, "a", fresh, 1.2 * TTL)
    index.age(2.0 * TTL)
    assert cached(index, "a", fresh) == 3 * BLOCK
    index.age(2.2 * TTL + TTL / SWEEPS_PER_TTL + 0.01)
    assert cached(index, "a", fresh) == 0
    assert index.stats()["workers"]["a"]["engine_hashes"] == 0  # type: ignore[index]


def test_capacity_evicts_the_least_recently_served_at_the_estimate() -> None:
    config = ApproxCacheConfig(ttl_s=10 * TTL)
    index = approx_index(reg("a", gpu_blocks=8), config=config)
    first, second, third = prompt(3, 0), prompt(3, 1000), prompt(3, 2000)
    serve(index, "a", first, 0.0)
    serve(index, "a", second, 1.0)
    serve(index, "a", first, 2.0)  # first is the most recent again
    serve(index, "a", third, 3.0)  # 9 blocks > 8: one block of `second` goes
    assert index.stats()["workers"]["a"]["blocks"]["GPU"] == 8  # type: ignore[index]
    # the tail of the least recent prompt goes first: its prefix still matches
    assert [cached(index, "a", p) for p in (first, second, third)] == [48, 32, 48]
    serve(index, "a", prompt(5, 3000), 4.0)  # 5 more: what is left of `second`, `first`
    assert [cached(index, "a", p) for p in (first, second, third)] == [0, 0, 48]
    assert index.stats()["workers"]["a"]["blocks"]["GPU"] == 8  # type: ignore[index]
    assert index.totals.trimmed_blocks == 1 + 5


def test_a_prompt_larger_than_the_capacity_keeps_its_prefix() -> None:
    index = approx_index(reg("a", gpu_blocks=4), config=ApproxCacheConfig())
    p = prompt(6)
    serve(index, "a", p, 0.0)
    assert cached(index, "a", p) == 4 * BLOCK


def test_the_approximate_view_survives_a_snapshot() -> None:
    index = approx_index(reg("a", gpu_blocks=8), config=ApproxCacheConfig(ttl_s=TTL))
    serve(index, "a", prompt(3), 0.0)
    restored = PrefixIndex.restore(index.snapshot())
    assert cached(restored, "a", prompt(3)) == 3 * BLOCK
    restored.age(TTL * 1.5)
    assert cached(restored, "a", prompt(3)) == 0


# --------------------------------------------------------------------------- predictor


def predictor(*regs: WorkerRegistration, ttl_s: float = TTL) -> RouteService:
    config = ApproxCacheConfig(ttl_s=ttl_s)
    index = approx_index(*regs, config=config)
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    for r in regs:
        p.on_registration(r)
    return p


def route(p: RouteService, rid: str, tokens: list[int], now_s: float) -> RouteRequest:
    req = RouteRequest(request_id=RequestId(rid), model=MODEL, token_ids=tuple(tokens))
    p.route(req.query(), now_s, now_s)
    return req


def first_token(p: RouteService, rid: str, wid: str, now_s: float, ttft_s: float = 0.5) -> None:
    p.on_outcome(Outcome(request_id=RequestId(rid), ts=now_s, kind="first_token",
                         worker_id=WorkerId(wid), actual_ttft_s=ttft_s), now_s)  # fmt: skip


def test_credit_arrives_with_the_first_token_and_is_flagged_approximate() -> None:
    p = predictor(reg("a"))
    tokens = prompt(64)
    grant = p.decisions[route(p, "r1", tokens, 0.0).request_id]
    assert grant.worker_id == "a" and grant.cached_tokens == 0
    assert grant.cache_source == "approximate" and grant.approximate_cache
    assert all(c.cache_source == "approximate" and c.approximate_cache for c in grant.candidates)
    # sent, no first token yet: not in the index, but r1 is ahead of r2 there and holds it
    # (core/routing/sent_prefixes.py); the engine recomputes the last block of a whole prompt
    second = p.decisions[route(p, "r2", tokens, 0.1).request_id]
    assert second.cached_tokens == 63 * BLOCK and second.cache_source == "approximate"
    assert not any(h.tokens for h in p.index.lookup(MODEL, tokens).values())  # none yet
    first_token(p, "r1", "a", 1.0)
    third = p.decisions[route(p, "r3", [*tokens, 1], 1.1).request_id]
    assert third.cached_tokens == 64 * BLOCK and third.cache_source == "approximate"
    assert third.cached_tier == "GPU" and third.approximate_cache
    assert "r1" not in p.learner.served_prompts  # fed once, then forgotten


def test_credit_ages_out_in_the_predictions() -> None:
    p = predictor(reg("a"))
    tokens = prompt(8)
    route(p, "r1", tokens, 0.0)
    first_token(p, "r1", "a", 0.5)
    assert p.predict(MODEL, tokens, 0.6)[0].cached_tokens == 8 * BLOCK
    p.on_outcome(Outcome(request_id=RequestId("r1"), ts=0.7, kind="completion",
                         worker_id=WorkerId("a"), actual_ttft_s=0.5, output_tokens=3,
                         e2e_s=0.7), 0.7)  # fmt: skip
    assert p.predict(MODEL, tokens, 0.5 + TTL * 1.2)[0].cached_tokens == 0


def test_a_failed_request_or_another_worker_credits_nothing() -> None:
    p = predictor(reg("a"))
    tokens = prompt(8)
    route(p, "r1", tokens, 0.0)
    p.on_outcome(Outcome(request_id=RequestId("r1"), ts=1.0, kind="completion",
                         worker_id=WorkerId("a"), status="error", error="boom"), 1.0)  # fmt: skip
    assert p.predict(MODEL, tokens, 1.1)[0].cached_tokens == 0
    assert "r1" not in p.learner.served_prompts
    route(p, "r2", tokens, 2.0)
    first_token(p, "r2", "elsewhere", 2.5)  # not where we sent it: not credited there
    assert p.predict(MODEL, tokens, 2.6)[0].cached_tokens == 0


def test_a_lost_first_token_is_made_up_by_the_completion() -> None:
    p = predictor(reg("a"))
    tokens = prompt(8)
    route(p, "r1", tokens, 0.0)
    p.on_outcome(Outcome(request_id=RequestId("r1"), ts=2.0, kind="completion",
                         worker_id=WorkerId("a"), actual_ttft_s=0.4, output_tokens=3,
                         e2e_s=1.0), 2.0)  # fmt: skip
    assert p.predict(MODEL, tokens, 2.1)[0].cached_tokens == 8 * BLOCK


def test_event_workers_keep_their_exact_source() -> None:
    p = predictor(reg("a"), reg("e", events=True))
    tokens = prompt(4)
    p.index.apply(KvEventBatch(worker_id=WorkerId("e"), model=MODEL, seq=0, ts=0.0, events=(
        BlockStored(block_hashes=(1, 2, 3, 4), token_ids=tuple(tokens), block_size=BLOCK),
    )), 0.0)  # fmt: skip
    by_worker = {c.prediction.worker_id: c.prediction for c in p.predict(MODEL, tokens, 0.0)}
    assert by_worker[WorkerId("e")].cache_source == "events"
    assert not by_worker[WorkerId("e")].approximate_cache
    assert by_worker[WorkerId("e")].cached_tokens == 4 * BLOCK
    assert by_worker[WorkerId("a")].cache_source == "approximate"
    route(p, "r1", tokens, 0.0)
    assert "r1" not in p.learner.served_prompts  # routed to the event worker (its hit is faster)


def test_counters_stay_exact_over_many_served_prompts() -> None:
    index = approx_index(reg("a", gpu_blocks=100_000), config=ApproxCacheConfig(ttl_s=TTL))
    served = FOLD_STATS_EVERY + 100  # past the point where per-call stats are folded
    for i in range(served):
        serve(index, "a", prompt(1, 10 * BLOCK * i), i * 1e-3)
    assert index.totals.stored_blocks == served
    assert index.stats()["workers"]["a"]["blocks"]["GPU"] == served  # type: ignore[index]


# --------------------------------------------------------------------------- property

served_prompts = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(0, 3), st.integers(0, 5)),
    min_size=1,
    max_size=25,
)


def family_prompt(family: int, shared: int, extra: int, suffix: int) -> list[int]:
    """``shared`` blocks of a family's common prefix, then ``extra`` blocks of one suffix."""
    base = list(range(family * 1000, family * 1000 + shared * BLOCK))
    tail = list(range(100_000 + suffix * 1000, 100_000 + suffix * 1000 + extra * BLOCK))
    return base + tail


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=served_prompts, capacity=st.integers(1, 12))
def test_capacity_lru_matches_a_reference_model(
    ops: list[tuple[int, int, int, int]], capacity: int
) -> None:
    """Without expiry, the approximate view is exactly an LRU of blocks at the capacity,
    refreshed by each served prompt, a prompt's tail older than its prefix."""
    index = approx_index(reg("a", gpu_blocks=capacity), config=ApproxCacheConfig(ttl_s=1e9))
    lru: OrderedDict[int, None] = OrderedDict()
    prompts = [family_prompt(*op) for op in ops]
    for t, tokens in enumerate(prompts):
        owns = index.hash_prompt(MODEL, BLOCK, tokens).tolist()
        index.observe_served(WorkerId("a"), owns, float(t))
        for own in reversed(owns):
            lru[own] = None
            lru.move_to_end(own)
        while len(lru) > capacity:
            lru.popitem(last=False)
        assert index.stats()["workers"]["a"]["blocks"]["GPU"] == len(lru)  # type: ignore[index]
        for other in prompts[: t + 1]:
            hashes = index.hash_prompt(MODEL, BLOCK, other).tolist()
            expected = next((i for i, h in enumerate(hashes) if h not in lru), len(hashes))
            assert cached(index, "a", other) == expected * BLOCK
