"""Prompts sent and still held by a worker credit the prefix a new prompt shares with them
(``core/routing/sent_prefixes.py``): the native counts and the Python reference answer the
same, and the route service credits, labels and releases them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foretoken.core.index.native import NativeIndex
from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.sent_prefixes import SentPrefixes
from foretoken.core.routing.service import RouteService
from foretoken.core.types import CacheSource, RequestId, WorkerId
from foretoken.wire.records import (
    Outcome,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16
MODEL = "m"

# A chain is a prefix of one of a few "documents" (so chains share prefixes): hashes are
# (document, position) mixed into one u64, as own hashes commit to their whole prefix.
docs = st.integers(0, 3)


def _chain(doc: int, length: int, branch: int = 0) -> np.ndarray:
    """``length`` blocks of document ``doc``; from block 5 on, ``branch`` forks it."""
    return np.array([(doc << 40) | ((branch if i >= 5 else 0) << 20) | (i + 1)
                     for i in range(length)], dtype=np.uint64)  # fmt: skip


workers = st.sampled_from(["w0", "w1"])
lengths, branches = st.integers(1, 40), st.integers(0, 2)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 7), workers, docs, lengths, branches),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("forget"), workers),
        st.tuples(st.just("depths"), docs, lengths, branches, st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops)
def test_native_counts_answer_as_the_reference(ops: list[tuple]) -> None:
    native, reference = SentPrefixes(native=True), SentPrefixes(native=False)
    sent: dict[str, str] = {}  # request -> worker, in the order sent (what held_at reads)
    for op in ops:
        if op[0] == "add":
            _, rid, wid, doc, length, branch = op
            sent.setdefault(f"r{rid}", wid)
            for s in (native, reference):
                s.add(RequestId(f"r{rid}"), WorkerId(wid), _chain(doc, length, branch))
        elif op[0] == "release":
            sent.pop(f"r{op[1]}", None)
            for s in (native, reference):
                s.release(RequestId(f"r{op[1]}"))
        elif op[0] == "forget":
            sent = {r: w for r, w in sent.items() if w != op[1]}
            for s in (native, reference):
                s.forget_worker(WorkerId(op[1]))
        else:
            _, doc, length, branch, cap = op
            chain = _chain(doc, length, branch)
            workers = [WorkerId("w0"), WorkerId("w1")]
            assert native.depths(chain, cap, workers) == reference.depths(chain, cap, workers)
        for w in ("w0", "w1"):  # one worker's held prompts, the last sent first
            want = [r for r, held_by in reversed(sent.items()) if held_by == w]
            for s in (native, reference):
                assert [r for r, _ in s.held_at(WorkerId(w))] == want


def test_the_depth_is_the_longest_prefix_shared_with_any_held_prompt() -> None:
    for native in (True, False):
        s = SentPrefixes(native=native)
        s.add(RequestId("a"), WorkerId("w"), _chain(1, 30))
        s.add(RequestId("b"), WorkerId("w"), _chain(1, 12, branch=1))
        assert s.depths(_chain(1, 40), 100, [WorkerId("w")]) == {"w": 30}
        assert s.depths(_chain(1, 40), 20, [WorkerId("w")]) == {"w": 20}  # the engine's cap
        assert s.depths(_chain(1, 40, branch=1), 100, [WorkerId("w")]) == {"w": 12}
        assert s.depths(_chain(2, 40), 100, [WorkerId("w")]) == {"w": 0}
        s.release(RequestId("a"))  # b still holds the first 5 blocks it shares with a
        assert s.depths(_chain(1, 40), 100, [WorkerId("w")]) == {"w": 5}
        s.release(RequestId("b"))
        assert s.depths(_chain(1, 40), 100, [WorkerId("w")]) == {}  # nothing held


# ---------------------------------------------------------------------------- the service


def _reg(wid: str, eagle: bool = False) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=wid, model=MODEL, engine="vllm", engine_version="x", block_size=BLOCK,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
        endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
        eagle=eagle,
    )  # fmt: skip


def _service(native: bool, eagle: bool = False, **cfg: object) -> RouteService:
    index = NativeIndex() if native else PrefixIndex()
    config = PredictorConfig(**{"explore_fraction": 0.0, **cfg})  # type: ignore[arg-type]
    p = RouteService(index, config=config)
    reg = _reg("w0", eagle)
    index.register_worker(reg.worker_id, reg.model, reg.block_size, eagle=eagle)
    p.on_registration(reg)
    return p


def _req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(request_id=rid, model=MODEL, token_ids=tuple(tokens))


@pytest.mark.parametrize("native", [True, False])
def test_a_prompt_behind_one_with_its_prefix_is_credited_until_that_one_completes(
    native: bool,
) -> None:
    p = _service(native)
    shared = list(range(4000))
    first = p.route(_req("a", shared + [90_001] * 100).query(), 0.0, 0.0)
    assert first.cached_tokens == 0  # nothing held, nothing in the index
    second = p.route(_req("b", shared + [90_002] * 100).query(), 0.1, 0.1)
    assert second.cached_tokens == (4000 // BLOCK) * BLOCK  # the full blocks of the prefix
    assert second.cache_source == CacheSource.SENT and second.cached_tier == "GPU"
    assert second.prefill_s is not None and first.prefill_s is not None
    assert second.prefill_s < first.prefill_s
    # a whole prompt held: the engine still computes its last block
    same = p.route(_req("c", shared + [90_001] * 100).query(), 0.2, 0.2)
    assert same.cached_tokens == ((4100 - 1) // BLOCK) * BLOCK
    for rid in ("a", "b", "c"):  # completions: their blocks are the index's now (or gone)
        p.on_outcome(Outcome(request_id=rid, ts=1.0, kind="completion", worker_id="w0",
                             actual_ttft_s=0.5, e2e_s=1.0, output_tokens=3), 1.0)  # type: ignore[arg-type]  # fmt: skip
    after = p.route(_req("d", shared + [90_003] * 100).query(), 2.0, 2.0)
    assert after.cached_tokens == 0 and after.cache_source == CacheSource.EVENTS


def test_eagle_recomputes_the_last_shared_block_and_the_credit_can_be_turned_off() -> None:
    shared = list(range(4000))
    p = _service(True, eagle=True)
    p.route(_req("a", shared + [1] * 100).query(), 0.0, 0.0)
    assert (
        p.route(_req("b", shared + [2] * 100).query(), 0.1, 0.1).cached_tokens
        == ((4000 // BLOCK) - 1) * BLOCK
    )
    off = _service(True, credit_sent_prefixes=False)
    off.route(_req("a", shared + [1] * 100).query(), 0.0, 0.0)
    assert off.route(_req("b", shared + [2] * 100).query(), 0.1, 0.1).cached_tokens == 0


def test_a_request_that_leaves_the_queue_model_unanswered_is_released() -> None:
    p = _service(True, unconfirmed_decision_s=1.0)
    shared = list(range(2000))
    p.route(_req("a", shared + [1] * 50).query(), 0.0, 0.0)  # never confirmed on `grants`
    p.maintain(5.0)
    assert len(p.predictions.sent) == 0
    assert p.route(_req("b", shared + [2] * 50).query(), 5.0, 5.0).cached_tokens == 0


@settings(max_examples=300, deadline=None)
@given(docs, st.integers(0, 40), st.integers(0, 3), docs, st.integers(0, 40), st.integers(0, 3),
       st.integers(-1, 45))  # fmt: skip
def test_shared_depth_is_the_first_difference_of_two_chains(
    d1: int, n1: int, b1: int, d2: int, n2: int, b2: int, top: int
) -> None:
    """The binary search of ``shared_depth`` answers what comparing the arrays whole does
    (the held walks' depth of each held prompt), at every cap."""
    from foretoken.core.routing.predict import shared_depth

    a, b = _chain(d1, n1, b1), _chain(d2, n2, b2)
    m = max(min(len(a), len(b), top), 0)
    same = a[:m] == b[:m]
    expected = m if bool(same.all()) else int(np.argmin(same))
    assert shared_depth(a, b, top) == expected == shared_depth(b, a, top)
