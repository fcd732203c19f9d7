"""The scale-out parts that need no broker: where records go when sharded by model, the
members view (shares, owners), and the lag tracker's readiness."""

from __future__ import annotations

import zlib

import pytest

from foretoken.adapters.kafka.lag import LagTracker
from foretoken.adapters.kafka.members import MembersView
from foretoken.adapters.kafka.producer import Partitioner
from foretoken.core.routing.decide import ReplicaShare
from foretoken.settings import load_settings
from foretoken.wire.partitioning import model_partition
from foretoken.wire.records import Grant, Member, Outcome
from tests.unit.core.routing.test_service import _reg


def test_a_model_always_lands_on_the_same_partition() -> None:
    assert model_partition("llama-70b", 4) == zlib.crc32(b"llama-70b") % 4
    assert len({model_partition(f"m{i}", 4) for i in range(64)}) == 4  # all are used
    with pytest.raises(ValueError):
        model_partition("m", 0)


def _grant(rid: str, model: str, worker: str) -> Grant:
    return Grant(request_id=rid, ts=0.0, model=model, prompt_tokens=1, worker_id=worker,
                 admitted=True)  # fmt: skip


def test_sharded_records_go_by_model_and_outcomes_follow_their_grant() -> None:
    settings = load_settings(env={"FORETOKEN_SHARDING": "model", "FORETOKEN_PARTITIONS": "8"})
    p = Partitioner(settings)
    reg = _reg("w-a", model="model-a")
    assert p.partition("workers", reg) == model_partition("model-a", 8)
    assert p.partition("grants", _grant("r1", "model-b", "w-b")) == model_partition("model-b", 8)
    first = Outcome(request_id="r1", ts=0.0, kind="first_token", worker_id="w-b",
                    actual_ttft_s=0.1)  # fmt: skip
    assert p.partition("outcomes", first) == model_partition("model-b", 8)
    # a request this producer never granted: its worker's model (from the registration)
    orphan = Outcome(request_id="r9", ts=0.0, kind="completion", worker_id="w-a")
    assert p.partition("outcomes", orphan) == model_partition("model-a", 8)
    stranger = Outcome(request_id="r8", ts=0.0, kind="completion", worker_id="w-z")
    assert p.partition("outcomes", stranger) is None and p.unplaced == 1  # by key
    assert p.partition("controls", reg) is None  # not sharded


def test_unsharded_records_go_by_key() -> None:
    p = Partitioner(load_settings(env={}))
    assert p.partition("grants", _grant("r1", "m", "w")) is None


def _member(iid: str, ts: float, role: str = "route", ready: bool = True,
            sharding: str = "none", partitions: tuple[int, ...] = (0, 1, 2, 3),
            group: str = "app-route-x") -> Member:  # fmt: skip
    return Member(instance_id=iid, role=role, url=f"http://{iid}", group=group,  # type: ignore[arg-type]
                  sharding=sharding, partitions=partitions, ready=ready, ts=ts)  # type: ignore[arg-type]  # fmt: skip


def test_replica_shares_come_from_the_ready_route_replicas_alive() -> None:
    view = MembersView(max_age_s=3.0)
    for m in (_member("b", 10.0), _member("a", 10.0), _member("p", 10.0, role="primary"),
              _member("c", 10.0, ready=False), _member("old", 1.0)):  # fmt: skip
        view.apply(m)
    assert view.share("a", "app-route", 11.0) == ReplicaShare(0, 2)
    assert view.share("b", "app-route", 11.0) == ReplicaShare(1, 2)
    assert view.share("c", "app-route", 11.0) is None  # not ready: no share yet
    assert view.share("a", "other-app", 11.0) is None  # another deployment's replicas
    view.apply(_member("b", 9.0, ready=False))  # an older record never wins
    assert view.share("a", "app-route", 11.0) == ReplicaShare(0, 2)
    assert view.share("a", "app-route", 14.0) is None  # b's record aged: a is alone


def test_the_owner_of_a_model_is_the_instance_holding_its_partition() -> None:
    view = MembersView(max_age_s=3.0)
    view.apply(_member("s0", 5.0, sharding="model", partitions=(0, 2), group="app-route"))
    view.apply(_member("s1", 5.0, sharding="model", partitions=(1, 3), group="app-route"))
    for model in ("x", "y", "z", "w"):
        owner = view.owner(model, 4, 6.0)
        assert owner is not None and model_partition(model, 4) in owner.partitions


def test_readiness_waits_for_the_lag_to_fall_under_the_bound() -> None:
    lag = LagTracker({"t-grants": "grants", "t-kv": "kv_events"}, bound=10, lagging_after_s=5.0)
    tps = {("t-grants", 0), ("t-grants", 1), ("t-kv", 0)}
    lag.assign(tps, {("t-grants", 0): 100, ("t-kv", 0): 0})
    assert lag.readiness(0.0) == "catching_up"
    lag.update({("t-grants", 0): 150, ("t-grants", 1): 20, ("t-kv", 0): 5}, {}, 1.0)
    assert lag.lag() == {"grants": None, "kv_events": 5}  # partition 1 has no position yet
    assert lag.readiness(1.0) == "catching_up"
    lag.update({}, {("t-grants", 1): 18}, 2.0)  # read back: where it started
    assert lag.lag() == {"grants": 52, "kv_events": 5}
    for offset in range(100, 145):
        lag.consumed("t-grants", 0, offset)
    lag.update({}, {}, 3.0)
    assert lag.lag() == {"grants": 7, "kv_events": 5} and lag.readiness(3.0) == "ok"
    lag.update({("t-grants", 0): 500}, {}, 4.0)  # a burst: still ok for a while
    assert lag.readiness(8.0) == "ok" and lag.readiness(9.5) == "lagging"
    lag.assign(tps)  # a rebalance: catching up again
    assert lag.readiness(10.0) == "catching_up"


def test_readiness_waits_for_every_registration() -> None:
    """A replica missing a registration would refuse requests the others route: ``workers``
    must be read to its end, however small its lag next to the bound."""
    lag = LagTracker({"t-w": "workers", "t-kv": "kv_events"}, bound=500, lagging_after_s=5.0,
                     exact=frozenset({"workers"}))  # fmt: skip
    lag.assign({("t-w", 0), ("t-kv", 0)}, {("t-w", 0): 0, ("t-kv", 0): 0})
    lag.update({("t-w", 0): 3, ("t-kv", 0): 400}, {}, 1.0)
    assert lag.lag() == {"workers": 3, "kv_events": 400}
    assert lag.readiness(1.0) == "catching_up"
    for offset in range(3):
        lag.consumed("t-w", 0, offset)
    lag.update({}, {}, 2.0)
    assert lag.readiness(2.0) == "ok"


def test_a_member_stamped_far_ahead_of_the_clock_is_ignored() -> None:
    """A forged (or broken-clock) advert with a far-future ts would outrank every true
    advert of that instance forever; a reader with a clock ignores it."""
    view = MembersView(max_age_s=3.0)
    assert view.apply(_member("a", 100.0), now_s=100.0)
    assert not view.apply(_member("a", 4e9, ready=False), now_s=101.0)
    assert view.apply(_member("a", 101.0), now_s=101.0)
    assert view.members["a"].ready and view.members["a"].ts == 101.0
    assert view.share("a", "app-route", 102.0) is None  # alone, but known and ready


@pytest.mark.parametrize(
    "change",
    [{"ts": float("inf")}, {"ts": 1e300}, {"ts": -1.0}, {"instance_id": ""},
     {"instance_id": "x" * 5000}, {"url": "ftp://x"}, {"partitions": (-1,)},
     {"models": ("m" * 2000,)}],
)  # fmt: skip
def test_member_records_are_checked(change: dict[str, object]) -> None:
    fields = {"instance_id": "a", "role": "route", "url": "http://a", "group": "g",
              "sharding": "none", "partitions": (0,), "ready": True, "ts": 1.0,
              **change}  # fmt: skip
    with pytest.raises(ValueError):
        Member(**fields)  # type: ignore[arg-type]
