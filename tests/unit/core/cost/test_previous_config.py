"""A worker's previous configuration is the prior of its new one (after peers of the very
same configuration, before peers of another engine version or GPU): an engine upgrade
moves a worker's speed by tens of percent, the model's other workers may be 4x faster."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from foretoken.core.cost.registry import FitRegistry
from foretoken.core.types import ModelName, WorkerId
from tests.unit.core.cost.test_fit import cold_samples, registration

SLOW, FAST = (6.0e-5, 5.0e-11), (1.5e-5, 1.0e-11)
UPGRADED, PEER, TWIN = WorkerId("upgraded"), WorkerId("peer"), WorkerId("twin")


def _fit(registry: FitRegistry, worker: WorkerId, config: str, curve: tuple[float, float]) -> None:
    rng = np.random.default_rng(len(worker) + len(config))
    for i, (n, s) in enumerate(cold_samples(rng, curve, 40, 0.03)):
        assert registry.observe_cold(worker, config, n, s, float(i))


def _fitted(own: tuple[float, float], peer: tuple[float, float]) -> FitRegistry:
    """The upgraded worker fitted on its first configuration, beside a fitted peer."""
    registry = FitRegistry()
    registry.apply_registration(registration(UPGRADED, "v1"))
    registry.apply_registration(registration(PEER, "peer-gpu"))
    _fit(registry, UPGRADED, "v1", own)
    _fit(registry, PEER, "peer-gpu", peer)
    return registry


def test_an_upgraded_worker_starts_from_its_own_previous_fit_not_from_faster_peers() -> None:
    registry = _fitted(SLOW, FAST)
    before = registry.curve(UPGRADED)
    assert not before.default
    registry.apply_registration(registration(UPGRADED, "v2"))  # the upgrade: no samples yet
    prior = registry.curve(UPGRADED)
    assert prior.default  # still a prior, flagged as one
    assert prior.a == pytest.approx(before.a) and prior.b == pytest.approx(before.b)
    # a twin already fitted on the new configuration is closer still
    registry.apply_registration(registration(TWIN, "v2"))
    _fit(registry, TWIN, "v2", (4.0e-5, 3.0e-11))
    assert registry.curve(UPGRADED).a == pytest.approx(registry.own_curve(TWIN).a)
    # its own samples on the new configuration take over
    _fit(registry, UPGRADED, "v2", (7.0e-5, 6.0e-11))
    assert not registry.curve(UPGRADED).default
    assert registry.curve(UPGRADED).a == pytest.approx(7.0e-5, rel=0.1)


def test_another_model_or_a_removal_forgets_the_previous_configuration() -> None:
    registry = _fitted(SLOW, FAST)
    other_model = msgspec.structs.replace(registration(UPGRADED, "m2"), model=ModelName("m2"))
    registry.apply_registration(other_model)
    assert registry.curve(UPGRADED) == registry.own_curve(UPGRADED)  # no peer, no prior
    registry.apply_registration(registration(UPGRADED, "v2"))  # back to the model "m"
    assert registry.curve(UPGRADED).a == pytest.approx(registry.own_curve(PEER).a)
    registry.apply_registration(registration(UPGRADED, "v2", removed=True))
    registry.apply_registration(registration(UPGRADED, "v3"))
    assert registry.curve(UPGRADED).a == pytest.approx(registry.own_curve(PEER).a)


def test_of_its_previous_fit_and_its_peers_the_slower_is_the_prior() -> None:
    """Priced at the faster of two guesses, a slow worker draws a burst; priced at the
    slower, a fast one gets fewer requests until its first samples scale the prior."""
    registry = _fitted(FAST, SLOW)
    registry.apply_registration(registration(UPGRADED, "v2"))
    assert registry.curve(UPGRADED).a == pytest.approx(registry.own_curve(PEER).a)
