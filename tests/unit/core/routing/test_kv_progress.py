"""A prompt alone on an idle worker gives a prefill sample before its first token, from
the time stamp of each KV batch that stores its blocks (core/routing/kv_progress.py)."""

from __future__ import annotations

from foretoken.core.index.prefix import PrefixIndex
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.service import RouteService
from foretoken.wire.records import (
    BlockStored,
    KvEventBatch,
    SchedulerSettings,
    WorkerEndpoints,
    WorkerRegistration,
)
from foretoken.wire.route_rpc import RouteRequest

BLOCK = 16


def _service(**cfg: object) -> RouteService:
    index = PrefixIndex()
    config = PredictorConfig(**{"explore_fraction": 0.0, **cfg})  # type: ignore[arg-type]
    service = RouteService(index, config=config)
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine="vllm", engine_version="x", block_size=BLOCK,
        scheduler=SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=8),
        endpoints=WorkerEndpoints(http_url="http://w0"), config_hash="c", ts=0.0,
    )  # fmt: skip
    index.register_worker(reg.worker_id, reg.model, reg.block_size)
    service.on_registration(reg)
    return service


def _stores(seq: int, ts: float, first_block: int, blocks: int) -> KvEventBatch:
    hashes = tuple(range(first_block + 1, first_block + blocks + 1))
    tokens = tuple(range(first_block * BLOCK, (first_block + blocks) * BLOCK))
    stored = BlockStored(block_hashes=hashes, token_ids=tokens, block_size=BLOCK,  # type: ignore[arg-type]
                         parent_block_hash=first_block or None)  # type: ignore[arg-type]  # fmt: skip
    return KvEventBatch(worker_id="w0", model="m", seq=seq, ts=ts, events=(stored,))  # type: ignore[arg-type]


def _prompt(rid: str, n: int) -> RouteRequest:
    return RouteRequest(request_id=rid, model="m", token_ids=tuple(range(n)))


def test_the_stores_of_a_lone_prompt_teach_the_curve_before_its_first_token() -> None:
    service = _service()
    before = service.route(_prompt("a", 16_000).query(), 0.0, 0.0)
    assert before.fit is not None and before.fit.default
    # an engine ~10x faster than the default curve: 2,048 tokens a step, 40 ms a step
    for step in range(3):
        service.on_kv_batch(_stores(step, 0.04 * (step + 1), 128 * step, 128), 0.04 * (step + 1))
    assert service.learner.progress.samples == 3
    curve = service.fits.curve("w0")  # type: ignore[arg-type]
    assert not curve.default  # the busy-chain fit answers from its first sample
    assert 0.2 * 0.04 / 2048 < curve.a < 5 * 0.04 / 2048


def test_no_sample_once_another_prompt_is_there_or_when_turned_off() -> None:
    for second, cfg in ((True, {}), (False, {"kv_progress_samples": False})):
        service = _service(**cfg)
        service.route(_prompt("a", 16_000).query(), 0.0, 0.0)
        if second:
            service.route(_prompt("b", 9_000).query(), 0.01, 0.01)  # its stores could be either's
        service.on_kv_batch(_stores(0, 0.04, 0, 128), 0.04)
        assert service.learner.progress.samples == 0
        assert service.fits.curve("w0").default  # type: ignore[arg-type]


def test_a_busy_or_cold_fit_takes_over_from_the_progress_samples() -> None:
    """One prompt's stores grow its tokens and its steps together, so they cannot tell ``a``
    from the step overhead: they answer only until another fit of the worker has a curve.
    (The same batches are step samples for the busy fit too — off here, to see the two
    fits apart.)"""
    service = _service(kv_step_samples=False)
    service.route(_prompt("a", 16_000).query(), 0.0, 0.0)
    for step in range(3):
        service.on_kv_batch(_stores(step, 0.04 * (step + 1), 128 * step, 128), 0.04 * (step + 1))
    fits = service.fits.fits("w0")  # type: ignore[arg-type]
    assert fits is not None and fits.source == "progress" and fits.busy is None
    progress_a = service.fits.curve("w0").a  # type: ignore[arg-type]
    # a busy chain of a slower engine (one 4,096-token prompt in 0.4 s, exact): it answers
    service.fits.observe_busy_chain("w0", "c", 4096, 4096**2, 0.4, 1.0, 2, 0.0, True)  # type: ignore[arg-type]
    assert fits.source == "busy"
    assert service.fits.curve("w0").a > 2 * progress_a  # type: ignore[arg-type]
