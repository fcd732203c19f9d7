"""How long a decoding answer has left, when its length is a distribution, not a number.

A request sent with a cap (``max_tokens``) is queued with the mean length its model's
answers took under such caps (``core/routing/outputs.py``). The mean is right at the
start; once the answer runs, what it has left is not the mean minus what it produced:
answers that are still running are the long ones. With a fixed estimate, every replay of
the future retires the answers that outlived it at the next step, and frees their seats
and KV blocks far too early.

The route service hands each such request an :class:`OutputTail` (the learned lengths,
scaled to its cap). A replay gives each decoder that carries one the length left by the
answers that ran at least as long as it has — at a quantile spread over those decoders,
``(k + ½) / m`` for the k-th of m in admission order, not at their mean: a new prompt
waiting for a seat waits for the *first* of them to end, and m decoders each at the mean
would all end together, long after the first really does. Spread this way their ends
follow the learned distribution (on the quick matrices with clients' caps, the mean gave
fewer cells at the best baseline's accuracy than no tail at all; the spread quantiles
more). Requests without a tail (exact caps, or nothing learned yet) keep their fixed
estimate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from foretoken.core.queue.scheduler import _Seq


class OutputTail(Protocol):
    def left(self, produced: int, u: float) -> int:
        """Output tokens left after the first ``produced`` ones (at least 1) at quantile
        ``u`` of the answers that ran at least that long."""
        ...


def tail_done(decoders: Sequence[_Seq], done: list[int], base: int) -> list[int]:
    """``done`` (each decoder's last step) with the decoders that carry a tail given their
    residual length at step ``base`` (module doc): a decoder whose estimate ends at
    ``done[i]`` has produced ``expected − (done[i] − base)`` tokens (its first one at its
    prefill). ``done`` itself is not changed."""
    tailed = [(i, seq.expected, seq.tail) for i, seq in enumerate(decoders)
              if seq.tail is not None]  # fmt: skip
    if not tailed:
        return done
    out = done.copy()
    m = len(tailed)
    for k, (i, expected, tail) in enumerate(tailed):  # the route path's hottest loop: flat
        produced = expected - done[i] + base
        left = tail.left(produced if produced > 1 else 1, (k + 0.5) / m)
        out[i] = base + (left if left > 1 else 1)
    return out
