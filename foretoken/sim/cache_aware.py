"""A cache-aware routing baseline that knows nothing of queues (``"cache-aware"``), as the
field's cache-aware routers do (SGLang's router and its descendants):

* the router keeps, per worker, an approximate tree of the prompts it sent there (here:
  the chain hashes of their ``BLOCK_TOKENS``-token blocks, least recently used first out
  beyond the worker's reported GPU capacity) — no KV events, no engine feedback;
* the load of a worker is the number of requests sent there and not finished;
* if the load is **imbalanced** — max − min > ``balance_abs_threshold`` *and*
  max > ``balance_rel_threshold`` × min — the request goes to the least-loaded worker;
* else, if the longest prefix match covers more than ``cache_threshold`` of the prompt,
  to the worker with the longest match; otherwise to the worker with the smallest tree
  (the most free cache).

Defaults are the routers' (``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5). Unlike a router that ignores KV capacity, it only
considers workers whose reported GPU blocks can hold the prompt (a request no worker can
hold is rejected), so it is compared on routing, not on errors. It never rejects
otherwise and makes no prediction.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from foretoken.core.types import WorkerId, WorkerProfile
from foretoken.sim.policy import (
    REASON_NO_WORKER,
    Arrival,
    Decision,
    FleetView,
    IgnoresFeedback,
    register_policy,
)
from foretoken.sim.prefix_cache import TokenIds

POLICY_NAME = "cache-aware"
BLOCK_TOKENS = 64
UNKNOWN_CAPACITY_BLOCKS = 1 << 20  # a worker that reports no GPU blocks
REASON_BALANCE = "cache_aware_least_loaded"
REASON_MATCH = "cache_aware_longest_match"
REASON_SPACE = "cache_aware_smallest_tree"
REASON_TOO_LARGE = "no_worker_holds_prompt"


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


def block_chain(token_ids: TokenIds | None) -> list[int]:
    """The chain hashes of the prompt's whole ``BLOCK_TOKENS`` blocks."""
    if token_ids is None:
        return []
    tokens = np.asarray(token_ids, dtype=np.int32)
    chain, out = 0, []
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        chain = hash((chain, tokens[start : start + BLOCK_TOKENS].tobytes()))
        out.append(chain)
    return out


class _Tree:
    """One worker's approximate cache: block chain hashes, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(capacity_blocks, 1)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, chain: list[int]) -> int:
        matched = 0
        for h in chain:
            if h not in self.blocks:
                break
            matched += 1
        return matched

    def insert(self, chain: list[int]) -> None:
        for h in chain:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def _capacity_blocks(worker: WorkerProfile) -> int:
    if worker.gpu_blocks is None:
        return UNKNOWN_CAPACITY_BLOCKS
    return worker.gpu_blocks * worker.block_size // BLOCK_TOKENS


class CacheAware(IgnoresFeedback):
    """The cache-aware baseline (module doc)."""

    name = POLICY_NAME

    def __init__(self, fleet: FleetView, seed: int = 0,
                 settings: CacheAwareSettings | None = None) -> None:  # fmt: skip
        self.settings = settings or CacheAwareSettings()
        self.trees = {w.worker_id: _Tree(_capacity_blocks(w)) for w in fleet.workers}

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        workers = fleet.workers_for(request.model)
        if not workers:
            return Decision.reject(REASON_NO_WORKER)
        able = [w for w in workers if w.fits_prompt(request.prompt_tokens)]
        if not able:
            return Decision.reject(REASON_TOO_LARGE)
        chain = block_chain(request.token_ids)
        worker, reason, matched = self._choose(able, fleet, chain, request.prompt_tokens)
        self.trees[worker].insert(chain)
        return Decision(worker, reason, cached_tokens=matched * BLOCK_TOKENS)

    def _choose(self, able: list[WorkerProfile], fleet: FleetView, chain: list[int],
                prompt_tokens: int) -> tuple[WorkerId, str, int]:  # fmt: skip
        s = self.settings
        loads = {w.worker_id: fleet.load(w.worker_id).outstanding_requests for w in able}
        low, high = min(loads.values()), max(loads.values())
        matches = {w.worker_id: self.trees[w.worker_id].match(chain) for w in able}
        if high - low > s.balance_abs_threshold and high > s.balance_rel_threshold * low:
            best = min(loads, key=lambda w: loads[w])  # first registered among ties
            return best, REASON_BALANCE, matches[best]
        longest = max(matches, key=lambda w: (matches[w], -loads[w]))
        if matches[longest] * BLOCK_TOKENS > s.cache_threshold * prompt_tokens:
            return longest, REASON_MATCH, matches[longest]
        roomiest = min(loads, key=lambda w: len(self.trees[w].blocks))
        return roomiest, REASON_SPACE, matches[roomiest]


register_policy(POLICY_NAME, CacheAware)
