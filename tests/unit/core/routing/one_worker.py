"""A route service over one registered worker ``w0`` of model ``m`` (learner tests)."""

from __future__ import annotations

from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import SchedulerSettings, WorkerEndpoints, WorkerRegistration


def one_worker(scheduler: SchedulerSettings) -> RouteService:
    index = PrefixIndex()
    p = RouteService(index, config=PredictorConfig(explore_fraction=0.0))
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine="vllm", engine_version="x", block_size=16,
        scheduler=scheduler, endpoints=WorkerEndpoints(http_url="http://w0"),
        config_hash="c", ts=0.0,
    )  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    p.on_registration(reg)
    return p
