"""Each worker's online cost models (PRODUCT.md §1, §3 "Prefill cost model and queue replay").

Pure: numpy and msgspec only. Three models, one robust core:

* :class:`OnlinePrefillFit` learns the cold prefill curve ``C(N) = a·N + b·N²`` (seconds, N
  prompt tokens) from requests that had nothing cached and nothing else running.
* :class:`StepCostFit` learns what a queue replay needs beyond that curve: the per-step
  overhead and the decode cost per running sequence, ``TPOT = overhead + per_seq·running``.
* :class:`FitRegistry` keeps one of each per ``(worker_id, config_hash)``.

**The core** (:func:`foretoken.core.cost.robust._fit_robust`) fits ``y ≈ θ0·x0 + θ1·x1``
with ``θ ≥ 0`` on a bounded window of samples by iteratively reweighted least squares on
*relative* residuals ``y/ŷ − 1`` (engine noise is multiplicative, so an 8k-token prompt and
a 512k one count alike). It starts from least squares relative to the observations (a stall
10× too slow adds at most ~1 to that objective), runs Huber iterations with a weighted-MAD
scale, then Tukey biweight iterations with the scale frozen, which give stalls and other
gross outliers weight zero. Each step solves the 2×2 non-negative least squares problem
exactly. Samples are weighted by exponential decay in sample count (optionally also in
time), so the fit follows drift: once recent samples carry most of the weight, the robust
fit switches to them. The uncertainty is the sandwich covariance of the final weighted fit.

Our own IRLS, not statsmodels ``RLM``: RLM has neither non-negativity nor per-sample
(decay) weights, and measured 4–18× slower per refit of 256 samples. Refits run every
``refit_every`` samples (the first at once), never on a lookup, which reads a cached value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import msgspec
import numpy as np

from foretoken.core.checks import check_settings_numbers
from foretoken.core.cost.robust import (
    Covariance,
    FloatArray,
    RobustFitConfig,
    _fit_robust,
    _Solution,
)
from foretoken.core.types import FitUsed

# The reference deployment (PRODUCT.md §1): 30·N + 37·N² s with N in millions of tokens.
REFERENCE_A_S_PER_TOKEN: Final = 3.0e-5
REFERENCE_B_S_PER_TOKEN2: Final = 3.7e-11
# The default curve, used until a worker has enough cold samples (and the group prior
# none). Its error on a worker's first requests is |default − truth|·N, and within 1 s
# counts that error, so the default sits in the middle of the curves we know — the
# linear terms of the reference deployment and the simulator fleets span 1.2e-5 to
# 1.2e-4 s/token, the quadratic ones 2e-12 to 2e-9 — rather than at their envelope
# (1.5e-4 and 2.5e-9 before 2026-12-06: 5-10x the typical truth, so every first request
# of a cold fleet missed 1 s; on three quick matrices, 189 cells of which 126 on fleets
# and seeds never tuned on, cells at least as good as the best baseline within 1 s went
# from 147 to 183 and within 10 s from 185 to 187: docs/BENCHMARKS.md "A default in the
# middle"). It still over-predicts the reference deployment; a deployment that knows its
# hardware sets its own (FitConfig.default_a, default_b), and admission of cold
# predictions can ask for the p90 (PredictorConfig.admission_quantile).
DEFAULT_A_S_PER_TOKEN: Final = 6e-5
DEFAULT_B_S_PER_TOKEN2: Final = 5e-10
# The step costs' default: the overhead at the envelope of known engines (simulator fleets
# ≤ 15 ms; vLLM on one GPU 5-15 ms), the per-sequence cost in the middle of their range
# (0.05-0.3 ms, plus a context-length term a fit absorbs), not at its top. On short or
# bursty runs every prediction is made before the first completion brings a decode sample,
# and a per-sequence default several times too slow makes every replayed step with many
# decoders too slow (5e-4 here before 2026-12-02: measured in docs/BENCHMARKS.md).
DEFAULT_STEP_OVERHEAD_S: Final = 0.015
DEFAULT_DECODE_S_PER_SEQ: Final = 1.2e-4
# Below this many prompt tokens fixed per-request latency (HTTP, one scheduler step)
# dominates TTFT, and a·N + b·N² (no constant term) does not describe it.
MIN_COLD_PROMPT_TOKENS: Final = 128
# A TPOT from fewer output tokens is mostly one step's jitter.
MIN_DECODE_OUTPUT_TOKENS: Final = 4
SNAPSHOT_VERSION: Final = 1
# A cold sample keeps at least this share of its seconds when its steps' overheads are
# taken off (more would say the step cost, not the prompt, is wrong).
COLD_OVERHEAD_FLOOR: Final = 0.5
# The cold curve is refitted for a step overhead that moved by more than this fraction.
OVERHEAD_REFIT_TOLERANCE: Final = 0.02


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class FitConfig:
    """Everything the fits use; one value for a whole :class:`FitRegistry`."""

    prefill: RobustFitConfig = field(default_factory=RobustFitConfig)
    # Decode samples come with every completed request, cold samples rarely: refit less often.
    step: RobustFitConfig = field(default_factory=lambda: RobustFitConfig(refit_every=16))
    min_spread: float = 2.0  # a prefill fit needs max N >= min_spread × min N
    min_running_span: float = 1.0  # a step fit needs max − min mean running >= this
    default_a: float = DEFAULT_A_S_PER_TOKEN
    default_b: float = DEFAULT_B_S_PER_TOKEN2
    default_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    default_per_seq_s: float = DEFAULT_DECODE_S_PER_SEQ
    max_configs_per_worker: int = 4  # a worker's oldest configurations' fits are dropped
    # A worker still on a default curve or step cost predicts with the median of its fitted
    # peers' (same configuration, else same engine and version, else same model).
    pooled_priors: bool = True
    # A worker with samples but no fit yet predicts with its prior (pooled, else default)
    # scaled to them (OnlinePrefillFit.scaled), within 1/prior_scale_max..prior_scale_max.
    scale_prior_to_samples: bool = True
    prior_scale_max: float = 16.0
    # A busy-chain fit (``a`` alone, ``b`` fixed) answers from this many samples. One: a
    # measured prompt, even a noisy chain, is nearer the truth than the default envelope
    # (3-8x the simulator fleets' ``a``), and a burst can arrive before a third sample does
    # (azure-code: every burst prediction on the default, within 1 s 12%).
    busy_min_samples: int = 1
    # A busy-chain sample answers only while its prefill — its time less its steps'
    # overhead and decode at the current step cost — is at least this share of it (one the
    # step cost dominates reads that cost's error as prefill). Off by default: the test
    # is on the sample's own noisy time, so it keeps the slow ones — at 0.5, a came out
    # 1.4-1.6x the truth on poisson-long/random-1/1.3 (cap 1024: many steps per chain)
    # and the matrix's random-1 cells lost 8.6 points within 1 s (mean 73.3% vs 81.9%).
    busy_min_share: float = 0.0
    # The busy-chain fit answers once its kept samples hold this many new tokens. A chain
    # of one short prompt is one step whose time is nearly all overhead: taken out at the
    # step cost, what is left over its few tokens is noise (34 tokens in a 12 ms step gave
    # a = 4.9e-6 against a true 3.3e-5, and the worker underpredicted a burst by 2-3 s).
    # 512 tokens prefill in about one step overhead on a fast engine (1e-5 s/token, 5 ms).
    busy_min_tokens: float = 512.0
    # From this many kept *exact* busy-chain samples (a prompt alone from a known start, a
    # clean chain that ran until nothing waited) whose effective prompt sizes (v / u) span
    # min_spread, the busy-chain fit learns b with a (the cold fit's robust regression on
    # their u and v), where they determine b (b > 2 standard errors); else b stays fixed.
    # Busy chains are left out: on a small capped engine their long prompts' chains carry
    # others' chunks (1.1-2.1x the truth above 20k tokens), which read as a large b. 0: never.
    busy_joint_min_samples: int = 8

    def __post_init__(self) -> None:
        check_settings_numbers(self)
        if self.min_spread < 1 or not self.min_running_span > 0:
            raise ValueError("min_spread >= 1 and min_running_span > 0 required")
        if self.max_configs_per_worker < 1:
            raise ValueError("max_configs_per_worker must be >= 1")


# --------------------------------------------------------------------------- values


def _stderr(cov: Covariance | None, index: int) -> float | None:
    return None if cov is None else math.sqrt(max(cov[2 * index], 0.0))


@dataclass(frozen=True, slots=True)
class PrefillCurve:
    """``C(N) = a·N + b·N²`` seconds. ``cov`` = (var a, cov ab, var b); None for a default.
    ``samples``: what the fit was made from (for a default: collected so far)."""

    a: float
    b: float
    samples: int
    version: int
    default: bool
    cov: Covariance | None = None

    @property
    def stderr_a(self) -> float | None:
        return _stderr(self.cov, 0)

    @property
    def stderr_b(self) -> float | None:
        return _stderr(self.cov, 1)

    def cost_s(self, n_tokens: float) -> float:
        """Cold prefill seconds of ``n_tokens`` prompt tokens."""
        return n_tokens * (self.a + self.b * n_tokens)

    def own_prefill_s(self, total_tokens: int, cached_tokens: int) -> float:
        """``C(total) − C(cached)`` (new tokens still attend to the cached context), written
        as ``(total − cached)·(a + b·(total + cached))``; cached is clamped to [0, total]."""
        cached = 0 if cached_tokens < 0 else min(cached_tokens, total_tokens)
        return (total_tokens - cached) * (self.a + self.b * (total_tokens + cached))

    def cost_stderr_s(self, n_tokens: float) -> float | None:
        """Standard error of ``cost_s(n_tokens)`` from the covariance (None for a default)."""
        if self.cov is None:
            return None
        var_a, cov_ab, var_b = self.cov
        n = float(n_tokens)
        return math.sqrt(max(n * n * (var_a + 2 * n * cov_ab + n * n * var_b), 0.0))

    def to_fit_used(self) -> FitUsed:
        return FitUsed(
            a=self.a, b=self.b, samples=self.samples, version=self.version, default=self.default
        )


@dataclass(frozen=True, slots=True)
class StepCost:
    """A decode step lasts ``overhead_s + per_seq_s × running``; fields as for the curve."""

    overhead_s: float
    per_seq_s: float
    samples: int
    version: int
    default: bool
    cov: Covariance | None = None

    @property
    def stderr_overhead_s(self) -> float | None:
        return _stderr(self.cov, 0)

    @property
    def stderr_per_seq_s(self) -> float | None:
        return _stderr(self.cov, 1)

    def decode_step_s(self, running: float) -> float:
        return self.overhead_s + self.per_seq_s * running


# --------------------------------------------------------------------------- online fits


class FitState(msgspec.Struct, array_like=True, frozen=True):
    """One online fit's snapshot: its window oldest first as (x, y, ts), its counters and
    its current solution (restored as is: a restored fit answers exactly as before)."""

    samples: list[tuple[float, ...]]  # (x, y, ts, cached[, steps]); steps 0 if absent
    observed: int
    version: int
    pending: int
    solution: _Solution | None
    overhead_off_s: float = 0.0  # the step overhead the solution took off (prefill fits)


def _positive_finite(*values: float) -> bool:
    return all(math.isfinite(v) and v > 0 for v in values)


V = TypeVar("V", PrefillCurve, StepCost)


class _OnlineFit(Generic[V]):
    """A ring buffer of (x, y, ts) samples, the refit cadence and the cached value (a
    default until ``_ready``). Subclasses say what x is (columns, spread)."""

    _value_type: type[V]

    def __init__(self, robust: RobustFitConfig, default: tuple[float, float]) -> None:
        self._robust, self._default = robust, default
        self._x, self._y = np.zeros(robust.window), np.zeros(robust.window)
        self._ts, self._seq = np.zeros(robust.window), np.zeros(robust.window)
        self._c = np.zeros(robust.window)  # cached part of x (prefill samples with a hit)
        # the steps a cold sample's prefill took; their overheads, at ``_off_s`` each, are
        # taken off its seconds in the fit (OnlinePrefillFit.with_overhead)
        self._cold_steps, self._off_s = np.zeros(robust.window), 0.0
        self.samples = 0  # in the window
        self.observed = 0  # accepted since this fit started
        self._pushed = 0  # the sequence number of the next sample (ages count in these)
        self._version = self._pending = 0
        self._solution: _Solution | None = None
        self._value: V | None = None

    @property
    def value(self) -> V:
        if self._value is None:
            sol, make = self._solution, self._value_type
            self._value = (
                make(*self._default, self.samples, 0, True)
                if sol is None
                else make(sol.theta0, sol.theta1, sol.samples, self._version, False, sol.cov)
            )
        return self._value

    def refit(self) -> V:
        """Refit now (normally automatic every ``refit_every`` samples)."""
        self._refit()
        return self.value

    def _add(self, x: float, y: float, ts: float, c: float = 0.0, steps: float = 0.0) -> bool:
        if not (_positive_finite(y) and math.isfinite(x) and math.isfinite(ts)):
            return False
        self._push(x, y, ts, c, steps)
        self.observed += 1
        self._pending += 1
        self._value = None
        due = self._solution is None or self._pending >= self._robust.refit_every
        if due and self._ready():
            self._refit()
        return True

    def _push(self, x: float, y: float, ts: float, c: float = 0.0, steps: float = 0.0) -> None:
        slot = self._pushed % len(self._x)
        self._x[slot], self._y[slot], self._ts[slot], self._seq[slot] = x, y, ts, self._pushed
        self._c[slot], self._cold_steps[slot] = c, steps
        self._pushed += 1
        self.samples = min(self.samples + 1, len(self._x))

    def _refit(self) -> None:
        self._pending, self._value = 0, None
        if not self._ready():  # too few samples or too little spread: keep what we have
            return
        n, cfg = self.samples, self._robust
        seq, ts = self._seq[:n], self._ts[:n]
        log2_weight = np.zeros(n)
        if cfg.half_life_samples is not None:
            log2_weight -= (seq.max() - seq) / cfg.half_life_samples
        if cfg.half_life_s is not None:
            log2_weight -= (ts.max() - ts) / cfg.half_life_s
        x0, x1 = self._columns(self._x[:n], self._c[:n])
        y = self._y[:n]
        if self._off_s > 0:  # a step overhead taken off, unless it would take most of it
            bare = y - self._cold_steps[:n] * self._off_s
            y = np.where(bare > COLD_OVERHEAD_FLOOR * y, bare, y)
        solution = _fit_robust(x0, x1, y, np.exp2(log2_weight), cfg)
        if solution is not None:
            self._solution = solution
            self._version += 1

    def _ready(self) -> bool:
        if self.samples < self._robust.min_samples:
            return False
        x = self._x[: self.samples]
        return self._spread_ok(float(x.min()), float(x.max()))

    def _spread_ok(self, lowest: float, highest: float) -> bool:
        raise NotImplementedError

    def _columns(self, x: FloatArray, c: FloatArray) -> tuple[FloatArray, FloatArray]:
        raise NotImplementedError

    def state(self) -> FitState:
        order = np.argsort(self._seq[: self.samples], kind="stable")
        rows: list[tuple[float, ...]] = [
            (float(self._x[i]), float(self._y[i]), float(self._ts[i]), float(self._c[i]),
             float(self._cold_steps[i]))
            for i in order
        ]  # fmt: skip
        return FitState(rows, self.observed, self._version, self._pending, self._solution,
                        self._off_s)  # fmt: skip

    def load_state(self, state: FitState) -> None:
        """Take a snapshot's samples, counters and solution into this (fresh) fit."""
        rows = state.samples[-len(self._x) :]
        for x, y, ts, c, *steps in rows:
            self._push(x, y, ts, c, steps[0] if steps else 0.0)
        self.observed = max(state.observed, len(rows))
        self._version, self._pending = state.version, state.pending
        self._solution, self._value = state.solution, None
        self._off_s = state.overhead_off_s


class OnlinePrefillFit(_OnlineFit[PrefillCurve]):
    """The cold prefill curve ``C(N) = a·N + b·N²`` of one worker configuration.

    Feed it COLD requests only (:func:`select_cold_sample`): nothing cached and nothing
    else running, so TTFT ≈ prefill. Until ``min_samples`` samples span ``min_spread`` in
    N (one prompt size cannot tell a from b), :attr:`curve` is the conservative default
    (``default=True``, see ``DEFAULT_A_S_PER_TOKEN``); then the robust fit of the module
    doc. TTFT also holds the engine's step overheads (about one per
    ``max_num_batched_tokens`` tokens): a sample given with the steps its prefill took has
    them taken off at the overhead the curve is asked with (:meth:`with_overhead`, the one
    the queue walk adds on top), so samples taken before the step cost was learned are
    corrected once it is; ``a`` absorbs the rest.
    """

    _value_type = PrefillCurve

    def __init__(self, config: FitConfig = FitConfig()) -> None:
        super().__init__(config.prefill, (config.default_a, config.default_b))
        self.config = config

    def observe(self, n_tokens: int, seconds: float, ts: float, cached_tokens: int = 0,
                steps: int = 0) -> bool:  # fmt: skip
        """Add one prefill sample: a prompt of ``n_tokens`` of which the engine reused
        ``cached_tokens``, alone on the worker, so seconds ≈ C(N) − C(cached) (new tokens
        attend to the cached context: the regressors are N − c and N² − c², which is the
        cold case when c = 0) plus ``steps`` steps' overheads. False (ignored) unless the
        uncached part and seconds are > 0."""
        fresh = n_tokens - cached_tokens
        if fresh <= 0 or cached_tokens < 0:
            return False
        return self._add(float(n_tokens), seconds, ts, float(cached_tokens), float(max(steps, 0)))

    def with_overhead(self, overhead_s: float) -> PrefillCurve:
        """The curve with ``overhead_s`` per step taken off the samples (refitted when it
        moved by more than ``OVERHEAD_REFIT_TOLERANCE`` since the last fit)."""
        off = self._off_s
        if overhead_s >= 0 and abs(overhead_s - off) > OVERHEAD_REFIT_TOLERANCE * max(
            overhead_s, off
        ):
            self._off_s = overhead_s
            if self._solution is not None and bool(np.any(self._cold_steps[: self.samples] > 0)):
                self._refit()
        return self.value

    @property
    def curve(self) -> PrefillCurve:
        return self.value

    def scaled(self, a: float, b: float) -> tuple[float, float] | None:
        """A prior curve ``(a, b)`` (a peer group's or the default) scaled to this fit's own
        samples, for the time before it has a fit: times the median ratio of each sample's
        seconds (its steps' overheads off, as in the fit) to the prior's, clamped to
        ``[1/prior_scale_max, prior_scale_max]``. None without samples."""
        n = self.samples
        if n == 0:
            return None
        x0, x1 = self._columns(self._x[:n], self._c[:n])
        predicted = a * x0 + b * x1
        if not float(predicted.min()) > 0:
            return None
        y = self._y[:n]
        if self._off_s > 0:
            bare = y - self._cold_steps[:n] * self._off_s
            y = np.where(bare > COLD_OVERHEAD_FLOOR * y, bare, y)
        top = self.config.prior_scale_max
        k = min(max(float(np.median(y / predicted)), 1.0 / top), top)
        return a * k, b * k

    def _spread_ok(self, lowest: float, highest: float) -> bool:
        return highest >= self.config.min_spread * lowest

    def _columns(self, x: FloatArray, c: FloatArray) -> tuple[FloatArray, FloatArray]:
        return x - c, x * x - c * c


class StepCostFit(_OnlineFit[StepCost]):
    """Per-step overhead and decode cost per running sequence of one worker configuration.

    A sample is one completed request: its time per output token
    (:func:`time_per_output_token_s`) and the mean number of requests running on the worker
    while it decoded (the caller's count, itself included). Robust non-negative fit of
    ``TPOT = overhead + per_seq·running``; the default until ``min_samples`` samples span
    ``min_running_span`` in running. Context-length costs are absorbed into the two
    figures; steps slowed by prefill chunks of others are down-weighted as outliers.
    """

    _value_type = StepCost

    def __init__(self, config: FitConfig = FitConfig()) -> None:
        super().__init__(config.step, (config.default_overhead_s, config.default_per_seq_s))
        self.config = config

    def observe(self, tpot_s: float, mean_running: float, ts: float) -> bool:
        """Add one sample; False (ignored) unless tpot_s > 0 and mean_running >= 1."""
        return mean_running >= 1 and self._add(mean_running, tpot_s, ts)

    @property
    def cost(self) -> StepCost:
        return self.value

    def scaled(self, overhead_s: float, per_seq_s: float) -> tuple[float, float] | None:
        """A prior (a peer group's or the default) scaled to this fit's own samples,
        for the time before it has a fit: times the median ratio of each sample to the
        prior's step at its running count. None without samples."""
        n = self.samples
        predicted = overhead_s + per_seq_s * self._x[:n]
        if n == 0 or not float(predicted.min()) > 0:
            return None
        k = float(np.median(self._y[:n] / predicted))
        return overhead_s * k, per_seq_s * k

    def _spread_ok(self, lowest: float, highest: float) -> bool:
        return highest - lowest >= self.config.min_running_span

    def _columns(self, x: FloatArray, c: FloatArray) -> tuple[FloatArray, FloatArray]:
        return np.ones_like(x), x
