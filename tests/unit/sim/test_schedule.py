"""A fleet's schedule: validated with errors naming the field; a replay applies it (the
engine's cost changes from then on; a version change re-registers the worker)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from foretoken.core.types import RequestId, WorkerId, WorkerProfile
from foretoken.sim.policy import Arrival, Decision, FleetView, IgnoresFeedback
from foretoken.sim.replay import replay
from foretoken.sim.spec import FleetSpecError, parse_fleet
from foretoken.sim.traces import TraceRequest

FLEET = """
[[engines]]
id = "e"
count = 2
model = "m"
[engines.kv]
gpu_blocks = 256
[engines.scheduler]
max_num_batched_tokens = 1024
[engines.truth]
prefill_a_s_per_token = 1e-4
prefill_b_s_per_token2 = 0.0
seed = 5
"""

CHANGE = """
[[schedule]]
at_s = 50.0
engine = "e-1"
engine_version = "0.12.0-sim"
[schedule.truth]
prefill_a_s_per_token = 4e-4
"""


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (CHANGE.replace('"e-1"', '"e"'), "$.schedule[0].engine"),
        (CHANGE.replace("at_s = 50.0", "at_s = -1.0"), "$.schedule[0].at_s"),
        (CHANGE.replace("prefill_a_s_per_token = 4e-4", "seed = 3"), "$.schedule[0].truth.seed"),
        (CHANGE.replace("prefill_a_s_per_token = 4e-4", "noise_sigma = 0.1"),
         "$.schedule[0].truth.noise_sigma"),
        (CHANGE.replace("prefill_a_s_per_token = 4e-4", "prefill_c = 1.0"),
         "$.schedule[0].truth.prefill_c"),
        (CHANGE.replace("4e-4", "-4e-4"), "$.schedule[0].truth"),
        (CHANGE.replace('engine_version = "0.12.0-sim"', 'engine_version = ""'),
         "$.schedule[0].engine_version"),
        (CHANGE.replace("at_s = 50.0", 'at_s = 50.0\nwhen = "now"'), "$.schedule[0]"),
        (CHANGE.replace("at_s = 50.0\n", ""), "at_s"),
    ],
)  # fmt: skip
def test_a_bad_schedule_is_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(FleetSpecError) as info:
        parse_fleet(FLEET + text, "f.toml")
    assert field in str(info.value)


def test_a_schedule_is_kept_in_time_order() -> None:
    later = CHANGE.replace("at_s = 50.0", "at_s = 90.0").replace('"e-1"', '"e-0"')
    fleet = parse_fleet(FLEET + later + CHANGE)
    assert [(c.at_s, c.engine) for c in fleet.schedule] == [(50.0, "e-1"), (90.0, "e-0")]


class _EverythingTo(IgnoresFeedback):
    """Sends every request to one worker; records re-registrations."""

    name = "to-one"

    def __init__(self, worker: str) -> None:
        self.worker = WorkerId(worker)
        self.registered: list[WorkerProfile] = []

    def decide(self, request: Arrival, fleet: FleetView) -> Decision:
        return Decision(self.worker, "test")

    def register(self, profile: WorkerProfile) -> None:
        self.registered.append(profile)


def _requests(times: Sequence[float]) -> list[TraceRequest]:
    return [TraceRequest(request_id=RequestId(f"r{i}"), arrival_s=t, prompt_tokens=1000,
                         output_tokens=2, segment_keys=(i + 1,), segment_lengths=(1000,))
            for i, t in enumerate(times)]  # fmt: skip


@pytest.mark.parametrize("worker", ["e-0", "e-1"])
def test_a_replay_changes_the_engine_at_its_time_and_re_registers_it(worker: str) -> None:
    fleet = parse_fleet(FLEET + CHANGE)
    policy = _EverythingTo(worker)
    records = replay(_requests([0.0, 10.0, 60.0, 70.0]), fleet, policy, progress=False).records
    assert all(r.actual_ttft_s is not None for r in records)
    ttft = [r.actual_ttft_s or 0.0 for r in records]
    if worker == "e-1":  # 4× the per-token cost after t = 50
        assert ttft[2] == pytest.approx(4 * ttft[0], rel=1e-6)
        assert ttft[3] == pytest.approx(4 * ttft[1], rel=1e-6)
    else:
        assert ttft[2] == pytest.approx(ttft[0], rel=1e-6)
    assert [(p.worker_id, p.engine_version) for p in policy.registered] == [("e-1", "0.12.0-sim")]
    assert policy.registered[0].config_hash != fleet.engine("e-1").config_hash


def test_a_change_of_costs_alone_does_not_re_register() -> None:
    fleet = parse_fleet(FLEET + CHANGE.replace('engine_version = "0.12.0-sim"\n', ""))
    policy = _EverythingTo("e-1")
    replay(_requests([0.0, 60.0]), fleet, policy, progress=False)
    assert policy.registered == []
