"""A worker's queue-wait scale, learned from its first tokens.

The queue walk prices the work ahead of a request with the learned costs, and what it cannot
see it leaves out. Under load the predicted wait falls short of the real one, more the deeper
the queue, on every fleet. Decomposed against the simulator's step log
(``foretoken bench predict --explain``; ``shared-system/random-1/1.3``, quick matrix, 400
requests): mean error −0.03 s at a predicted wait under 0.25 s, −0.33 s at 0.25–0.5 s,
−0.58 s at 0.5–1 s, −0.61 s at 1–2 s. The missing parts are the prefill chunks of
requests that arrive later and share the steps (10–15% of the prefill ahead), the decode
cost that grows with each sequence's context (the step fit has no context term; at a
saturated running count it cannot split overhead and per-sequence cost), and noise and
stalls.

So each worker keeps a scale ``k ≥ 1`` for the queue-wait part of its predictions: the
median over its last ``window`` first tokens of ``log(actual wait / raw predicted wait)``
(actual wait = TTFT − the predicted own prefill, for requests this service decided with a
raw predicted wait of at least ``min_wait_s``), shrunk toward 0 as if ``prior`` samples of
0 stood beside them, then ``exp`` and clamped to ``[1, max_scale]``. It only lengthens:
a scale below 1 (tried: ``[0.5, 4]`` and ``[0.8, 1.6]``) made underpredictions of more than
5 s 1.8–2.5× as many, and the quick matrix lost 0.4–3.9 points (docs/BENCHMARKS.md).

What the factor adds is at most the largest shortfall (actual − raw predicted wait) of
those same first tokens: a ratio learned from shallow waits is not carried to deep ones
beyond what was seen. A burst's first requests fall short by the prompts that arrive
just after them and share their step — a fraction of one step, the same at any depth — and
taken as a ratio it made every deep wait behind the burst too long
(``azure-code/random-14/1.3``, exact caps, seed 5: a factor of ~1.2 learned from waits of
0.3-0.5 s that came out ~0.35 s longer added ~0.7 s to waits of 3 s, which came out right;
within 1 s 97.3% → 100%).

Only this service's own decisions teach it (the raw wait is known only here): a read
replica of another router's decisions keeps ``k = 1``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from foretoken.core.types import RequestId, WorkerId


@dataclass(frozen=True, slots=True)
class WaitScaleConfig:
    window: int = 32
    prior: float = 16.0
    min_wait_s: float = 0.3
    max_scale: float = 2.0
    memory: int = 100_000

    def __post_init__(self) -> None:
        if self.window < 1 or self.prior < 0 or self.min_wait_s <= 0 or self.max_scale < 1:
            raise ValueError("window >= 1, prior >= 0, min_wait_s > 0, max_scale >= 1 required")


class WaitScale:
    """Per worker, the factor on the queue-wait part of its predictions (module doc)."""

    def __init__(self, config: WaitScaleConfig = WaitScaleConfig()) -> None:
        self.config = config
        self._logs: dict[WorkerId, deque[float]] = {}
        self._factor: dict[WorkerId, float] = {}
        self._shortfalls: dict[WorkerId, deque[float]] = {}
        # the largest of each window's shortfalls, kept: every candidate prediction asks
        self._most: dict[WorkerId, float] = {}
        # decided here, first token not seen yet: (worker, raw predicted wait, own prefill)
        self._pending: OrderedDict[RequestId, tuple[WorkerId, float, float]] = OrderedDict()

    def factor(self, wid: WorkerId) -> float:
        return self._factor.get(wid, 1.0)

    def scaled(self, wid: WorkerId, raw_wait_s: float) -> float:
        """``raw_wait_s`` lengthened by the factor, by at most the largest shortfall seen."""
        k = self._factor.get(wid, 1.0)
        return raw_wait_s + min((k - 1.0) * raw_wait_s, self._most.get(wid, 0.0))

    def raw(self, wid: WorkerId, scaled_s: float) -> float:
        """The raw wait that :meth:`scaled` lengthens to ``scaled_s``."""
        k = self._factor.get(wid, 1.0)
        most = self._most.get(wid, 0.0)
        if k <= 1.0 or scaled_s <= k * most / (k - 1.0):
            return scaled_s / k
        return scaled_s - most

    def decided(self, rid: RequestId, wid: WorkerId, raw_wait_s: float, own_s: float) -> None:
        """This service sent ``rid`` to ``wid`` predicting ``raw_wait_s`` (before the scale)
        of queue wait on top of ``own_s`` of its own prefill."""
        if not raw_wait_s >= self.config.min_wait_s:
            return
        self._pending[rid] = (wid, raw_wait_s, own_s)
        if len(self._pending) > self.config.memory:
            self._pending.popitem(last=False)

    def first_token(self, rid: RequestId, wid: WorkerId, actual_s: float) -> None:
        known = self._pending.pop(rid, None)
        if known is None or known[0] != wid or not math.isfinite(actual_s):
            return
        _, raw, own = known
        ratio = max(actual_s - own, 0.05 * raw) / raw
        cfg = self.config
        logs = self._logs.setdefault(wid, deque(maxlen=cfg.window))
        logs.append(math.log(ratio))
        shortfalls = self._shortfalls.setdefault(wid, deque(maxlen=cfg.window))
        shortfalls.append(max(actual_s - own - raw, 0.0))
        self._most[wid] = max(shortfalls)
        m = len(logs)
        k = math.exp(float(np.median(logs)) * m / (m + cfg.prior))
        self._factor[wid] = min(max(k, 1.0), cfg.max_scale)

    def forget(self, rid: RequestId) -> None:
        self._pending.pop(rid, None)

    def forget_worker(self, wid: WorkerId) -> None:
        self._logs.pop(wid, None)
        self._factor.pop(wid, None)
        self._shortfalls.pop(wid, None)
        self._most.pop(wid, None)
