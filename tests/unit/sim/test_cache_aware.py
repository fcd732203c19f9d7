"""The cache-aware baseline: longest prefix match while the load is balanced, the
least-loaded worker when it is not, the emptiest tree when nothing matches enough."""

from __future__ import annotations

import numpy as np

from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.sim.cache_aware import (
    BLOCK_TOKENS,
    REASON_BALANCE,
    REASON_MATCH,
    REASON_SPACE,
    CacheAware,
    CacheAwareSettings,
    _Tree,
    block_chain,
)
from foretoken.sim.policy import Arrival, FleetLedger
from tests.unit.sim.test_policy import MODEL_A, two_model_fleet


def _arrival(i: int, tokens: np.ndarray) -> Arrival:
    return Arrival(request_id=RequestId(f"q{i}"), model=ModelName(MODEL_A), arrival_s=float(i),
                   prompt_tokens=len(tokens), token_ids=tokens, max_tokens=4)  # fmt: skip


def _send(policy: CacheAware, ledger: FleetLedger, i: int, tokens: np.ndarray) -> WorkerId:
    decision = policy.decide(_arrival(i, tokens), ledger)
    assert decision.worker_id is not None
    ledger.record_sent(RequestId(f"q{i}"), decision.worker_id, len(tokens))
    return decision.worker_id


def test_a_follow_up_goes_where_its_prefix_was_sent() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    policy = CacheAware(ledger)
    rng = np.random.default_rng(0)
    convs = [rng.integers(0, 30000, 2000) for _ in range(3)]
    first = [_send(policy, ledger, i, c) for i, c in enumerate(convs)]
    assert len(set(first)) == 3  # no match: the emptiest tree each time
    for j, c in enumerate(convs):
        follow = np.concatenate([c, rng.integers(0, 30000, 300)])
        decision = policy.decide(_arrival(10 + j, follow), ledger)
        assert (decision.worker_id, decision.reason) == (first[j], REASON_MATCH)
        assert decision.cached_tokens == (2000 // BLOCK_TOKENS) * BLOCK_TOKENS


def test_an_imbalanced_fleet_sends_to_the_least_loaded_worker() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    settings = CacheAwareSettings(balance_abs_threshold=2, balance_rel_threshold=1.5)
    policy = CacheAware(ledger, settings=settings)
    shared = np.arange(1000, dtype=np.int32)
    home = _send(policy, ledger, 0, shared)
    for i in range(1, 3):  # the same prompt goes home while max - min <= 2
        assert _send(policy, ledger, i, shared) == home
    decision = policy.decide(_arrival(9, shared), ledger)
    assert decision.reason == REASON_BALANCE and decision.worker_id != home


def test_a_weak_match_goes_to_the_emptiest_tree() -> None:
    ledger = FleetLedger.for_fleet(two_model_fleet())
    policy = CacheAware(ledger, settings=CacheAwareSettings(cache_threshold=0.9))
    base = np.arange(2000, dtype=np.int32)
    home = _send(policy, ledger, 0, base)
    half = np.concatenate([base[:1000], np.arange(50_000, 51_000, dtype=np.int32)])
    decision = policy.decide(_arrival(1, half), ledger)
    assert decision.reason == REASON_SPACE and decision.worker_id != home


def test_the_tree_forgets_the_least_recently_used_blocks_beyond_its_capacity() -> None:
    tree = _Tree(capacity_blocks=4)
    a = block_chain(np.arange(4 * BLOCK_TOKENS, dtype=np.int32))
    b = block_chain(np.arange(10_000, 10_000 + 2 * BLOCK_TOKENS, dtype=np.int32))
    tree.insert(a)
    assert tree.match(a) == 4
    tree.insert(b)
    assert len(tree.blocks) == 4 and tree.match(b) == 2
    assert tree.match(a) == 0  # its first blocks went first
    assert block_chain(np.arange(BLOCK_TOKENS - 1, dtype=np.int32)) == []
