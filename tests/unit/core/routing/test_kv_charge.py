"""A credited prefix nobody on the engine holds is charged as KV blocks
(``PredictorConfig.kv_charge_unheld_cache``): an engine takes a hit on a cached block with
no reference out of its free pool (vLLM counts evictable computed blocks at allocation), so
only the depth a prompt still held there shares is free of charge."""

from __future__ import annotations

import numpy as np
import pytest

from foretoken.core.routing.service import RouteService
from foretoken.wire.route_rpc import RouteRequest
from tests.unit.core.routing.test_evict_under_pressure import (
    CACHED,
    MODEL,
    _filler,
    _req,
    _service,
)


def _pinned(service: RouteService, prompt: list[int]) -> tuple[int, int]:
    (candidate,) = service.predictions.candidates(MODEL, prompt, 0.0, None)
    return candidate.cached_tokens, candidate.pinned_tokens


@pytest.mark.parametrize("native", [True, False])
def test_only_the_depth_a_held_prompt_shares_is_pinned(native: bool) -> None:
    prompt = CACHED + [7] * 200
    service = _service(native, gpu_blocks=256)
    assert _pinned(service, prompt) == (len(CACHED), 0)  # from the index alone: charged
    service.route(_req("holder", CACHED[:256] + [5] * 50).query(), 0.0, 0.0)
    assert _pinned(service, prompt) == (len(CACHED), 256)  # the holder shares 16 blocks
    off = _service(native, gpu_blocks=256, kv_charge_unheld_cache=False)
    assert _pinned(off, prompt) == (len(CACHED), -1)  # every credited block counted shared


@pytest.mark.parametrize("native", [True, False])
def test_an_unheld_credit_that_does_not_fit_beside_the_running_waits(native: bool) -> None:
    """A 600-token prompt runs, reserving 46 of 64 blocks with its 128 expected output
    tokens; the new prompt's 32 credited blocks, held by nobody, do not fit beside it, so it
    waits for that one to finish — its 15 uncached blocks alone would have fitted."""
    big = np.random.default_rng(3).integers(100_000, 200_000, 600).tolist()
    prompt = CACHED + [7] * 100
    waits = {}
    for charge in (True, False):
        service = _service(native, gpu_blocks=64, evict_under_pressure=False,
                           kv_charge_unheld_cache=charge)  # fmt: skip
        service.route(_req("big", big).query(), 0.0, 0.0)
        grant = service.route(_req("a", prompt).query(), 0.0, 0.0)
        assert grant.cached_tokens == len(CACHED)
        assert grant.queue_wait_s is not None
        waits[charge] = grant.queue_wait_s
    assert waits[True] > waits[False] + 0.05


@pytest.mark.parametrize("native", [True, False])
def test_a_holder_that_finishes_before_the_request_is_admitted_pins_nothing(
    native: bool,
) -> None:
    """A held prompt pins its blocks only while it runs: with 3,000 uncached tokens sent
    after it on a 512-token step budget (at least 6 steps before the new prompt starts), a
    holder expecting 4 output tokens has finished and its shared blocks are charged again; one
    expecting 64 still runs and they stay free."""
    prompt = CACHED + [7] * 200
    for output, pinned in ((4, 0), (64, 256)):
        service = _service(native, gpu_blocks=256)
        holder = RouteRequest(request_id="holder", model=MODEL,
                              token_ids=tuple(CACHED[:256] + [5] * 50),
                              expected_output_tokens=output)  # fmt: skip
        service.route(holder.query(), 0.0, 0.0)
        for i in range(2):  # 1,500 uncached tokens each
            service.route(_req(f"f{i}", _filler(i)).query(), 0.0, 0.0)
        assert _pinned(service, prompt) == (len(CACHED), pinned)
