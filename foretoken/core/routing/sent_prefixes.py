"""Prompts this service sent to a worker and the engine still holds (pure).

An engine caches a prompt's blocks when it schedules them (vLLM v1 registers a full block's
hash at allocation), but its KV events about them reach the index only after that step,
through ingest and Kafka. A request routed to a worker while an earlier one with the same
prefix is still waiting or prefilling there finds that prefix cached when its own turn
comes — FIFO admission schedules the earlier prompt's blocks first — yet the index does not
know them yet. Measured on the quick matrix's ``azure-code/hetero/1.0`` cell: 101 of 400
requests were credited less than the engine reused, every one of them behind such a
request on the same worker (``docs/BENCHMARKS.md``, "Prefixes in flight").

So the route service remembers the own-hash chain of every prompt it sent, per worker,
until the request completes (its running sequence holds those blocks until then: they cannot
be evicted), fails, or leaves the queue model; a candidate's credit is the longer of the
index's and the deepest chain it shares with a prompt still held there. Chains are
prefix-closed (the hash of block ``i`` commits to blocks ``0..i``), so the shared depth is
found by a binary search over the new prompt's chain: ~log2(blocks) probes per worker.

The counts live in the native crate (``foretoken_native.HeldChains``: a 32k-token prompt's
2,048 hashes added and taken out in ~40 µs) or, as the reference, in
:class:`_CountedChains` (a ``Counter``: ~600 µs for the same); both answer the same depths.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from foretoken.core.types import RequestId, WorkerId


class CountedChains(Protocol):
    """Per worker, how many held prompts carry each own block hash."""

    def add(self, worker_id: str, hashes: np.ndarray) -> None: ...

    def remove(self, worker_id: str, hashes: np.ndarray) -> None: ...

    def forget_worker(self, worker_id: str) -> None: ...

    def holds(self, worker_id: str) -> bool: ...

    def depths(
        self, chain: np.ndarray, max_blocks: int, worker_ids: Sequence[str]
    ) -> list[int]: ...


class _CountedChains:
    """The Python reference of ``foretoken_native.HeldChains``."""

    def __init__(self) -> None:
        self._held: dict[str, Counter[int]] = {}

    def add(self, worker_id: str, hashes: np.ndarray) -> None:
        if len(hashes):
            self._held.setdefault(worker_id, Counter()).update(hashes.tolist())

    def remove(self, worker_id: str, hashes: np.ndarray) -> None:
        held = self._held.get(worker_id)
        if held is None:
            return
        for h in hashes.tolist():
            left = held.get(h, 0) - 1
            if left > 0:
                held[h] = left
            else:
                held.pop(h, None)
        if not held:
            del self._held[worker_id]

    def forget_worker(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

    def holds(self, worker_id: str) -> bool:
        return worker_id in self._held

    def depths(self, chain: np.ndarray, max_blocks: int, worker_ids: Sequence[str]) -> list[int]:
        return [self._depth(self._held.get(w), chain, max_blocks) for w in worker_ids]

    @staticmethod
    def _depth(held: Counter[int] | None, chain: np.ndarray, max_blocks: int) -> int:
        top = min(len(chain), max_blocks)
        if held is None or top <= 0 or int(chain[0]) not in held:
            return 0
        low, high = 1, top  # chain[:low] is held; find the largest such low
        while low < high:
            mid = (low + high + 1) // 2
            if int(chain[mid - 1]) in held:
                low = mid
            else:
                high = mid - 1
        return low


def counted_chains(native: bool = True) -> CountedChains:
    if native:
        from foretoken.core.index.native import held_chains

        chains: CountedChains = held_chains()
        return chains
    return _CountedChains()


class SentPrefixes:
    """The prompts sent to each worker and still held there, by request id (module doc)."""

    __slots__ = ("_by_worker", "_chains", "_sent")

    def __init__(self, native: bool = True) -> None:
        self._sent: dict[RequestId, tuple[WorkerId, np.ndarray]] = {}
        # the same, per worker, in the order sent (held_at walks one worker's only)
        self._by_worker: dict[WorkerId, dict[RequestId, np.ndarray]] = {}
        self._chains = counted_chains(native)

    def __len__(self) -> int:
        return len(self._sent)

    def add(self, rid: RequestId, wid: WorkerId, chain: np.ndarray) -> None:
        """``rid``'s prompt (its own block hashes for ``wid``'s block size) was sent there
        (idempotent by request id)."""
        if rid in self._sent or not len(chain):
            return
        self._sent[rid] = (wid, chain)
        self._by_worker.setdefault(wid, {})[rid] = chain
        self._chains.add(wid, chain)

    def worker_of(self, rid: RequestId) -> WorkerId | None:
        sent = self._sent.get(rid)
        return None if sent is None else sent[0]

    def release(self, rid: RequestId) -> None:
        """``rid`` completed, failed or was forgotten: its worker no longer holds it for us."""
        sent = self._sent.pop(rid, None)
        if sent is not None:
            self._chains.remove(*sent)
            mine = self._by_worker.get(sent[0])
            if mine is not None:
                mine.pop(rid, None)
                if not mine:
                    del self._by_worker[sent[0]]

    def forget_worker(self, wid: WorkerId) -> None:
        self._chains.forget_worker(wid)
        for rid in self._by_worker.pop(wid, {}):
            del self._sent[rid]

    def held_at(self, wid: WorkerId) -> list[tuple[RequestId, np.ndarray]]:
        """The prompts held at ``wid`` (request id, own-hash chain), the last sent first."""
        return list(reversed(self._by_worker.get(wid, {}).items()))

    def depths(self, chain: np.ndarray, max_blocks: int,
               workers: Sequence[WorkerId]) -> dict[WorkerId, int]:  # fmt: skip
        """For each of ``workers`` holding anything, how many leading blocks of ``chain``
        (at most ``max_blocks``) a prompt it holds shares."""
        chains = self._chains
        holding = [w for w in workers if chains.holds(w)]
        if not holding or max_blocks <= 0:
            return {}
        return dict(zip(holding, chains.depths(chain, max_blocks, holding), strict=True))
