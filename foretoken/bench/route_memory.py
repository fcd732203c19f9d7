"""What a route process holds per worker and per request in flight (docs/SCALING.md):
``python -m foretoken.bench.route_memory``. ``tracemalloc`` over the core the processor
builds from the settings (default index backend): ``WORKERS`` registrations, then
``REQUESTS`` routed 2k-token requests on 16 workers, each left in flight (queue-model entry
and the remembered decision with its candidates). The native index allocates outside
Python's allocator: per cached block, its own estimate (``native/README.md``)."""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from typing import Any

from foretoken.compose import build_core
from foretoken.core.types import ModelName, RequestId, WorkerId
from foretoken.settings import load_settings
from foretoken.wire.records import SchedulerSettings, WorkerEndpoints, WorkerRegistration
from foretoken.wire.route_rpc import RouteRequest

WORKERS, ROUTE_WORKERS, REQUESTS, PROMPT_TOKENS = 256, 16, 2000, 2048
MODEL = ModelName("m")


def _reg(wid: str) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=WorkerId(wid), model=MODEL, engine="vllm", engine_version="x", block_size=16,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
        endpoints=WorkerEndpoints(http_url=f"http://{wid}"), config_hash="c", ts=0.0,
    )  # fmt: skip


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def measure(workers: int = WORKERS, requests: int = REQUESTS) -> dict[str, Any]:
    settings = load_settings()
    tracemalloc.start()
    out: dict[str, Any] = {"index_backend": settings.index.backend}
    for n, key in ((workers, "bytes_per_worker"), (ROUTE_WORKERS, None)):
        core = build_core(settings)
        before = _traced()
        for i in range(n):
            reg = _reg(f"w{i}")
            core.index.register_worker(reg.worker_id, reg.model, reg.block_size)
            core.service.on_registration(reg)
        if key is not None:
            out[key] = round((_traced() - before) / n)
    before, now = _traced(), time.time()
    for k in range(requests):
        tokens = tuple(range(k, k + PROMPT_TOKENS))
        req = RouteRequest(request_id=RequestId(f"r{k:08d}"), model=MODEL, token_ids=tokens)
        core.service.route(req.query(), now, now)
    out["bytes_per_request_in_flight"] = round((_traced() - before) / requests)
    out["in_flight"] = requests
    out["candidates_per_request"] = ROUTE_WORKERS
    tracemalloc.stop()
    return out


if __name__ == "__main__":
    print(json.dumps(measure()))
