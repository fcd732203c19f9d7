"""The busy-chain prefill curve (``core/cost/busy_fit.py``): ``a`` from every chain with the
steps taken out at the step cost it is asked with, ``b`` from the exact chains once they
span long prompts, and the samples a registry feeds it."""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.cost.registry import FitRegistry
from tests.unit.core.cost.test_fit import W1, registration


def test_busy_chain_fit_recovers_a_with_b_fixed_despite_two_sided_noise() -> None:
    from foretoken.core.cost.busy_fit import BusyChainFit
    from foretoken.core.cost.fit import FitConfig

    rng = np.random.default_rng(7)
    a, b = 3.0e-5, 3.7e-11
    fit = BusyChainFit(FitConfig(), b=b)
    assert fit.curve.default
    for i in range(60):
        n = rng.integers(2_000, 40_000, size=3)
        u, v = float(n.sum()), float((n * n).sum())
        noise = rng.choice([0.7, 1.0, 1.0, 1.0, 1.6])  # shared steps on either side
        assert fit.observe_uv(u, v, (a * u + b * v) * noise * rng.lognormal(0, 0.05), float(i))
    curve = fit.refit()
    assert not curve.default and curve.b == b
    assert curve.a == pytest.approx(a, rel=0.1)


def test_busy_chain_fit_takes_out_the_steps_at_the_step_cost_it_is_asked_with() -> None:
    """Samples keep their raw time and steps: the same window answers for the step cost
    current when asked (the first samples come while it is the default), and a sample
    the steps dominate (prefill below busy_min_share of its time) does not answer."""
    from foretoken.core.cost.busy_fit import BusyChainFit
    from foretoken.core.cost.fit import FitConfig

    a, b, overhead = 2.0e-5, 3.7e-11, 0.003  # the engine's
    fit = BusyChainFit(FitConfig(busy_min_share=0.5, busy_min_tokens=0), b=b)
    n = 374
    assert fit.observe_uv(n, n * n, overhead + a * n + b * n * n, 0.0, steps=1)
    # at the true overhead: a exactly; at a default 15 ms the 10.5 ms sample is dominated
    assert fit.curve_with(overhead, 0.0).a == pytest.approx(a)
    assert fit.curve_with(0.015, 0.0).default
    n = 6000  # a long prompt over 3 steps with 4 decoding: the decode is taken out too
    assert fit.observe_uv(n, n * n, 3 * (overhead + 4 * 1e-4) + a * n + b * n * n, 1.0, steps=3,
                          decoding=4)  # fmt: skip
    assert fit.curve_with(overhead, 1e-4).a == pytest.approx(a)
    high = fit.curve_with(0.015, 0.0)
    assert not high.default and high.samples == 1 and high.a < a  # only the long one answers
    assert fit.curve_with(0.015, 0.0) is high  # cached until a sample or the step cost changes


def test_a_long_chain_outweighs_short_prompts_read_at_a_step_cost_a_little_off() -> None:
    """Three one-step 400-token prompts, their step overhead taken out 3.7 ms short, read
    a 50% too high; one 54k-token chain over 7 steps reads it within 2%. Counted alike, the
    short ones would set the median; weighted by the root of their tokens per step, the
    chain does."""
    from foretoken.core.cost.busy_fit import BusyChainFit
    from foretoken.core.cost.fit import FitConfig

    a, b, overhead, learned = 1.7e-5, 3.7e-11, 0.0166, 0.0129
    fit = BusyChainFit(FitConfig(), b=b)
    for i, n in enumerate((394, 369, 420)):
        assert fit.observe_uv(n, n * n, overhead + a * n + b * n * n, float(i), steps=1)
    chunks = [7_714] * 7
    u, v = float(sum(chunks)), float(sum(c * c for c in chunks))
    assert fit.observe_uv(u, v, 7 * overhead + a * u + b * v, 3.0, steps=7)
    assert fit.curve_with(learned, 0.0).a == pytest.approx(a, rel=0.05)


def test_a_busy_chain_fit_answers_once_its_samples_hold_enough_new_tokens() -> None:
    """One step of a 34-token prompt is nearly all overhead: taken out at a step cost a
    little off, what is left says nothing of ``a``. The fit waits for ``busy_min_tokens``."""
    from foretoken.core.cost.busy_fit import BusyChainFit
    from foretoken.core.cost.fit import FitConfig

    a, b, overhead = 3.3e-5, 3.7e-11, 0.013
    fit = BusyChainFit(FitConfig(busy_min_tokens=512), b=b)
    assert fit.observe_uv(34, 34 * 34, overhead + a * 34, 0.0, steps=1)
    assert fit.curve_with(0.0128, 0.0).default  # 34 tokens: not an answer
    assert fit.observe_uv(3000, 3000**2, 2 * overhead + a * 3000 + b * 3000**2, 1.0, steps=2)
    curve = fit.curve_with(overhead, 0.0)
    assert not curve.default and curve.a == pytest.approx(a, rel=0.01)


def test_a_busy_sample_after_a_busy_chain_feeds_the_chain_fit_in_its_regressors() -> None:
    """A serial engine's busy samples (prompt, cached, seconds) land in the busy-chain fit a
    graded cold sample may have started: as a chain of one prompt, u = N − K, v = N² − K²
    (not N and K in place of u and v)."""
    from foretoken.core.cost.busy_fit import BusyChainFit

    a, b = 3.0e-5, 3.7e-11  # b: the busy fit's fixed reference value
    registry = FitRegistry()
    registry.apply_registration(registration(W1, "h1"))
    n0 = 10_000
    assert registry.observe_busy_chain(W1, "h1", n0, n0 * n0, a * n0 + b * n0 * n0, 0.0)
    for i, (n, k) in enumerate(
        [(20_000, 10_000), (30_000, 16_000), (40_000, 24_000), (16_000, 8_000)]
    ):
        seconds = a * (n - k) + b * (n * n - k * k)
        assert registry.observe_busy(W1, "h1", n, seconds, float(i + 1), cached_tokens=k)
    fits = registry.fits(W1)
    assert fits is not None and isinstance(fits.busy, BusyChainFit)
    assert fits.busy.samples == 5
    assert registry.curve(W1).a == pytest.approx(a, rel=0.02)


def test_a_busy_chain_fit_learns_b_from_exact_samples_that_span_long_prompts() -> None:
    """Exact samples (a prompt alone from a known start) up to 64k tokens determine b;
    busy chains, or exact samples of 0.7k-1.4k tokens whose step overhead was taken out
    wrong, leave it at the reference (they would read a step error as a quadratic)."""
    from foretoken.core.cost.busy_fit import BusyChainFit
    from foretoken.core.cost.fit import REFERENCE_B_S_PER_TOKEN2, FitConfig

    a, b = 5e-5, 2e-10  # a long-context engine: b 5x the reference
    sizes = [2000, 4000, 8000, 16_000, 24_000, 32_000, 48_000, 64_000]
    for exact, expected_b in ((True, b), (False, REFERENCE_B_S_PER_TOKEN2)):
        fit = BusyChainFit(FitConfig())
        for i, n in enumerate(sizes):
            noise = 1.0 + (0.02 if i % 2 else -0.02)
            assert fit.observe_uv(n, n * n, (a * n + b * n * n) * noise, float(i), exact=exact)
        curve = fit.curve_with(0.0, 0.0)
        assert fit.exact_samples == (len(sizes) if exact else 0)  # /v1/fits: busy_exact
        assert curve.b == pytest.approx(expected_b, rel=0.1)
        if exact:
            assert curve.a == pytest.approx(a, rel=0.1)
    short = BusyChainFit(FitConfig())
    for i, n in enumerate([700, 800, 900, 1000, 1100, 1200, 1300, 1400]):
        step_error = 0.004  # one step's overhead, taken out 4 ms too long
        assert short.observe_uv(n, n * n, a * n - step_error, float(i), steps=1, exact=True)
    assert short.curve_with(0.0, 0.0).b == REFERENCE_B_S_PER_TOKEN2
