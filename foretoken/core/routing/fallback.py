"""Least outstanding tokens: the one load-balancing policy that knows nothing of caches or
prefill costs. The router decides with it when the route service is slow or down, and the
virtual-time replay runs it as a baseline (``least-outstanding-tokens``), so the baseline
measured is the router's fallback."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class Load:
    """What was sent to a worker and has not finished."""

    prompt_tokens: int = 0
    requests: int = 0


def least_outstanding(
    workers: Sequence[W],
    load_of: Callable[[W], Load],
    *,
    overload_tokens: int | None = None,
    can_serve: Callable[[W], bool] | None = None,
) -> W | None:
    """The worker with the fewest outstanding prompt tokens (ties: fewer outstanding
    requests, then the order given), among those that ``can_serve`` the request and are
    below ``overload_tokens``; None when there is none (the router answers 429)."""
    best: W | None = None
    best_key: tuple[int, int] | None = None
    for worker in workers:
        if can_serve is not None and not can_serve(worker):
            continue
        load = load_of(worker)
        if overload_tokens is not None and load.prompt_tokens >= overload_tokens:
            continue
        key = (load.prompt_tokens, load.requests)
        if best_key is None or key < best_key:
            best, best_key = worker, key
    return best
