"""The router's fallback policy, used when the route service is slow or down."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def least_outstanding(
    workers: Sequence[str], outstanding: Mapping[str, int], overload_tokens: int
) -> str | None:
    """The worker with the fewest prompt tokens sent and not yet answered (ties: the first
    listed); None when every worker is at or past ``overload_tokens`` (answer 429)."""
    best: str | None = None
    for worker in workers:
        load = outstanding.get(worker, 0)
        if load >= overload_tokens:
            continue
        if best is None or load < outstanding.get(best, 0):
            best = worker
    return best
