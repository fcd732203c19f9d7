"""Decode samples without the prefill of others (PRODUCT.md §3 "Step cost").

A completed request's time per output token, ``(e2e − ttft) / (output − 1)``, is not a
decode step's cost alone: every step of its decode window that also carried another
prompt's chunk lasted that chunk longer. Under load with long prompts that prefill is most
of the window, and a step cost fitted on raw TPOT comes out several times too slow (every
replayed step with many running sequences then is too slow, and queue waits too long).

:class:`DecodeWindows` follows, per worker and from first tokens and completions only,
the number of requests decoding over time (its integral) and the prefill regressors
``u = Σ(N − K)``, ``v = Σ(N² − K²)`` of the prompts whose first token came. A request's
window, from its first token to its completion, then gives the prompts prefilled during it
(each counted where its first token is) and the time-mean number of decoding requests.
The sample is ``(span − a·Δu − b·Δv) / steps`` against that mean, with the worker's prefill
curve ``a, b``; it is held back while the curve is still the default, and dropped when the
prefill so subtracted leaves less than ``min_share`` of the raw TPOT (a window that was
almost all other prompts' prefill says nothing about a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from foretoken.core.types import RequestId, WorkerId

# Windows held per worker while its prefill curve is still the default.
MAX_HELD: Final = 256


@dataclass(slots=True)
class _Line:
    ts: float = 0.0
    decoding: float = 0.0
    integral: float = 0.0  # ∫ decoding dt
    u: float = 0.0
    v: float = 0.0

    def advance(self, ts: float) -> None:
        if ts > self.ts:
            self.integral += self.decoding * (ts - self.ts)
            self.ts = ts


@dataclass(frozen=True, slots=True)
class Window:
    """One request's decode window: its span and steps, and what happened during it."""

    span_s: float
    steps: int
    integral: float
    u: float
    v: float
    # Whether others waited for their prefill (in the queue model) when it opened.
    queued_at_open: bool = False

    @property
    def mean_decoding(self) -> float:
        """The time-mean number of requests decoding over the window (at least 1)."""
        return max(1.0, self.integral / self.span_s)

    def sample(self, a: float, b: float, min_share: float) -> tuple[float, float] | None:
        """(TPOT less the others' prefill, mean decoding requests), or None if dominated."""
        raw = self.span_s / self.steps
        corrected = (self.span_s - a * self.u - b * self.v) / self.steps
        if corrected < min_share * raw:
            return None
        return corrected, self.mean_decoding


@dataclass(slots=True)
class DecodeWindows:
    min_share: float = 0.1
    lines: dict[WorkerId, _Line] = field(default_factory=dict)
    marks: dict[RequestId, tuple[WorkerId, float, float, float, bool]] = field(default_factory=dict)
    held: dict[WorkerId, list[Window]] = field(default_factory=dict)

    def open(self, wid: WorkerId, rid: RequestId, ts: float, n: int, cached: int,
             queued: bool = False) -> None:  # fmt: skip
        """A first token at ``ts``: one more request decoding, its prefill done
        (``queued``: others still wait for theirs)."""
        if rid in self.marks:
            return
        line = self.lines.setdefault(wid, _Line(ts))
        line.advance(ts)
        k = min(max(cached, 0), n)
        line.u += n - k
        line.v += n * n - k * k
        line.decoding += 1.0
        self.marks[rid] = (wid, line.integral, line.u, line.v, queued)

    def close(
        self, rid: RequestId, ts: float, span_s: float | None, output_tokens: int
    ) -> Window | None:
        """Its completion at ``ts``: the window, or None (no first token seen, no decode)."""
        mark = self.marks.pop(rid, None)
        if mark is None:
            return None
        wid, integral, u, v, queued = mark
        line = self.lines[wid]
        line.advance(ts)
        line.decoding = max(line.decoding - 1.0, 0.0)
        steps = output_tokens - 1
        if span_s is None or not span_s > 0 or steps < 1:
            return None
        return Window(span_s, steps, line.integral - integral, line.u - u, line.v - v, queued)

    def forget(self, rid: RequestId) -> None:
        mark = self.marks.pop(rid, None)
        if mark is not None:
            line = self.lines[mark[0]]
            line.decoding = max(line.decoding - 1.0, 0.0)

    def hold(self, wid: WorkerId, window: Window) -> None:
        held = self.held.setdefault(wid, [])
        if len(held) < MAX_HELD:
            held.append(window)

    def release(self, wid: WorkerId) -> list[Window]:
        return self.held.pop(wid, [])
