"""A small, valid sample of every record type (for the demo and the integration tests)."""

from __future__ import annotations

import time

from foretoken.core.types import EngineBlockHash, ModelName, RequestId, WorkerId
from foretoken.wire.records import (
    BlockRemoved,
    BlockStored,
    Graded,
    Grant,
    KvEventBatch,
    Outcome,
    Record,
    WorkerEndpoints,
    WorkerRegistration,
)

MODEL = ModelName("sample-model")
BLOCK = 16


def sample_records(n_requests: int = 3, run: str = "demo") -> list[tuple[str, Record]]:
    now = time.time()
    worker = WorkerId(f"{run}-w0")
    out: list[tuple[str, Record]] = [
        (
            "workers",
            WorkerRegistration(
                worker_id=worker,
                model=MODEL,
                engine="vllm",
                engine_version="0.11.0",
                block_size=BLOCK,
                endpoints=WorkerEndpoints(http_url="http://127.0.0.1:8001"),
                config_hash="sample",
                ts=now,
            ),
        ),
        (
            "kv_events",
            KvEventBatch(
                worker_id=worker,
                model=MODEL,
                seq=0,
                ts=now,
                events=(
                    BlockStored(
                        block_hashes=(EngineBlockHash(1), EngineBlockHash(2)),
                        token_ids=tuple(range(2 * BLOCK)),
                        block_size=BLOCK,
                    ),
                    BlockRemoved(block_hashes=(EngineBlockHash(2),)),
                ),
            ),
        ),
    ]
    for i in range(n_requests):
        rid = RequestId(f"{run}-r{i}")
        predicted, actual = 0.2 + 0.1 * i, 0.25 + 0.1 * i
        out.append(
            (
                "grants",
                Grant(
                    request_id=rid, ts=now, model=MODEL, prompt_tokens=512 * (i + 1),
                    worker_id=worker, admitted=True, predicted_ttft_s=predicted,
                ),
            )
        )  # fmt: skip
        out.append(
            (
                "outcomes",
                Outcome(
                    request_id=rid, ts=now + actual, kind="first_token", worker_id=worker,
                    actual_ttft_s=actual, engine_cached_tokens=0,
                ),
            )
        )  # fmt: skip
        out.append(
            (
                "graded",
                Graded(
                    request_id=rid, ts=now, model=MODEL, workload_class="default",
                    worker_id=worker, status="served", admitted=True,
                    prompt_tokens=512 * (i + 1), predicted_ttft_s=predicted,
                    actual_ttft_s=actual, error_s=predicted - actual,
                ),
            )
        )  # fmt: skip
    return out
