"""`foretoken replay --controls on|off --classes ...`: the controller runs in virtual time
through the predictor policy, and acts (admission control sheds best-effort work first)."""

from __future__ import annotations

import pytest

from foretoken.settings import ControlSettings, WorkloadClass
from foretoken.sim.commands import replay_command

SETTINGS = ControlSettings(
    default_class="interactive",
    classes={
        # A budget of 0.05 s: any queueing at all breaches it.
        "interactive": WorkloadClass(objective_ttft_s=0.3, non_queue_latency_s=0.2,
                                     margin_s=0.05, priority=10, protected=True),
        "batch": WorkloadClass(objective_ttft_s=600.0, priority=0),
    },
    window_s=3.0, min_samples=5, breach_s=0.2, recovery_s=60.0, evaluate_every_s=0.1,
    corroborating_queue_tokens=1,
)  # fmt: skip


def _run(controls: str, policy: str = "predictor") -> dict[str, object]:
    return replay_command(
        trace="azure-code", fleet="hetero", policy=policy, speedup=None, capacity_factor=2.0,
        limit=1000, bounds=None, out=None, seed=0, progress=False, controls=controls,
        classes="interactive:0.4,batch:0.6", control_settings=SETTINGS,
    )  # fmt: skip


def test_controls_on_shed_best_effort_and_never_the_protected_class() -> None:
    on = _run("on")
    classes = on["classes"]
    assert isinstance(classes, dict)
    entries = on["control_stage_entries"]
    assert isinstance(entries, dict) and entries["admission"] >= 1
    assert classes["batch"]["rejected"] > 0  # shed by admission control
    assert classes["interactive"]["rejected"] == 0  # protected: kept
    off = _run("off")
    assert off["rejected"] == 0 and "control_transitions" not in off
    assert off["classes"]["batch"]["requests"] == classes["batch"]["requests"]  # type: ignore[index]


def test_controls_need_the_predictor_policy() -> None:
    with pytest.raises(ValueError, match="predictor"):
        _run("on", policy="round-robin")
    with pytest.raises(ValueError, match="on or off"):
        _run("maybe")
