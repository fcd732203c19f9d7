"""Seconds per token to bring a cached block back from a lower tier (CPU, disk, a shared
cache), per worker and tier: the configured cost (``predictor.tier_load_s_per_token``) as a
prior, moved by the worker's own samples.

A sample is a request this service sent with credit from exactly one lower tier that ran
alone and whose engine said how much it reused (at least the credit): its TTFT less its own
prefill ``C(N) − C(K)`` and its steps' overheads, per lower-tier token
(:meth:`foretoken.core.routing.learn.Learner.on_graded`). The estimate is the median of the
worker's last ``window`` samples, pooled with the prior as if ``prior_weight`` samples of
the prior stood beside them: a few noisy samples move it a little, a steady stream takes
over.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

import numpy as np

from foretoken.core.types import WorkerId


class TierCosts:
    def __init__(self, prior: Mapping[str, float], *, prior_weight: float = 4.0,
                 window: int = 64) -> None:  # fmt: skip
        if prior_weight <= 0 or window < 1:
            raise ValueError("prior_weight > 0 and window >= 1 required")
        self.prior = dict(prior)
        self.prior_weight, self.window = prior_weight, window
        self._samples: dict[tuple[WorkerId, str], deque[float]] = {}
        self._cost: dict[tuple[WorkerId, str], float] = {}

    def cost(self, wid: WorkerId, tier: str) -> float:
        """Seconds per token of ``tier`` on ``wid`` (the prior until it has samples)."""
        return self._cost.get((wid, tier), self.prior.get(tier, 0.0))

    def samples(self, wid: WorkerId, tier: str) -> int:
        return len(self._samples.get((wid, tier), ()))

    def observe(self, wid: WorkerId, tier: str, s_per_token: float) -> bool:
        """One sample; False (ignored) when it is not finite or the tier has no prior."""
        if tier not in self.prior or not math.isfinite(s_per_token):
            return False
        key = (wid, tier)
        kept = self._samples.setdefault(key, deque(maxlen=self.window))
        kept.append(max(s_per_token, 0.0))
        m, w = len(kept), self.prior_weight
        self._cost[key] = (w * self.prior[tier] + m * float(np.median(kept))) / (w + m)
        return True

    def forget_worker(self, wid: WorkerId) -> None:
        for key in [k for k in self._samples if k[0] == wid]:
            self._samples.pop(key, None)
            self._cost.pop(key, None)

    def describe(self, wid: WorkerId) -> dict[str, dict[str, float | int]]:
        """Per lower tier: the cost in use and how many samples moved it."""
        return {t: {"s_per_token": self.cost(wid, t), "samples": self.samples(wid, t)}
                for t in self.prior}  # fmt: skip
