"""The busy-chain prefill curve (:class:`BusyChainFit`): the bootstrap of a worker that is
never idle, from the chains of :mod:`foretoken.core.cost.busy_chains`, used while its cold
fit (:class:`~foretoken.core.cost.fit.OnlinePrefillFit`) is still on its default.

Pure: numpy only. ``a`` is the decayed weighted median of each chain's
``(seconds − steps·step − b·v) / u``; ``b`` is the reference deployment's until the chains
known exactly (a prompt alone from a known start, a clean chain that ran until nothing sent
waited) span enough prompt sizes to determine it, when both come from the cold fit's
robust regression on those chains (:func:`~foretoken.core.cost.robust._fit_robust`).
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
import numpy.typing as npt

from foretoken.core.cost.fit import (
    REFERENCE_B_S_PER_TOKEN2,
    FitConfig,
    OnlinePrefillFit,
    PrefillCurve,
)
from foretoken.core.cost.robust import FloatArray, _fit_robust, _weighted_median

# The busy-chain fit learns b only from samples up to at least this many tokens, spread
# this much: below, the quadratic part is too small a share of a prompt's time to stand
# out from a step overhead's error (12 exact samples of 0.7k-1.4k tokens, their step
# overhead off, read as b = 1.4e-8: 380x the reference, 556 s too slow at 200k tokens).
JOINT_MIN_TOKENS: Final = 8192
JOINT_SPREAD: Final = 4.0


class BusyChainFit(OnlinePrefillFit):
    """The prefill curve from busy chains (:mod:`foretoken.core.cost.busy_chains`): each
    sample is the regressors ``u = Σ(N − K)``, ``v = Σ(N² − K²)`` of several prompts, the
    seconds the engine took over them and how many steps (with how many requests decoding)
    those held. ``a`` is the decayed weighted median of ``(seconds − steps·step − b·v) / u``:
    robust to the heavy two-sided noise of such samples, and needing no spread of N; ``b``
    is the reference deployment's until the exact samples determine it (:meth:`_joint`,
    then ``a`` and ``b`` come from them together). The steps are taken out with the step cost
    the curve is asked with (:meth:`curve_with`, the one the queue walk adds to it), so the
    first samples, taken while the step cost was still the default, are corrected once it
    is learned; a sample whose prefill is below ``busy_min_share`` of its time then does
    not answer."""

    def __init__(self, config: FitConfig, b: float = REFERENCE_B_S_PER_TOKEN2) -> None:
        super().__init__(config)
        self._b = b
        self._steps = np.zeros(self._robust.window)
        self._decoding = np.zeros(self._robust.window)
        self._exact = np.zeros(self._robust.window, dtype=bool)
        self._cache: tuple[tuple[float, float, int], PrefillCurve] | None = None

    def observe_uv(self, u: float, v: float, seconds: float, ts: float, steps: int = 0,
                   decoding: float = 0.0, exact: bool = False) -> bool:  # fmt: skip
        slot = self._pushed % len(self._x)
        self._steps[slot], self._decoding[slot] = steps, decoding
        self._exact[slot] = exact
        return u > 0 and v >= 0 and self._add(float(u), seconds, ts, float(v))

    @property
    def exact_samples(self) -> int:
        """Samples in the window known exactly (the ones ``b`` is learned from)."""
        return int(np.count_nonzero(self._exact[: self.samples]))

    def _ready(self) -> bool:
        return self.samples >= self.config.busy_min_samples

    def _refit(self) -> None:  # answered on demand (curve_with), from the window
        self._pending, self._value = 0, None

    @property
    def value(self) -> PrefillCurve:
        return self.curve_with(0.0, 0.0)

    def curve_with(self, overhead_s: float, per_seq_s: float) -> PrefillCurve:
        """The curve with steps of ``overhead_s + per_seq_s × decoding`` taken out."""
        key = (overhead_s, per_seq_s, self._pushed)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        n, cfg = self.samples, self._robust
        u, v, y = self._x[:n], self._c[:n], self._y[:n]
        prefill = y - self._steps[:n] * (overhead_s + per_seq_s * self._decoding[:n])
        keep = (prefill > 0) & (prefill >= self.config.busy_min_share * y)
        kept = int(np.count_nonzero(keep))
        if (n == 0 or kept < self.config.busy_min_samples
                or float(u[keep].sum()) < self.config.busy_min_tokens):  # fmt: skip
            curve = PrefillCurve(*self._default, kept, 0, True)
        else:
            seq = self._seq[:n][keep]
            log2_weight = np.zeros(kept)
            if cfg.half_life_samples is not None:
                log2_weight -= (seq.max() - seq) / cfg.half_life_samples
            decay = np.exp2(log2_weight)
            exact = self._exact[:n][keep]
            joint = self._joint(u[keep][exact], v[keep][exact], prefill[keep][exact],
                                decay[exact])  # fmt: skip
            if joint is not None:
                a, b = joint
            else:
                ratio = (prefill[keep] - self._b * v[keep]) / u[keep]
                a, b = _weighted_median(ratio, decay * self._precision(keep)), self._b
            if a > 0:
                self._version += 1
                curve = PrefillCurve(a, b, kept, self._version, False)
            else:  # the steps took it all at this step cost: no answer, not a free prefill
                curve = PrefillCurve(*self._default, kept, 0, True)
        self._cache = (key, curve)
        return curve

    def _precision(self, keep: npt.NDArray[np.bool_]) -> FloatArray:
        """Each kept sample's weight in the median: the square root of its prompt tokens per
        step. A chain's ratio errs by what its steps were mis-costed (the step overhead and
        decode costs taken out) spread over its tokens, so a one-step prompt of a few hundred
        tokens is mostly step-cost error: on a worker never idle (held-out `azure-conv` on
        `random-4`) three such prompts read a = 3.1e-5-1.0e-4 s/token and, counted like the
        54k-token chain over 7 steps that read the true 1.7e-5, set the median. Not the
        tokens per step themselves: long chains carry their own error (time the queue
        model did not see), and the root keeps several of them needed to outvote the rest
        (docs/BENCHMARKS.md, "Busy chains weighted by tokens per step")."""
        n = self.samples
        return np.sqrt(self._x[:n][keep] / np.maximum(self._steps[:n][keep], 1.0))

    def _joint(self, u: FloatArray, v: FloatArray, prefill: FloatArray,
               decay: FloatArray) -> tuple[float, float] | None:  # fmt: skip
        """``(a, b)`` fitted together on the chains (the cold fit's robust regression of
        prefill on u and v), once enough of them span enough prompt sizes; else None."""
        need = self.config.busy_joint_min_samples
        if need <= 0 or len(u) < need:
            return None
        size = v / u
        low, high = float(size.min()), float(size.max())
        if high < JOINT_MIN_TOKENS or high < JOINT_SPREAD * low:
            return None
        solution = _fit_robust(u, v, prefill, decay, self._robust)
        if solution is None or not solution.theta0 > 0 or solution.cov is None:
            return None
        # b only where the chains determine it: twice its standard error at least
        if not solution.theta1 > 2.0 * math.sqrt(max(solution.cov[2], 0.0)):
            return None
        return solution.theta0, solution.theta1
