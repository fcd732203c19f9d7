"""Prompts sent after a request that prefill beside it (pure).

An engine that caps each prompt's chunk below its step budget (``long_prefill_token_threshold``
< ``max_num_batched_tokens``, :func:`~foretoken.core.routing.predict.shares_steps`) prefills
several prompts side by side, a chunk of each per step. The queue walk knows the prompts
already there; those sent while a request prefills also put their chunks into its steps,
and every such step is longer by their prefill. Measured on the live demo
(`make demo`, 338 graded): 11 of the 19 misses were long prompts on the chunk-capped
`demo-fast` workers underpredicted by 1.1–2.6 s with fits within 2% of the truth — e.g. a
102,869-token prompt predicted 8.45 s, took 9.87 s, while 39k tokens sent after it prefilled
within its window.

So each worker keeps its recent sends (time, uncached tokens). A request with ``L`` uncached
tokens and own prefill ``D`` meets later prompts at the worker's send rate ``λ``; each one
shares the steps until the shorter of the two is done, about ``min(u, L/2)`` of its tokens
against the half of ours left on average, at ``a`` seconds per token. Those steps lengthen
the window in which more arrive, so the delay is the fixed point ``D·ρ/(1 − ρ)`` with
``ρ = a·λ·m`` (capped at :data:`MAX_SHARE`), and never more than the other chunk slots of
every step could hold: ``a·L·(budget // cap − 1)``. ``m`` is the *median* over the recent
sends of ``min(u, L/2)``, not the mean: one rare giant among small prompts is not what a
request typically meets. A later prompt whose blocks do not fit in the engine's KV pool
beside the request's waits for it and shares nothing (measured on the demo's
`demo-offload`, a 33k-token pool: without that rule the delay doubled its predictions of
25k-token prompts, 3.9 s predicted against 2.5 s taken).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Final

from foretoken.core.types import SchedulerSettings, WorkerId

# Sends kept per worker (the rate and the size distribution are read from them).
KEEP: Final = 64
# Fewer sends than this in the window: no estimate (a cold worker, a quiet one).
MIN_SENDS: Final = 8
# The share of a step taken by prompts sent later, at most (a delay of at most 1x).
MAX_SHARE: Final = 0.5


class _Sends:
    """One worker's sends, ordered by time, and the sorted sizes of a window of them."""

    __slots__ = ("cache", "sizes", "times", "version")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.version = 0
        self.cache: tuple[int, int, int, list[int]] | None = None  # (version, lo, hi, sorted)

    def add(self, sent_s: float, uncached: int) -> None:
        at = bisect_right(self.times, sent_s)  # a late grant goes where its time is
        self.times.insert(at, sent_s)
        self.sizes.insert(at, uncached)
        if len(self.times) > KEEP:
            del self.times[0], self.sizes[0]
        self.version += 1

    def sorted_sizes(self, lo: int, hi: int) -> list[int]:
        cache = self.cache
        if cache is None or cache[:3] != (self.version, lo, hi):
            cache = self.cache = (self.version, lo, hi, sorted(self.sizes[lo:hi]))
        return cache[3]


def median_share(ordered: list[int], uncached: int, pool_tokens: int | None) -> float:
    """``median(min(u, L/2))`` over the sizes ``ordered`` (ascending), a size that does not
    fit in ``pool_tokens`` beside ``L = uncached`` counting 0 — as ``numpy.median`` computes
    it, in O(log n): the shares are the zeros of the sizes above ``pool − L``, then the
    others' ``min(u, L/2)`` in their order."""
    n = len(ordered)
    zeros = n - bisect_right(ordered, pool_tokens - uncached) if pool_tokens else 0
    half = uncached / 2

    def at(k: int) -> float:
        return 0.0 if k < zeros else min(ordered[k - zeros], half)

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


class RecentSends:
    """Per worker, the last :data:`KEEP` requests sent there: (send time, uncached tokens).
    A candidate's delay costs a few bisections (the window's sorted sizes are kept until a
    send or the window's edge changes them); numpy over the whole window each time had
    cost ~40 µs."""

    __slots__ = ("_sends",)

    def __init__(self) -> None:
        self._sends: dict[WorkerId, _Sends] = {}

    def sent(self, wid: WorkerId, sent_s: float, uncached: int) -> None:
        sends = self._sends.get(wid)
        if sends is None:
            sends = self._sends[wid] = _Sends()
        sends.add(sent_s, max(uncached, 0))

    def forget_worker(self, wid: WorkerId) -> None:
        self._sends.pop(wid, None)

    def delay_s(self, wid: WorkerId, now_s: float, window_s: float, settings: SchedulerSettings,
                a: float, uncached: int, own_s: float, pool_tokens: int | None = None,
                ) -> float:  # fmt: skip
        """Seconds the prompts sent after ``now_s`` add to the prefill of a request with
        ``uncached`` tokens and ``own_s`` of own prefill (module doc); 0 without enough
        sends in the last ``window_s`` or on an engine that does not share steps. With the
        engine's KV pool (``pool_tokens``), a later prompt that does not fit in it beside
        this one waits for it instead and shares nothing."""
        cap = settings.long_prefill_token_threshold
        budget = settings.max_num_batched_tokens
        if not (settings.chunked_prefill and 0 < cap < budget) or uncached <= 0 or a <= 0:
            return 0.0
        sends = self._sends.get(wid)
        if sends is None or len(sends.times) < MIN_SENDS:
            return 0.0
        times = sends.times
        lo, hi = bisect_left(times, now_s - window_s), bisect_right(times, now_s)
        count = hi - lo
        span_s = now_s - times[lo] if count else 0.0
        if count < MIN_SENDS or span_s <= 0:
            return 0.0
        shared = median_share(sends.sorted_sizes(lo, hi), uncached, pool_tokens)
        share = min(a * (count / span_s) * shared, MAX_SHARE)
        slots = max(budget // cap, 1)
        return min(own_s * share / (1.0 - share), a * uncached * (slots - 1))
