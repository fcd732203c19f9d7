"""FitRegistry answers each worker's (curve, step cost) once per change of what they depend
on (its own observations, a pooled value it took): the remembered answers must equal
answers computed afresh after every kind of change."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from foretoken.core.cost.fit import FitConfig
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.types import ModelName, WorkerId, WorkerProfile

WORKERS = [WorkerId(f"w{i}") for i in range(3)]


def _profile(worker: WorkerId, config_hash: str, engine: str, removed: bool) -> WorkerProfile:
    return WorkerProfile(
        worker_id=worker, model=ModelName("m"), engine=engine, engine_version="1",
        block_size=16, config_hash=config_hash, ts=0.0, removed=removed,
    )  # fmt: skip


_OP = st.tuples(
    # weighted so that fits of their own (8 samples of one configuration) come often
    st.sampled_from(
        ["register"] * 3 + ["remove", "restore", "busy"] + ["cold", "chain"] * 3 + ["decode"] * 5
    ),
    st.integers(0, len(WORKERS) - 1),
    st.sampled_from([0, 0, 0, 1]),  # configuration / engine choice
    st.floats(0.2, 5.0),  # a scale for the sample
)


def _fresh(registry: FitRegistry, worker: WorkerId) -> tuple[object, object]:
    saved = dict(registry._answers)
    registry._answers.clear()
    try:
        return registry.curve(worker), registry.step_cost(worker)
    finally:
        registry._answers.clear()
        registry._answers.update(saved)


@settings(max_examples=120, deadline=None)
@given(st.lists(_OP, min_size=20, max_size=150))
def test_remembered_answers_equal_fresh_ones(ops: list[tuple[str, int, int, float]]) -> None:
    config = FitConfig()
    registry = FitRegistry(config)
    for step, (op, i, choice, scale) in enumerate(ops):
        worker, config_hash = WORKERS[i], f"h{choice}"
        ts = float(step)
        n = int(500 + 3000 * scale)
        if op in ("register", "remove"):
            engine = "vllm" if choice == 0 else "sglang"
            registry.apply_registration(_profile(worker, "h0", engine, op == "remove"))
        elif op == "cold":
            registry.observe_cold(worker, config_hash, n, 1e-4 * n * scale, ts)
        elif op == "busy":
            registry.observe_busy(worker, config_hash, n, 2e-4 * n * scale, ts)
        elif op == "chain":
            registry.observe_busy_chain(worker, config_hash, 2.0 * n, 2.0 * n * n, 3e-4 * n * scale,
                                        ts, steps=3, decoding=2.0)  # fmt: skip
        elif op == "decode":
            registry.observe_decode(worker, config_hash, 0.01 * scale, 1.0 + 10 * scale, ts)
        else:
            copy = FitRegistry(config)
            copy.restore(registry.snapshot())
            registry = copy
        for w in WORKERS:  # remembered answers (asked twice: the second one is the memo's)
            registry.curve(w)
            assert (registry.curve(w), registry.step_cost(w)) == _fresh(registry, w)


def test_a_worker_on_pooled_values_follows_its_peers_without_an_observation_of_its_own() -> None:
    registry = FitRegistry(FitConfig())
    quiet, busy = WORKERS[0], WORKERS[1]
    for worker in (quiet, busy):
        registry.apply_registration(_profile(worker, "h0", "vllm", removed=False))
    default_step, default_curve = registry.step_cost(quiet), registry.curve(quiet)
    for i in range(8):  # the peer's step fit comes into being (8 samples spanning running)
        registry.observe_decode(busy, "h0", 0.01 * (1 + i % 4), 1.0 + 10 * (i % 4), float(i))
        registry.step_cost(quiet)
    assert registry.step_cost(quiet) != default_step
    assert registry.step_cost(quiet).per_seq_s == registry.step_cost(busy).per_seq_s
    assert registry.curve(quiet).default and registry.curve(busy).default
    for i in range(8):  # then its cold prefill fit
        registry.observe_cold(busy, "h0", 1000 * (1 + i), 3e-4 * 1000 * (1 + i), float(i))
        registry.curve(quiet)
    assert not registry.curve(busy).default
    assert registry.curve(quiet).a == registry.curve(busy).a != default_curve.a
