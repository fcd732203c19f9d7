"""A worker whose engine stopped answering (the router's completion outcome says
``engine unreachable``) leaves the candidates for a cooldown that doubles while it keeps
failing, and comes back at its first token; errors an engine answered do not count; when
every worker is out, all are candidates again."""

from __future__ import annotations

from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.health import ENGINE_UNREACHABLE, HealthConfig, WorkerHealth
from foretoken.core.routing.service import RouteService
from foretoken.core.types import RequestId, RequestOutcome, WorkerId
from foretoken.wire.records import SchedulerSettings, WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest


def _failed(
    wid: str, rid: str = "r", error: str = f"{ENGINE_UNREACHABLE}: refused"
) -> RequestOutcome:
    return RequestOutcome(request_id=RequestId(rid), ts=0.0, kind="completion",
                          worker_id=WorkerId(wid), status="error", error=error)  # fmt: skip


def _served(wid: str) -> RequestOutcome:
    return RequestOutcome(request_id=RequestId("s"), ts=0.0, kind="first_token",
                          worker_id=WorkerId(wid), actual_ttft_s=0.2)  # fmt: skip


def test_the_cooldown_doubles_and_a_first_token_ends_it() -> None:
    h = WorkerHealth(HealthConfig(cooldown_s=10.0, max_cooldown_s=25.0))
    w = WorkerId("w")
    h.observe(_failed("w"), 0.0)
    assert h.is_out(w, 9.9) and not h.is_out(w, 10.1)
    h.observe(_failed("w"), 10.1)  # the probe failed too: 20 s now
    assert h.is_out(w, 30.0) and not h.is_out(w, 30.2)
    h.observe(_failed("w"), 31.0)  # capped at 25 s
    assert h.is_out(w, 55.9) and not h.is_out(w, 56.1)
    h.observe(_served("w"), 40.0)
    assert not h.is_out(w, 40.0) and h.trips == 3
    h.observe(_failed("w", error="engine answered 400: bad request"), 41.0)
    h.observe(_failed("w", error="engine stream broke: ServerDisconnectedError"), 41.0)
    assert not h.is_out(w, 41.0)  # an engine that answers is alive


def _service() -> RouteService:
    index = PrefixIndex()
    service = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    for wid in ("w0", "w1"):
        reg = WorkerRegistration(
            worker_id=wid, model="m", engine="vllm", engine_version="x", block_size=16,
            scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
            endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
        )  # fmt: skip
        index.register_worker(wid, "m", 16)
        service.on_registration(reg)
    return service


def _candidates(service: RouteService, rid: str, now_s: float) -> set[str]:
    query = RouteRequest(request_id=rid, model="m", token_ids=tuple(range(64))).query()
    return {c.worker_id for c in service.route(query, now_s, now_s).candidates}


def test_the_route_service_leaves_an_unreachable_worker_out() -> None:
    service = _service()
    assert _candidates(service, "a", 0.0) == {"w0", "w1"}
    service.on_outcome(_failed("w0", "a"), 1.0)
    assert _candidates(service, "b", 2.0) == {"w1"}
    service.on_outcome(_failed("w1", "b"), 3.0)
    assert _candidates(service, "c", 4.0) == {"w0", "w1"}  # every one out: all again
    service.on_outcome(_served("w1"), 5.0)
    assert _candidates(service, "d", 6.0) == {"w1"}
    assert _candidates(service, "e", 12.0) == {"w0", "w1"}  # w0's cooldown passed
