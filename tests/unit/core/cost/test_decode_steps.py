"""A decode step's time from a stream's token gaps, and the step-cost priors before a fit
of its own: the peers' step cost as a whole pair, scaled to the worker's own samples."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from foretoken.core.cost.fit import FitConfig, StepCostFit
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.cost.samples import decode_step_s
from foretoken.core.types import ModelName, WorkerId, WorkerProfile


def test_steady_gaps_give_the_step() -> None:
    assert decode_step_s([0.02] * 10) == 0.02


def test_steps_that_carry_a_chunk_do_not_count_even_when_most_do() -> None:
    rng = np.random.default_rng(1)
    decode = 0.02 * rng.lognormal(0.0, 0.05, 30)  # 30 steps that only decode
    mixed = 0.2 * rng.lognormal(0.0, 0.3, 70)  # 70 that also carry another prompt's chunk
    gaps = rng.permutation(np.concatenate([decode, mixed])).tolist()
    step = decode_step_s(gaps)
    assert step is not None and abs(step / 0.02 - 1.0) < 0.06
    assert float(np.median(gaps)) > 0.1  # the plain median would be a chunked step


def test_too_few_gaps_give_nothing() -> None:
    assert decode_step_s([]) is None
    assert decode_step_s([0.01]) is None
    assert decode_step_s([0.0, 0.0]) is None  # not a time


@given(st.lists(st.floats(1e-4, 10.0), min_size=2, max_size=200))
def test_the_figure_is_a_gap_no_slower_than_the_median(gaps: list[float]) -> None:
    value = decode_step_s(gaps)
    assert value in gaps
    assert min(gaps) <= value <= float(np.median(gaps))


def _profile(worker: str, config_hash: str) -> WorkerProfile:
    return WorkerProfile(
        worker_id=WorkerId(worker), model=ModelName("m"), engine="vllm", engine_version="1",
        block_size=16, config_hash=config_hash, ts=0.0,
    )  # fmt: skip


def _fit(registry: FitRegistry, worker: str, config_hash: str, overhead: float,
         per_seq: float) -> None:  # fmt: skip
    for i in range(8):
        running = 1.0 + 8 * (i % 4)
        registry.observe_decode(WorkerId(worker), config_hash, overhead + per_seq * running,
                                running, float(i))  # fmt: skip


def test_peers_step_costs_are_pooled_as_a_whole_pair() -> None:
    """Overhead and per-sequence cost trade off in a fit whose samples span few running
    counts, so a peer group's step cost is one peer's pair (the median step at 16
    sequences), not medians taken apart — here those would pair p2's overhead with p0's
    per-sequence cost, a step no peer has."""
    registry = FitRegistry(FitConfig())
    peers = {"p0": (0.030, 5e-4), "p1": (0.0, 2e-3), "p2": (0.010, 1e-4)}
    for worker, cfg in [*((w, "other") for w in peers), ("new", "mine")]:
        registry.apply_registration(_profile(worker, cfg))
    for worker, (overhead, per_seq) in peers.items():
        _fit(registry, worker, "other", overhead, per_seq)
    fitted = {w: registry.step_cost(WorkerId(w)) for w in peers}
    assert all(abs(fitted[w].overhead_s - o) < 1e-6 for w, (o, _) in peers.items())
    step = registry.step_cost(WorkerId("new"))
    assert (step.overhead_s, step.per_seq_s) == (fitted["p1"].overhead_s, fitted["p1"].per_seq_s)
    assert step.default  # still not a fit of its own


def test_a_worker_scales_its_prior_to_its_own_first_samples() -> None:
    fit = StepCostFit(FitConfig())
    assert fit.scaled(0.015, 5e-4) is None  # nothing of its own yet
    for running in (4.0, 8.0, 12.0):  # three samples, 2x the prior's step at each
        fit.observe(2 * (0.015 + 5e-4 * running), running, 0.0)
    assert fit.cost.default
    overhead, per_seq = fit.scaled(0.015, 5e-4)
    assert abs(overhead - 0.030) < 1e-12 and abs(per_seq - 1e-3) < 1e-12


def test_the_registry_answers_the_scaled_prior_until_the_fit_takes_over() -> None:
    registry = FitRegistry(FitConfig())
    registry.apply_registration(_profile("w", "h"))
    default = registry.step_cost(WorkerId("w"))
    registry.observe_decode(WorkerId("w"), "h", 0.5 * default.decode_step_s(10.0), 10.0, 0.0)
    halved = registry.step_cost(WorkerId("w"))
    assert halved.default
    assert abs(halved.decode_step_s(10.0) / default.decode_step_s(10.0) - 0.5) < 1e-9
