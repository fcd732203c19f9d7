"""Several route replicas deciding at once (issue 19): each sees the others' decisions only
when their grants arrive, so two of them placing requests within that staleness would pick
the same idle worker. With shares of the near-tie ranking they pick different ones; one
replica (no share) decides as before; a decision another replica's grant replaced leaves the
queue model it was put in."""

from __future__ import annotations

import msgspec
import pytest

from foretoken.core.routing.decide import ReplicaShare
from foretoken.core.routing.service import RouteService
from foretoken.core.types import RouteDecision, RouteQuery
from foretoken.wire.records import Grant, as_record
from tests.unit.core.routing.test_service import _predictor, _req, _store

PROMPT = list(range(8192))


def _replicas(n_workers: int = 4, shares: bool = True, **cfg: object) -> list[RouteService]:
    """Two replicas with the same view: every worker holds the prompt's prefix (near-ties)."""
    out = []
    for i in range(2):
        p = _predictor(n_workers, **cfg)
        for w in range(n_workers):
            _store(p, f"w{w}", PROMPT)
        if shares:
            p.decider.share = ReplicaShare(i, 2)
        out.append(p)
    return out


def _decide(p: RouteService, rid: str, **kw: object) -> RouteDecision:
    return p.route(_req(rid, 8192 + 64, **kw).query(), 0.0, 0.0)


def test_without_shares_two_replicas_herd_onto_one_idle_worker() -> None:
    a, b = _replicas(shares=False)
    assert _decide(a, "r1").worker_id == _decide(b, "r2").worker_id


def test_with_shares_replicas_deciding_at_once_pick_different_workers() -> None:
    a, b = _replicas()
    picks_a = [_decide(a, f"a{i}").worker_id for i in range(2)]
    picks_b = [_decide(b, f"b{i}").worker_id for i in range(2)]
    assert set(picks_a).isdisjoint(picks_b), (picks_a, picks_b)
    assert len(set(picks_a + picks_b)) == 4  # each replica spread over its own share
    assert a.decider.share_moves + b.decider.share_moves >= 1


def test_shares_never_trade_a_clearly_better_worker() -> None:
    a, b = _replicas(shares=True)
    other = list(range(100_000, 100_000 + 8192))
    for p in (a, b):  # only w0 holds this other prompt: it beats every cold worker by far
        _store(p, "w0", other)
    picks = [
        p.route(RouteQuery(request_id=f"x{i}", model="m", tokens=[*other, 1, 2, 3],
                           prompt_tokens=len(other) + 3), 0.0, 0.0).worker_id
        for i, p in enumerate((a, b))
    ]  # fmt: skip
    assert picks == ["w0", "w0"]


def test_an_owned_near_tie_that_would_be_rejected_is_not_taken() -> None:
    _a, b = _replicas(shares=True, replica_tie_margin_s=1e9)  # every candidate is "near"
    for n, wid in enumerate(("w1", "w3")):  # b's own workers: a long prefill queued there
        b.book.enqueue(wid, f"heavy{n}", 0.0, 600_000, 0, 128)  # type: ignore[arg-type]
    g = _decide(b, "bounded", max_queue_wait_s=5.0)
    assert g.admitted and g.worker_id in ("w0", "w2"), g
    assert g.predicted_ttft_s is not None and g.predicted_ttft_s <= 5.0
    unbounded = _decide(b, "free")  # no bound, but its own workers are overloaded
    assert unbounded.admitted and unbounded.worker_id in ("w0", "w2"), unbounded


@pytest.mark.parametrize("share", [None, ReplicaShare(0, 1)])
def test_one_replica_decides_as_before(share: ReplicaShare | None) -> None:
    plain, shared = _replicas(shares=False)
    shared.decider.share = share
    for i in range(6):
        assert _decide(plain, f"r{i}") == _decide(shared, f"r{i}")
    assert shared.decider.share_moves == 0


def test_a_margin_of_zero_turns_shares_off() -> None:
    a, b = _replicas(replica_tie_margin_s=0.0)
    assert _decide(a, "r1").worker_id == _decide(b, "r2").worker_id


def test_a_replica_share_is_every_nth_worker_by_id() -> None:
    p = _predictor(5)
    cands = p.predict("m", list(range(64)), 0.0)
    assert ReplicaShare(0, 2).owned(cands) == {"w0", "w2", "w4"}
    assert ReplicaShare(1, 2).owned(cands) == {"w1", "w3"}
    with pytest.raises(ValueError):
        ReplicaShare(2, 2)


def test_a_decision_replaced_by_another_replicas_grant_leaves_our_queue() -> None:
    a, b = _replicas()
    ours = _decide(a, "r1")
    theirs = _decide(b, "r1")  # the router timed out on a and asked b
    assert ours.worker_id != theirs.worker_id and ours.worker_id and theirs.worker_id
    a.on_grant(as_record(Grant, theirs), 0.1)
    assert a.book.queues[ours.worker_id].get("r1") is None
    assert a.book.queues[theirs.worker_id].get("r1") is not None
    assert a.overruled == 1
    a.on_grant(as_record(Grant, theirs), 0.2)  # idempotent
    assert a.overruled == 1
    own = _decide(a, "r2")
    a.on_grant(as_record(Grant, own), 0.3)  # our own grant coming back changes nothing
    assert a.book.queues[own.worker_id].get("r2") is not None  # type: ignore[index]
    assert a.overruled == 1


def test_another_replicas_grant_is_modelled_with_the_output_length_it_decided_on() -> None:
    """The grant carries the client's max_tokens as the deciding replica used it, so the
    request decodes as long in every replica's queue model (a replica used to assume the
    default, 128 tokens, for every decision it had not made itself)."""
    a, b = _replicas()
    theirs = _decide(b, "r1", expected_output_tokens=900)
    assert theirs.expected_output_tokens == 900
    a.on_grant(as_record(Grant, theirs), 0.1)
    entry = a.book.queues[theirs.worker_id].get("r1")  # type: ignore[index]
    assert entry is not None and entry.expected_output_tokens == 900
    unsaid = _decide(b, "r2")  # no max_tokens: the default, on both sides
    a.on_grant(as_record(Grant, unsaid), 0.2)
    entry = a.book.queues[unsaid.worker_id].get("r2")  # type: ignore[index]
    assert unsaid.expected_output_tokens is None
    assert entry is not None and entry.expected_output_tokens == a.config.default_output_tokens
    with pytest.raises(ValueError, match="expected_output_tokens"):
        as_record(Grant, msgspec.structs.replace(theirs, expected_output_tokens=0))


def test_a_grant_for_a_worker_this_replica_does_not_know_is_counted() -> None:
    a, b = _replicas()
    theirs = _decide(b, "r1")
    stranger = msgspec.structs.replace(theirs, request_id="r2", worker_id="not-registered")
    a.on_grant(as_record(Grant, theirs), 0.1)
    a.on_grant(as_record(Grant, stranger), 0.2)
    assert a.unknown_worker_grants == 1
    assert "not-registered" not in a.book.queues  # in no queue model
